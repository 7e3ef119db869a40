// BucketUploader (core/io/bucket_uploader.h) against a real Ceph RGW (tests/s3/rgw.sh exec): the
// restart after a crash, from a journal as a killed daemon leaves it: a multipart upload it had
// begun (with a part in it) is aborted, the items not done are uploaded in the journal's order
// (a large one as a multipart upload), a done one is not, and the staged copies go at Stop; a
// hostile journal (a path out of the staging directory, a symlink in it) never uploads what lies
// outside. Without AWS_ENDPOINT_URL it fails: the store must be there.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "core/io/bucket_uploader.h"
#include "core/io/s3_tree.h"
#include "core/io/upload_journal.h"

namespace ucpfs::io {
namespace {

namespace stdfs = std::filesystem;

std::string Unique(const std::string& what) {
  return what + "-" + std::to_string(getpid()) + "-" +
         std::to_string(std::chrono::steady_clock::now().time_since_epoch().count() % 1000000);
}

class BucketUploaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NE(std::getenv("AWS_ENDPOINT_URL"), nullptr) << "run under tests/s3/rgw.sh exec DIR";
    bucket_ = Unique("ucpfs-upl");
    auto tree = S3Tree::FromEnvironment("s3://" + bucket_ + "/p");
    ASSERT_TRUE(tree.ok()) << tree.error().ToString();
    client_ = (*tree)->client();
    ASSERT_TRUE(client_->CreateBucket(bucket_).ok());
    stage_ = stdfs::temp_directory_path() / Unique("ucpfs-stage");
    stdfs::create_directories(stage_ / ".ucpfs" / "upload");
  }
  void TearDown() override { stdfs::remove_all(stage_); }

  struct stat Write(const std::string& rel, const std::string& body) {
    stdfs::create_directories((stage_ / rel).parent_path());
    std::ofstream(stage_ / rel, std::ios::binary) << body;
    struct stat st = {};
    EXPECT_EQ(::stat((stage_ / rel).c_str(), &st), 0);
    return st;
  }
  void WriteJournal(const std::vector<UploadRecord>& records) {
    std::ofstream out(stage_ / ".ucpfs" / "upload" / "journal", std::ios::binary);
    out.write(kUploadJournalMagic, sizeof(kUploadJournalMagic));
    for (const UploadRecord& r : records) {
      const std::vector<std::byte> b = EncodeUploadRecord(r);
      out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    }
  }
  static UploadRecord Queued(uint64_t id, const std::string& path, const struct stat& st) {
    UploadRecord r;
    r.type = UploadRecordType::kQueued;
    r.id = id;
    r.path = path;
    r.size = static_cast<uint64_t>(st.st_size);
    r.ino = st.st_ino;
    r.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
    return r;
  }
  Result<std::unique_ptr<BucketUploader>> StartUploader() {
    BucketUploaderOptions o;
    o.client = client_;
    o.bucket = bucket_;
    o.prefix = "p";
    o.stage_dir = stage_.string();
    o.state_dir = (stage_ / ".ucpfs" / "upload").string();
    o.log = [this](const std::string& line) {
      std::lock_guard lock(mu_);
      log_.push_back(line);
    };
    o.on_uploaded = [this](const std::string& rel) {
      std::lock_guard lock(mu_);
      uploaded_.push_back(rel);
    };
    return BucketUploader::Start(std::move(o));
  }
  std::string Get(const std::string& key) {
    auto info = client_->Head(bucket_, key);
    if (!info.ok()) return "missing: " + info.error().ToString();
    std::string out(info->n_bytes, '\0');
    const Status s = client_->GetRange(bucket_, key, 0, std::as_writable_bytes(std::span(out.data(), out.size())));
    return s.ok() ? out : "error: " + s.ToString();
  }

  std::shared_ptr<s3::Client> client_;
  std::string bucket_;
  stdfs::path stage_;
  std::mutex mu_;
  std::vector<std::string> log_, uploaded_;
};

TEST_F(BucketUploaderTest, RestartAbortsBegunUploadsAndUploadsWhatWasNotDoneInOrder) {
  const std::string big(12u << 20, 'b');  // two 8 MiB parts
  const struct stat shard = Write("step/shard.bin", big);
  const struct stat done = Write("step/early.bin", "uploaded before the crash");
  const struct stat meta = Write("step/.metadata", "the pointer, closed last");
  // The killed daemon had begun a multipart upload of the shard, one part in.
  auto begun = client_->CreateMultipartUpload(bucket_, "p/step/shard.bin");
  ASSERT_TRUE(begun.ok()) << begun.error().ToString();
  const std::string junk(5u << 20, 'j');
  ASSERT_TRUE(client_->UploadPart(bucket_, "p/step/shard.bin", *begun, 1, std::as_bytes(std::span(junk))).ok());
  UploadRecord begun_rec;
  begun_rec.type = UploadRecordType::kBegun;
  begun_rec.id = 2;
  begun_rec.upload_id = *begun;
  UploadRecord done_rec;
  done_rec.type = UploadRecordType::kDone;
  done_rec.id = 1;
  WriteJournal({Queued(1, "step/early.bin", done), Queued(2, "step/shard.bin", shard), begun_rec, done_rec,
                Queued(3, "step/.metadata", meta)});
  auto uploader = StartUploader();
  ASSERT_TRUE(uploader.ok()) << uploader.error().ToString();
  ASSERT_TRUE((*uploader)->WaitUploaded(10000, nullptr).ok());
  {
    std::lock_guard lock(mu_);
    EXPECT_EQ(uploaded_, (std::vector<std::string>{"step/shard.bin", "step/.metadata"}));
  }
  EXPECT_EQ(Get("p/step/shard.bin"), big);
  EXPECT_EQ(Get("p/step/.metadata"), "the pointer, closed last");
  EXPECT_EQ(Get("p/step/early.bin").rfind("missing", 0), 0u) << "a done item was uploaded again";
  auto open_uploads = client_->ListMultipartUploads(bucket_, "p/");
  ASSERT_TRUE(open_uploads.ok()) << open_uploads.error().ToString();
  EXPECT_TRUE(open_uploads->empty()) << "the begun multipart upload was not aborted";
  // Another uploader on the same staging directory while this one lives: refused.
  auto second = StartUploader();
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.error().sys_errno(), EBUSY);
  ASSERT_TRUE((*uploader)->Stop(10000, nullptr).ok());
  // Uploaded and unchanged: the staged copies are gone; the one this life did not upload stays.
  EXPECT_FALSE(stdfs::exists(stage_ / "step" / "shard.bin"));
  EXPECT_FALSE(stdfs::exists(stage_ / "step" / ".metadata"));
  EXPECT_TRUE(stdfs::exists(stage_ / "step" / "early.bin"));
}

TEST_F(BucketUploaderTest, AHostileJournalNeverUploadsWhatLiesOutsideTheStagingDirectory) {
  const stdfs::path outside = stage_.string() + "-outside";
  stdfs::create_directories(outside);
  { std::ofstream(outside / "secret") << "not to be uploaded"; }
  struct stat st = {};
  ASSERT_EQ(::stat((outside / "secret").c_str(), &st), 0);
  stdfs::create_symlink(outside / "secret", stage_ / "link");
  stdfs::create_directory_symlink(outside, stage_ / "dirlink");
  const struct stat ok = Write("ok.bin", "fine");
  WriteJournal({Queued(1, "../" + outside.filename().string() + "/secret", st), Queued(2, "link", st),
                Queued(3, "dirlink/secret", st), Queued(4, "/etc/passwd", st), Queued(5, "ok.bin", ok)});
  auto uploader = StartUploader();
  ASSERT_TRUE(uploader.ok()) << uploader.error().ToString();
  ASSERT_TRUE((*uploader)->WaitUploaded(10000, nullptr).ok());
  auto listed = client_->ListObjects(bucket_, "", "");
  ASSERT_TRUE(listed.ok());
  std::vector<std::string> keys;
  for (const auto& o : listed->objects) keys.push_back(o.key);
  EXPECT_EQ(keys, std::vector<std::string>{"p/ok.bin"});
  ASSERT_TRUE((*uploader)->Stop(10000, nullptr).ok());
  EXPECT_TRUE(stdfs::exists(outside / "secret"));
  stdfs::remove_all(outside);
}

}  // namespace
}  // namespace ucpfs::io
