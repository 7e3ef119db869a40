// The S3 client (core/io/s3_client.h) against a real Ceph RGW (tests/s3/rgw.sh), pointed at it by
// the standard AWS environment variables (`rgw.sh exec DIR` sets them). No mock: bucket create,
// PUT, batched ranged GETs equal to the bytes, ListObjectsV2 pages and delimiter, a 3-part
// multipart upload, abort, the uploads in progress, an object replaced under a reader (If-Match),
// a wrong secret (no retries on 403), virtual-host addressing and retries on a refused connection.
// The libcurl behind all of it is the one the build chose (tests/build-curl.sh's HTTP(S)-only
// build where it could be had): loaded from the first candidate, without the libraries of the
// protocols an S3 client never speaks.
// Without AWS_ENDPOINT_URL it fails: the store must be there, never skipped.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "core/io/curl_api.h"
#include "core/io/s3_client.h"

namespace ucpfs::s3 {
namespace {

std::vector<std::byte> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t x = rng();
    std::memcpy(v.data() + i, &x, std::min<size_t>(8, n - i));
  }
  return v;
}

std::span<const std::byte> Bytes(const std::string& s) { return std::as_bytes(std::span<const char>(s.data(), s.size())); }

class RgwTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* ep = std::getenv("AWS_ENDPOINT_URL");
    ASSERT_NE(ep, nullptr) << "AWS_ENDPOINT_URL is not set: run under tests/s3/rgw.sh exec DIR";
    auto env = LoadS3Environment();
    ASSERT_TRUE(env.ok()) << env.error().ToString();
    auto opt = ResolveOptions(*env);
    ASSERT_TRUE(opt.ok()) << opt.error().ToString();
    options_ = new Options(*opt);
    auto c = Client::Make(*options_);
    ASSERT_TRUE(c.ok()) << c.error().ToString();
    client_ = new std::shared_ptr<Client>(*c);
    bucket_ = new std::string("ucpfs-e2e-" + std::to_string(getpid()) + "-" +
                              std::to_string(std::chrono::steady_clock::now().time_since_epoch().count() % 1000000));
    Status st = (*client_)->CreateBucket(*bucket_);
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
  static void TearDownTestSuite() {
    if (client_ && bucket_) {
      // Empty the bucket (objects and unfinished uploads), then remove it.
      auto all = (*client_)->ListObjects(*bucket_, "", "");
      if (all.ok()) {
        for (const auto& o : all->objects) (void)(*client_)->DeleteObject(*bucket_, o.key);
      }
      auto ups = (*client_)->ListMultipartUploads(*bucket_, "");
      if (ups.ok()) {
        for (const auto& u : *ups) (void)(*client_)->AbortMultipartUpload(*bucket_, u.key, u.upload_id);
      }
      Status st = (*client_)->DeleteBucket(*bucket_);
      EXPECT_TRUE(st.ok()) << st.ToString();
    }
    delete client_;
    delete bucket_;
    delete options_;
  }
  Client& c() { return **client_; }
  const std::string& bucket() { return *bucket_; }

  static inline Options* options_ = nullptr;
  static inline std::shared_ptr<Client>* client_ = nullptr;
  static inline std::string* bucket_ = nullptr;
};

TEST_F(RgwTest, PutHeadAndBatchedRangedGets) {
  const size_t n = 3 * 1024 * 1024 + 123;
  auto data = RandomBytes(n, 1);
  auto etag = c().PutObject(bucket(), "obj/a.bin", data);
  ASSERT_TRUE(etag.ok()) << etag.error().ToString();
  EXPECT_FALSE(etag->empty());
  auto info = c().Head(bucket(), "obj/a.bin");
  ASSERT_TRUE(info.ok()) << info.error().ToString();
  EXPECT_EQ(info->n_bytes, n);
  EXPECT_EQ(info->etag, *etag);
  EXPECT_FALSE(info->last_modified.empty());

  // 300 ranges at odd offsets and lengths, the first and the last byte included, in one batch.
  std::mt19937_64 rng(7);
  std::vector<std::vector<std::byte>> bufs(300);
  std::vector<RangeRead> reads;
  for (size_t i = 0; i < bufs.size(); ++i) {
    uint64_t off = i == 0 ? 0 : i == 1 ? n - 1 : rng() % n;
    uint64_t len = i < 2 ? 1 : 1 + rng() % std::min<uint64_t>(n - off, 70001);
    bufs[i].resize(len);
    reads.push_back(RangeRead{bucket(), "obj/a.bin", off, bufs[i], *etag});
  }
  CounterValues before = c().counters();
  auto object_bytes = [&](const std::string& name) {
    for (const auto& [object, n_bytes] : c().ObjectBytesGet().by_object) {
      if (object == name) return n_bytes;
    }
    return uint64_t{0};
  };
  const std::string name = "s3://" + bucket() + "/obj/a.bin";
  const uint64_t object_before = object_bytes(name);
  size_t failed = 999;
  Status st = c().GetRanges(reads, &failed);
  ASSERT_TRUE(st.ok()) << st.ToString() << " at " << failed;
  uint64_t total = 0;
  for (size_t i = 0; i < reads.size(); ++i) {
    ASSERT_EQ(std::memcmp(bufs[i].data(), data.data() + reads[i].byte_offset, bufs[i].size()), 0) << "range " << i;
    total += bufs[i].size();
  }
  CounterValues after = c().counters();
  EXPECT_EQ(after.requests - before.requests, 300u);
  EXPECT_EQ(after.bytes_get - before.bytes_get, total);
  EXPECT_EQ(object_bytes(name) - object_before, total);  // every byte counted against its object
  // At most max_in_flight connections at once, kept open and reused.
  EXPECT_LE(after.connects - before.connects, static_cast<uint64_t>(options_->max_in_flight));
  // A second batch reuses them.
  ASSERT_TRUE(c().GetRanges(std::span(reads).subspan(0, 32)).ok());
  EXPECT_LE(c().counters().connects - after.connects, 2u);

  // The same through the ByteSource.
  auto src = S3ObjectSource::Open(*client_, bucket(), "obj/a.bin");
  ASSERT_TRUE(src.ok()) << src.error().ToString();
  EXPECT_EQ((*src)->Name(), "s3://" + bucket() + "/obj/a.bin");
  EXPECT_EQ((*src)->Size(), n);
  std::vector<std::byte> a(4097), b(1), whole(n);
  std::vector<ReadPiece> pieces{{12345, a}, {n - 1, b}};
  ASSERT_TRUE((*src)->ReadPieces(pieces).ok());
  EXPECT_EQ(std::memcmp(a.data(), data.data() + 12345, a.size()), 0);
  EXPECT_EQ(b[0], data[n - 1]);
  ASSERT_TRUE((*src)->ReadAt(0, whole).ok());
  EXPECT_EQ(whole, data);
  Status past = (*src)->ReadAt(n - 1, std::span<std::byte>(a.data(), 2));
  EXPECT_EQ(past.code(), StatusCode::kOutOfRange);

  // A read pinned to the ETag and larger than max_get_bytes goes out as several GETs at once.
  Options split = *options_;
  split.max_get_bytes = 100000;
  auto sc = Client::Make(split);
  ASSERT_TRUE(sc.ok());
  auto split_src = S3ObjectSource::Open(*sc, bucket(), "obj/a.bin");
  ASSERT_TRUE(split_src.ok());
  std::fill(whole.begin(), whole.end(), std::byte{0});
  uint64_t requests_before = (*sc)->counters().requests;
  ASSERT_TRUE((*split_src)->ReadAt(0, whole).ok());
  EXPECT_EQ(whole, data);
  EXPECT_EQ((*sc)->counters().requests - requests_before, (n + 99999) / 100000);

  // 100 touching reads of one batch, given in reverse: one GET, each read its own bytes.
  std::vector<std::vector<std::byte>> parts(100, std::vector<std::byte>(1000));
  std::vector<RangeRead> touching;
  for (int i = 99; i >= 0; --i) touching.push_back({bucket(), "obj/a.bin", 777 + 1000ull * i, parts[i], *etag});
  requests_before = c().counters().requests;
  ASSERT_TRUE(c().GetRanges(touching).ok());
  EXPECT_EQ(c().counters().requests - requests_before, 1u);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(std::memcmp(parts[i].data(), data.data() + 777 + 1000 * i, 1000), 0) << i;

  // Threads share one client (a mount's FUSE workers): 8 batches at once, each byte right.
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::byte> x(100003), y(77);
      std::vector<ReadPiece> ps{{static_cast<uint64_t>(t) * 300007, x}, {n - 77 - static_cast<uint64_t>(t), y}};
      for (int round = 0; round < 5; ++round) {
        if (!(*src)->ReadPieces(ps).ok() ||
            std::memcmp(x.data(), data.data() + ps[0].byte_offset, x.size()) != 0 ||
            std::memcmp(y.data(), data.data() + ps[1].byte_offset, y.size()) != 0) {
          ++wrong;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);

  // A missing object: kNotFound naming it.
  auto missing = c().Head(bucket(), "obj/none");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code(), StatusCode::kNotFound);
  Status get_missing = c().GetRange(bucket(), "obj/none", 0, a);
  EXPECT_EQ(get_missing.code(), StatusCode::kNotFound);
  EXPECT_NE(get_missing.message().find("NoSuchKey"), std::string::npos) << get_missing.ToString();
}

TEST_F(RgwTest, ListPagesAndDelimiter) {
  std::vector<std::string> keys;
  for (int i = 0; i < 9; ++i) keys.push_back("list/f" + std::to_string(i) + ".pt");
  for (const char* k : {"list/d1/x", "list/d1/y", "list/d2/z", "list/d2/deep/w", "other/q"}) keys.push_back(k);
  for (const auto& k : keys) ASSERT_TRUE(c().PutObject(bucket(), k, Bytes(k)).ok()) << k;

  CounterValues before = c().counters();
  auto all = c().ListObjects(bucket(), "list/", "", 4);
  ASSERT_TRUE(all.ok()) << all.error().ToString();
  EXPECT_EQ(c().counters().requests - before.requests, 4u);  // 13 keys, 4 a page
  std::vector<std::string> got;
  for (const auto& o : all->objects) {
    got.push_back(o.key);
    EXPECT_EQ(o.n_bytes, o.key.size());
    EXPECT_FALSE(o.etag.empty());
  }
  std::vector<std::string> want(keys.begin(), keys.end() - 1);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(got, want);

  auto dirs = c().ListObjects(bucket(), "list/", "/", 3);
  ASSERT_TRUE(dirs.ok()) << dirs.error().ToString();
  EXPECT_EQ(dirs->objects.size(), 9u);
  EXPECT_EQ(dirs->common_prefixes, (std::vector<std::string>{"list/d1/", "list/d2/"}));
  auto page = c().ListObjectsPage(bucket(), "list/d2/", "/", 1000, "");
  ASSERT_TRUE(page.ok());
  ASSERT_EQ(page->objects.size(), 1u);
  EXPECT_EQ(page->objects[0].key, "list/d2/z");
  EXPECT_EQ(page->common_prefixes, (std::vector<std::string>{"list/d2/deep/"}));
  EXPECT_FALSE(page->is_truncated);
}

TEST_F(RgwTest, MultipartUploadAbortAndUploadsInProgress) {
  const size_t part = 8u << 20;
  auto data = RandomBytes(2 * part + 1000003, 3);
  auto id = c().CreateMultipartUpload(bucket(), "mp/big.bin");
  ASSERT_TRUE(id.ok()) << id.error().ToString();
  std::vector<CompletedPart> parts;
  for (int p = 0; p < 3; ++p) {
    size_t off = static_cast<size_t>(p) * part;
    size_t len = std::min(part, data.size() - off);
    auto etag = c().UploadPart(bucket(), "mp/big.bin", *id, p + 1, std::span(data).subspan(off, len));
    ASSERT_TRUE(etag.ok()) << etag.error().ToString();
    parts.push_back({p + 1, *etag});
  }
  // Not visible before it is completed.
  EXPECT_EQ(c().Head(bucket(), "mp/big.bin").status().code(), StatusCode::kNotFound);
  auto done = c().CompleteMultipartUpload(bucket(), "mp/big.bin", *id, parts);
  ASSERT_TRUE(done.ok()) << done.error().ToString();
  EXPECT_NE(done->find("-3"), std::string::npos) << "'" << *done << "'";
  auto src = S3ObjectSource::Open(*client_, bucket(), "mp/big.bin");
  ASSERT_TRUE(src.ok());
  ASSERT_EQ((*src)->Size(), data.size());
  std::vector<std::byte> back(data.size());
  // Across the part boundaries, in one batch.
  std::vector<ReadPiece> pieces{{0, std::span(back).subspan(0, part - 5)},
                                {part - 5, std::span(back).subspan(part - 5, part + 10)},
                                {2 * part + 5, std::span(back).subspan(2 * part + 5)}};
  ASSERT_TRUE((*src)->ReadPieces(pieces).ok());
  ASSERT_TRUE((*src)->ReadAt(2 * part + 5 - 10, std::span(back).subspan(2 * part - 5, 10)).ok());
  EXPECT_EQ(back, data);

  // An unfinished upload is listed (crash recovery), and an aborted one leaves nothing.
  auto id2 = c().CreateMultipartUpload(bucket(), "mp/torn.bin");
  ASSERT_TRUE(id2.ok());
  ASSERT_TRUE(c().UploadPart(bucket(), "mp/torn.bin", *id2, 1, std::span(data).subspan(0, part)).ok());
  auto ups = c().ListMultipartUploads(bucket(), "mp/");
  ASSERT_TRUE(ups.ok()) << ups.error().ToString();
  ASSERT_EQ(ups->size(), 1u);
  EXPECT_EQ((*ups)[0].key, "mp/torn.bin");
  EXPECT_EQ((*ups)[0].upload_id, *id2);
  Status ab = c().AbortMultipartUpload(bucket(), "mp/torn.bin", *id2);
  ASSERT_TRUE(ab.ok()) << ab.ToString();
  auto after = c().ListMultipartUploads(bucket(), "mp/");
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(after->empty());
  EXPECT_EQ(c().Head(bucket(), "mp/torn.bin").status().code(), StatusCode::kNotFound);
  auto listed = c().ListObjects(bucket(), "mp/", "");
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->objects.size(), 1u);
  EXPECT_EQ(listed->objects[0].key, "mp/big.bin");
  // Completing an aborted upload fails (RGW 16.2 answers 500 "This multipart completion is
  // already in progress" where AWS says NoSuchUpload) and makes no object.
  auto again = c().CompleteMultipartUpload(bucket(), "mp/torn.bin", *id2, {{1, "\"x\""}});
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.error().message().find("s3://" + bucket() + "/mp/torn.bin"), std::string::npos);
  EXPECT_EQ(c().Head(bucket(), "mp/torn.bin").status().code(), StatusCode::kNotFound);
}

TEST_F(RgwTest, ObjectReplacedUnderAReaderFailsNamingIt) {
  auto v1 = RandomBytes(100000, 4);
  ASSERT_TRUE(c().PutObject(bucket(), "chg/shard.pt", v1).ok());
  auto src = S3ObjectSource::Open(*client_, bucket(), "chg/shard.pt");
  ASSERT_TRUE(src.ok());
  std::vector<std::byte> buf(1000);
  ASSERT_TRUE((*src)->ReadAt(500, buf).ok());
  auto v2 = RandomBytes(100010, 5);
  ASSERT_TRUE(c().PutObject(bucket(), "chg/shard.pt", v2).ok());
  Status st = (*src)->ReadAt(500, buf);
  ASSERT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
  EXPECT_NE(st.message().find("s3://" + bucket() + "/chg/shard.pt"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("changed since it was recorded"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("size 100000 -> 100010"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("412"), std::string::npos) << st.message();
  // A batch fails the same way; a recorded source (no HEAD) too.
  std::vector<ReadPiece> pieces{{0, buf}};
  EXPECT_EQ((*src)->ReadPieces(pieces).code(), StatusCode::kDataLoss);
  auto rec = S3ObjectSource::FromRecorded(*client_, bucket(), "chg/shard.pt", v1.size(), (*src)->etag());
  EXPECT_EQ(rec->ReadAt(0, buf).code(), StatusCode::kDataLoss);
  // Deleted: said so.
  ASSERT_TRUE(c().DeleteObject(bucket(), "chg/shard.pt").ok());
  Status gone = (*src)->ReadAt(0, buf);
  EXPECT_EQ(gone.code(), StatusCode::kDataLoss);
  EXPECT_NE(gone.message().find("no longer exists"), std::string::npos) << gone.message();
}

TEST_F(RgwTest, WrongSecretIsAClearAuthErrorWithoutRetries) {
  Options bad = *options_;
  bad.credentials.secret_access_key = "not-the-secret";
  auto bc = Client::Make(bad);
  ASSERT_TRUE(bc.ok());
  auto info = (*bc)->Head(bucket(), "obj/a.bin");
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.error().code(), StatusCode::kIo);
  EXPECT_EQ(info.error().sys_errno(), EACCES);
  EXPECT_NE(info.error().message().find("HTTP 403"), std::string::npos) << info.error().ToString();
  std::vector<std::byte> buf(10);
  Status get = (*bc)->GetRange(bucket(), "obj/a.bin", 0, buf);
  EXPECT_NE(get.message().find("SignatureDoesNotMatch"), std::string::npos) << get.ToString();
  EXPECT_EQ(get.message().find("not-the-secret"), std::string::npos);
  CounterValues cv = (*bc)->counters();
  EXPECT_EQ(cv.requests, 2u);
  EXPECT_EQ(cv.retries, 0u);
  EXPECT_EQ(cv.failures, 2u);

  bad.credentials.access_key_id = "NOSUCHKEYID";
  auto unknown = Client::Make(bad);
  Status st = (*unknown)->GetRange(bucket(), "obj/a.bin", 0, buf);
  EXPECT_EQ(st.sys_errno(), EACCES);
  EXPECT_NE(st.message().find("InvalidAccessKeyId"), std::string::npos) << st.ToString();
}

TEST_F(RgwTest, VirtualHostAddressing) {
  // rgw.sh sets `rgw dns name = localhost`; libcurl resolves *.localhost to the loopback.
  auto ep = ParseEndpoint(options_->endpoint_url);
  ASSERT_TRUE(ep.ok());
  Options vh = *options_;
  vh.endpoint_url = "http://localhost:" + ep->port;
  vh.addressing = Addressing::kVirtualHost;
  auto vc = Client::Make(vh);
  ASSERT_TRUE(vc.ok());
  std::string body = "virtual host addressing";
  ASSERT_TRUE((*vc)->PutObject(bucket(), "vh/x", Bytes(body)).ok());
  std::vector<std::byte> buf(body.size() - 8);
  Status st = c().GetRange(bucket(), "vh/x", 8, buf);  // read back path-style
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(buf.data()), buf.size()), "host addressing");
  auto page = (*vc)->ListObjectsPage(bucket(), "vh/", "", 10, "");
  ASSERT_TRUE(page.ok()) << page.error().ToString();
  ASSERT_EQ(page->objects.size(), 1u);
}

TEST_F(RgwTest, TransportErrorsAreRetriedThenReported) {
  // A port nothing listens on: refused at once, tried max_attempts times.
  Options dead = *options_;
  dead.endpoint_url = "http://127.0.0.1:1";
  dead.retry.max_attempts = 3;
  dead.retry.base_delay_ms = 10;
  auto dc = Client::Make(dead);
  ASSERT_TRUE(dc.ok());
  std::vector<std::byte> buf(10);
  Status st = (*dc)->GetRange(bucket(), "obj/a.bin", 0, buf);
  EXPECT_EQ(st.code(), StatusCode::kIo);
  EXPECT_EQ(st.sys_errno(), ECONNREFUSED) << st.ToString();
  EXPECT_NE(st.message().find("after 3 attempts"), std::string::npos) << st.ToString();
  EXPECT_EQ((*dc)->counters().retries, 2u);
  EXPECT_EQ((*dc)->counters().requests, 3u);
}

// Runs after the store tests above (gtest keeps file order): libcurl has served them.
TEST(CurlLibrary, TheFirstCandidateIsLoadedWithNoUnusedProtocolLibraries) {
  const std::vector<std::string> candidates = CurlLibraryCandidates();
  ASSERT_FALSE(candidates.empty());
  EXPECT_EQ(candidates.back(), kCurlLibrary);  // the system's, always last
  auto api = LoadCurl();
  ASSERT_TRUE(api.ok()) << api.error().ToString();
  Dl_info info{};
  ASSERT_NE(dladdr(reinterpret_cast<void*>((*api)->version_info), &info), 0);
  const std::string loaded = std::filesystem::canonical(info.dli_fname);
  const curl_version_info_data* v = (*api)->version_info(CURLVERSION_NOW);
  ASSERT_NE(v, nullptr);
  EXPECT_GE(v->version_num, 0x074b00u) << v->version;
  if (candidates.front() == kCurlLibrary) {
    GTEST_LOG_(INFO) << "no HTTP(S)-only libcurl was built here (tests/build-curl.sh): the system's " << loaded;
    return;
  }
  EXPECT_EQ(loaded, std::filesystem::canonical(candidates.front()));
  EXPECT_NE(v->features & CURL_VERSION_SSL, 0) << "built without TLS";
  std::vector<std::string> protocols;
  for (const char* const* p = v->protocols; p != nullptr && *p != nullptr; ++p) protocols.emplace_back(*p);
  EXPECT_EQ(protocols, (std::vector<std::string>{"http", "https"}));
  // None of Debian libcurl4's extra libraries is in this process.
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    for (const char* lib : {"libldap", "libkrb5", "libgssapi", "librtmp", "libssh", "libnghttp2", "libidn2",
                            "libpsl", "libbrotli", "libgnutls", "libsasl2"}) {
      EXPECT_EQ(line.find(lib), std::string::npos) << line;
    }
  }
}

}  // namespace
}  // namespace ucpfs::s3
