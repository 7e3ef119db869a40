// Simulated power loss during saves through write capture (not only kill -9): the fault engine
// remembers every byte written and not yet fdatasync'd, per file, and the fault NameOps every
// namespace change (part created, renamed into place, unlinked) whose directory was not fsync'd
// since; at a seeded cut (after the n-th op of either) the power goes off: later ops fail, then
// every unsynced byte is overwritten with garbage, every namespace change not made durable is
// undone (the model: io_engine.h, FaultPlan), and the journal loses a random tail (it is never
// fsync'd). The next start recovers (on a third of the cuts, the power goes again during that
// recovery, and the start after it recovers). For a DCP-shaped save (shards each fsync'd, then .metadata)
// and a DeepSpeed-shaped save (files closed without fsync, `latest` last, fsync'd or not, then
// sync), over many cuts: no file is ever torn (each is absent or byte-exact, under its name or
// kept in .ucpfs/capture/recovered/), no pointer (.metadata, latest) is there without every shard
// before it, no file whose fsync (or a later file's) returned success is lost, and nothing is
// half-renamed (no other name in the tree, no part left in the capture directory). Seeded:
// UCPFS_TEST_SEED replays a run; UCPFS_POWER_CUTS sets the number of cuts (default 1000).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/io/io_engine.h"
#include "core/io/write_capture.h"
#include "test_seed.h"

namespace ucpfs::io {
namespace {

namespace stdfs = std::filesystem;

constexpr size_t kChunkBytes = 64 << 10;

std::vector<std::byte> ReadFile(const stdfs::path& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> raw((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) out[i] = static_cast<std::byte>(raw[i]);
  return out;
}

struct SavedFile {
  std::string path;
  std::vector<std::byte> bytes;
  bool fsync = false;    // the writer fsyncs it before closing
  bool pointer = false;  // written last; needs every file before it
};

// A DCP-shaped save (rank files fsync'd, .metadata last) or a DeepSpeed-shaped one (files closed
// without fsync, `latest` last, then one sync).
std::vector<SavedFile> Shape(bool dcp, std::mt19937_64& rng) {
  std::vector<SavedFile> files;
  auto bytes = [&](size_t n) {
    std::vector<std::byte> b(n);
    for (auto& x : b) x = static_cast<std::byte>(rng() & 0xff);
    return b;
  };
  if (dcp) {
    for (int r = 0; r < 4; ++r) files.push_back({"ckpt/__" + std::to_string(r) + "_0.distcp", bytes(20000 + rng() % 200000), true, false});
    files.push_back({"ckpt/.metadata", bytes(3000), true, true});
  } else {
    files.push_back({"global_step5/mp_rank_00_model_states.pt", bytes(50000 + rng() % 150000), false, false});
    for (int r = 0; r < 2; ++r) {
      files.push_back({"global_step5/zero_pp_rank_" + std::to_string(r) + "_mp_rank_00_optim_states.pt",
                       bytes(30000 + rng() % 150000), false, false});
    }
    files.push_back({"latest", bytes(12), rng() % 2 == 0, true});
  }
  return files;
}

class PowerCut {
 public:
  explicit PowerCut(const stdfs::path& dir) : dir_(dir) {
    stdfs::remove_all(dir_);
    stdfs::create_directories(dir_ / "ckpt");
    stdfs::create_directories(dir_ / "global_step5");
    src_fd_ = open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  }
  ~PowerCut() {
    close(src_fd_);
    stdfs::remove_all(dir_);
  }

  std::unique_ptr<WriteCapture> Start(std::shared_ptr<FaultPlan> plan) {
    PinnedCacheOptions co;
    co.capacity_bytes = 64 * kChunkBytes;  // a whole save fits: no writer waits on flushes that fail after a cut
    co.chunk_bytes = kChunkBytes;
    co.allow_cuda = false;
    auto cache = PinnedCache::Make(co);
    EXPECT_TRUE(cache.ok());
    WriteCaptureOptions o;
    o.source_dirfd = src_fd_;
    o.source_dir = dir_.string();
    o.cache = std::shared_ptr<PinnedCache>(std::move(*cache));
    o.n_flushers = 1;
    o.make_engine = [plan] { return MakeFaultEngine(MakePreadEngine(), plan); };
    o.names = MakeFaultNameOps(plan);
    auto wc = WriteCapture::Start(std::move(o));
    EXPECT_TRUE(wc.ok()) << wc.error().ToString();
    return wc.ok() ? std::move(*wc) : nullptr;
  }

  int DirFd(const std::string& rel) const {
    const size_t slash = rel.rfind('/');
    if (slash == std::string::npos) return fcntl(src_fd_, F_DUPFD_CLOEXEC, 0);
    return openat(src_fd_, rel.substr(0, slash).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  }

  // Runs the save until it ends or an fsync/sync fails (the writer then stops, as it would die
  // with the machine). Returns the files whose fsync returned success, and those closed before
  // them (an fsync makes every file closed before it durable too).
  std::vector<std::string> Save(WriteCapture& wc, const std::vector<SavedFile>& files, const FaultPlan& plan) {
    std::vector<std::string> synced;
    for (size_t i = 0; i < files.size(); ++i) {
      const SavedFile& s = files[i];
      if (plan.PowerIsOff()) return synced;  // the writer went down with the machine
      const int dir = DirFd(s.path);
      auto f = wc.Create(dir, s.path.substr(s.path.rfind('/') + 1), 0644);
      close(dir);
      if (!f.ok()) return synced;
      for (size_t at = 0; at < s.bytes.size(); at += 40000) {
        const size_t n = std::min<size_t>(40000, s.bytes.size() - at);
        if (!wc.Write(**f, at, std::span(s.bytes.data() + at, n)).ok()) return synced;
      }
      if (s.fsync) {
        if (!wc.Fsync(**f).ok()) return synced;
        synced.clear();
        for (size_t k = 0; k <= i; ++k) synced.push_back(files[k].path);
      }
      if (!wc.Close(**f).ok()) return synced;
    }
    if (wc.Sync().ok()) {
      synced.clear();
      for (const SavedFile& s : files) synced.push_back(s.path);
    }
    return synced;
  }

  // The journal of the crashed mount's state loses a random tail (it is never fsync'd).
  void TearJournals(std::mt19937_64& rng) {
    const stdfs::path cap = dir_ / ".ucpfs" / "capture";
    if (!stdfs::exists(cap)) return;
    for (const auto& e : stdfs::recursive_directory_iterator(cap)) {
      if (e.path().filename() != "journal") continue;
      const uint64_t size = stdfs::file_size(e.path());
      if (size > 8 && rng() % 2 == 0) stdfs::resize_file(e.path(), 8 + rng() % (size - 8 + 1));
    }
  }

  const stdfs::path& dir() const { return dir_; }

 private:
  stdfs::path dir_;
  int src_fd_ = -1;
};

TEST(PowerCut, NoTornFileNoPointerAheadNoLostFsyncAcrossSeededCuts) {
  const uint64_t seed = ucpfs::testing::TestSeed();
  int n_cuts = 1000;
  if (const char* e = std::getenv("UCPFS_POWER_CUTS"); e != nullptr && *e != '\0') n_cuts = std::atoi(e);
  // On a memory filesystem when there is one: the cut is simulated, and real fsyncs of a disk
  // would make a thousand cuts take minutes.
  const stdfs::path base = stdfs::is_directory("/dev/shm") ? stdfs::path("/dev/shm") : stdfs::temp_directory_path();
  const stdfs::path dir = base / ("ucpfs-power-cut-" + std::to_string(getpid()));
  // Ops in a whole save of each shape, to draw the cut points from.
  uint64_t total_ops[2] = {0, 0};
  for (int dcp = 0; dcp < 2; ++dcp) {
    std::mt19937_64 rng(seed);
    PowerCut pc(dir);
    auto plan = std::make_shared<FaultPlan>(std::vector<Fault>{});
    auto wc = pc.Start(plan);
    ASSERT_NE(wc, nullptr);
    const auto files = Shape(dcp == 1, rng);
    ASSERT_EQ(pc.Save(*wc, files, *plan).size(), files.size());
    total_ops[dcp] = plan->OpsSubmitted();
    ASSERT_GT(total_ops[dcp], 0u);
  }
  int n_torn = 0, n_ahead = 0, n_lost = 0, n_stray = 0;
  uint64_t bytes_dropped = 0, names_undone = 0, files_present = 0, files_recovered = 0, recoveries_cut = 0;
  for (int i = 0; i < n_cuts; ++i) {
    std::mt19937_64 rng(seed + 1000003ull * (i + 1));
    const bool dcp = i % 2 == 0;
    PowerCut pc(dir);
    const auto files = Shape(dcp, rng);
    auto plan = std::make_shared<FaultPlan>(std::vector<Fault>{});
    plan->TrackUnsynced();
    plan->CutPowerAfterOps(rng() % (total_ops[dcp ? 1 : 0] + 2));
    std::vector<std::string> synced;
    {
      auto wc = pc.Start(plan);
      ASSERT_NE(wc, nullptr);
      synced = pc.Save(*wc, files, *plan);
      // The machine stops: the capture goes without placing anything more (every op fails).
      plan->CutPowerAfterOps(0);
    }
    bytes_dropped += plan->DropUnsynced();
    names_undone += plan->NamesUndone();
    pc.TearJournals(rng);
    if (i % 3 == 1) {
      // The power goes again while the next start recovers (placing, setting aside, discarding).
      auto again = std::make_shared<FaultPlan>(std::vector<Fault>{});
      again->TrackUnsynced();
      again->CutPowerAfterOps(rng() % 16);
      {
        auto recovering = pc.Start(again);
        ASSERT_NE(recovering, nullptr);
        again->CutPowerAfterOps(0);
      }
      bytes_dropped += again->DropUnsynced();
      names_undone += again->NamesUndone();
      recoveries_cut += 1;
    }
    {
      auto recovered = pc.Start(std::make_shared<FaultPlan>(std::vector<Fault>{}));
      ASSERT_NE(recovered, nullptr);
    }
    auto fail = [&](int& count, const std::string& what) {
      ++count;
      ADD_FAILURE() << "cut " << i << " (seed " << seed << "): " << what;
    };
    // Kept by recovery, not placed: .ucpfs/capture/recovered/<state>/<path>.
    std::map<std::string, stdfs::path> kept;
    const stdfs::path cap = pc.dir() / ".ucpfs" / "capture";
    for (const auto& e : stdfs::recursive_directory_iterator(cap)) {
      if (!e.is_regular_file()) continue;
      const stdfs::path rel = e.path().lexically_relative(cap);
      if (*rel.begin() != "recovered") {
        fail(n_stray, "left in the capture directory: " + rel.string());
      } else if (std::distance(rel.begin(), rel.end()) > 2) {
        stdfs::path r;
        for (auto it = std::next(rel.begin(), 2); it != rel.end(); ++it) r /= *it;
        kept[r.string()] = e.path();
      }
    }
    // Nothing in the tree but the files saved (no stash, no part, no half-renamed name).
    std::set<std::string> names;
    for (const SavedFile& s : files) names.insert(s.path);
    for (auto it = stdfs::recursive_directory_iterator(pc.dir()); it != stdfs::recursive_directory_iterator(); ++it) {
      const std::string rel = it->path().lexically_relative(pc.dir()).string();
      if (rel == ".ucpfs") {
        it.disable_recursion_pending();
      } else if (!it->is_directory() && !names.contains(rel)) {
        fail(n_stray, "a name that was never saved: " + rel);
      }
    }
    bool all_before = true;
    for (const SavedFile& s : files) {
      const stdfs::path p = pc.dir() / s.path;
      const bool present = stdfs::exists(p);
      files_present += present ? 1 : 0;
      if (present && ReadFile(p) != s.bytes) fail(n_torn, s.path + " is torn");
      if (const auto k = kept.find(s.path); k != kept.end()) {
        ++files_recovered;
        if (ReadFile(k->second) != s.bytes) fail(n_torn, s.path + " is kept in recovered/ torn");
        if (present) fail(n_stray, s.path + " is both placed and kept in recovered/");
      }
      if (s.pointer && present && !all_before) fail(n_ahead, s.path + " is there without every file before it");
      if (!present && std::find(synced.begin(), synced.end(), s.path) != synced.end()) {
        fail(n_lost, s.path + " was fsync'd (or a file after it was), and is lost");
      }
      all_before = all_before && present;
    }
    if (n_torn + n_ahead + n_lost + n_stray > 5) break;
  }
  std::cout << "[ power cuts ] " << n_cuts << " cuts, " << bytes_dropped << " unsynced bytes dropped, " << names_undone
            << " namespace changes undone, " << recoveries_cut << " recoveries cut too, " << files_present << " files present after recovery, " << files_recovered
            << " kept in recovered/\n";
  EXPECT_EQ(n_torn, 0);
  EXPECT_EQ(n_ahead, 0);
  EXPECT_EQ(n_lost, 0);
  EXPECT_EQ(n_stray, 0);
}

}  // namespace
}  // namespace ucpfs::io
