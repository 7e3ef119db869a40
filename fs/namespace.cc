#include "fs/namespace.h"
#include "core/json_text.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/io/file_source.h"
#include "core/io/lazy_file_source.h"
#include "core/views/atomic.h"
#include "core/views/target.h"
#include "index/deepspeed_tags.h"
#include "index/safetensors_view.h"
#include "index/universal_view.h"
#include "index/view_inputs.h"

namespace ucpfs::fs {
namespace {

constexpr uint64_t kStatsJsonBytes = 16384;  // MountReport's messages fit
constexpr size_t kMaxListedLookupLayouts = 32;
// Layouts built on lookup have at most this many ranks (a rank costs about half a millisecond to
// plan and add, so a lookup answers within a few seconds); larger ones are refused at once and
// can be given with --layout.
constexpr int kMaxLookupWorld = 4096;
// The most recent lookup refusals kept for stats.json (each reason cut to kMaxRefusalBytes).
constexpr size_t kMaxListedRefusals = 8;
constexpr size_t kMaxRefusalBytes = 400;
// target/<layout>.error: why a lookup of target/<layout> was refused (while it is remembered).
constexpr std::string_view kRefusalSuffix = ".error";
// status.json keeps room for the refusals (kMaxListedRefusals of at most kMaxRefusalBytes each,
// their layout names and JSON escapes); refusals that do not fit are left out of it.
constexpr uint64_t kStatusRefusalRoomBytes = 8192;

struct timespec Now() {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts;
}

Opener FixedSource(std::shared_ptr<const ByteSource> src) {
  return [src]() -> Result<std::shared_ptr<const ByteSource>> { return src; };
}

// The target views' input, made once when the namespace is built (status.json reports its
// extra state and unserved items) and shared by every layout, --layout or built on lookup.
Result<std::shared_ptr<const views::TargetInput>> MakeSharedTargetInput(const index::Checkpoint& checkpoint,
                                                                       const index::KeyMapping& mapping,
                                                                       const index::FileTable& files,
                                                                       const TargetOptions& targets,
                                                                       const index::PatternOptions& patterns) {
  auto made = index::MakeTargetInput(checkpoint, mapping, files, [](const std::string& w) {
    std::fprintf(stderr, "ucpfs: warning: %s\n", w.c_str());
  });
  UCPFS_RETURN_IF_ERROR(made.status());
  std::shared_ptr<views::TargetInput> in = *made;
  index::ApplyPatterns(*in, patterns, targets.pp_split);
  return std::shared_ptr<const views::TargetInput>(std::move(in));
}

// Who may read view files: never more than every source file allows. All sources readable by
// others: 0444 for the mounting user (the default). Otherwise the bits every source grants to
// a common owner and a common group, with that owner and group (root where they differ).
struct ViewAccess {
  uint32_t mode = 0444;
  int64_t uid = -1;
  int64_t gid = -1;
};

ViewAccess AccessOfSources(const std::string& source_dir, const std::vector<index::SourceFile>& sources) {
  ViewAccess a;
  bool all_other = true, all_user = true, all_group = true, first = true;
  int64_t uid = -1, gid = -1;
  bool same_uid = true, same_gid = true;
  for (const auto& f : sources) {
    struct stat st;
    if (::lstat((source_dir + "/" + f.rel_path).c_str(), &st) != 0) continue;  // read fails later
    all_other = all_other && (st.st_mode & S_IROTH);
    all_user = all_user && (st.st_mode & S_IRUSR);
    all_group = all_group && (st.st_mode & S_IRGRP);
    if (first) {
      uid = st.st_uid;
      gid = st.st_gid;
      first = false;
    }
    same_uid = same_uid && uid == static_cast<int64_t>(st.st_uid);
    same_gid = same_gid && gid == static_cast<int64_t>(st.st_gid);
  }
  if (all_other) return a;
  a.mode = 0;
  a.uid = same_uid ? uid : 0;
  a.gid = same_gid ? gid : 0;
  if (same_uid && all_user) a.mode |= 0400;
  if (same_gid && all_group) a.mode |= 0040;
  return a;
}

// The file target/<layout>.error: `why` and a newline. kNotFound when no refusal of `layout`
// is remembered (never refused, or pushed out by newer refusals).
Result<std::shared_ptr<const Tree>> RefusalFile(const std::string& layout, const std::optional<std::string>& why,
                                                struct timespec mtime, const ViewAccess& access) {
  if (!why) return NotFoundError("no refusal of a layout '" + layout + "' is remembered");
  const std::string text = *why + "\n";
  auto src = std::make_shared<MemorySource>(
      "target/" + layout + std::string(kRefusalSuffix),
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  auto tree = std::make_shared<Tree>(Tree::OneFile(src->Size(), mtime, FixedSource(src)));
  UCPFS_RETURN_IF_ERROR(tree->SetAccess(kRootIno, access.mode, access.uid, access.gid));
  return std::shared_ptr<const Tree>(std::move(tree));
}

// The files of one rank of a layout, built again (TargetPlan::Build) when one of them is opened,
// so a layout keeps only its tree (names and sizes), not its ranks' pickles, zip headers, copy
// plans and ucp_info.json: what a layout holds no longer grows with the model, and 64 layouts of
// 512 ranks fit in the daemon's memory bound (issue 12). Rebuilding is deterministic (target.h),
// so the bytes are those whose size the tree advertises; a mismatch is an internal error. Opens
// of one file while an earlier open still holds it share that build.
enum class RankFile : uint8_t { kModel = 0, kSafetensors = 1, kOptim = 2, kExtra = 3, kInfo = 4 };

std::shared_ptr<const ByteSource> FileOf(const views::RankFiles& f, RankFile which) {
  switch (which) {
    case RankFile::kModel: return f.model;
    case RankFile::kSafetensors: return f.model_safetensors;
    case RankFile::kOptim: return f.optim;
    case RankFile::kExtra: return f.extra;
    case RankFile::kInfo: return f.info;
  }
  return nullptr;
}

class LazyRankFiles {
 public:
  LazyRankFiles(std::shared_ptr<const views::TargetPlan> plan, int rank) : plan_(std::move(plan)), rank_(rank) {}

  // Errors: TargetPlan::Build's; kInternal when the file is gone or its size changed.
  Result<std::shared_ptr<const ByteSource>> Open(RankFile which, uint64_t n_bytes) const {
    std::lock_guard lock(mu_);
    auto& held = open_[static_cast<size_t>(which)];
    if (auto src = held.lock()) return src;
    views::RankFileSet want{.model = which == RankFile::kModel,
                            .model_safetensors = which == RankFile::kSafetensors,
                            .optim = which == RankFile::kOptim,
                            .extra = which == RankFile::kExtra,
                            .info = which == RankFile::kInfo};
    UCPFS_ASSIGN_OR_RETURN(auto files, plan_->Build(rank_, want));
    std::shared_ptr<const ByteSource> src = FileOf(files, which);
    const std::string what = "target/" + plan_->layout().name + "/rank_" + std::to_string(rank_);
    if (src == nullptr) return InternalError(what + ": a file listed in the tree is not built again");
    if (src->Size() != n_bytes) {
      return InternalError(what + ": " + src->Name() + " built again has " + std::to_string(src->Size()) +
                           " bytes, not the " + std::to_string(n_bytes) + " listed");
    }
    held = src;
    return src;
  }

 private:
  std::shared_ptr<const views::TargetPlan> plan_;
  int rank_;
  mutable std::mutex mu_;
  mutable std::array<std::weak_ptr<const ByteSource>, 5> open_;  // guarded by mu_
};

// Tree bytes per rank of a layout: its directory, each file's node, and its LazyRankFiles (for
// the budget of layouts built on lookup; calibrated with tests/bench/scale_bench.py).
constexpr uint64_t kNodeBytes = 512;
uint64_t RankTreeBytes(const views::RankFiles& f) {
  uint64_t n_files = 0;
  for (RankFile w : {RankFile::kModel, RankFile::kSafetensors, RankFile::kOptim, RankFile::kExtra, RankFile::kInfo}) {
    n_files += FileOf(f, w) != nullptr ? 1 : 0;
  }
  return (1 + n_files) * kNodeBytes + sizeof(LazyRankFiles) + 64;
}

// Adds `rank_<N>/{model.pt,model.safetensors,optim.pt,extra_state.pt,ucp_info.json}` for every
// rank of `plan` under `ldir`, each file sized now and built again on open (LazyRankFiles).
// Rank files depend on (tp, pp, ep) for model.pt and, without ZeRO partitioning, optim.pt; DP
// replicas link to the first such file. Counts the distinct files added in *n_files.
Status AddLayoutRanks(Tree& tree, Ino ldir, std::shared_ptr<const views::TargetPlan> plan, struct timespec mtime,
                      const ViewAccess& access, size_t* n_files) {
  const layout::Layout& l = plan->layout();
  // Replicas alike (TargetPlan::ReplicasAlike): a DP replica's files are sized from its group's
  // first rank without building anything, so a layout of thousands of DP ranks is listed in the
  // time of its distinct ranks plus its tree nodes.
  const bool alike = plan->ReplicasAlike();
  struct Shared {
    Ino first = 0, second = 0, third = 0;  // model.pt, optim.pt, model.safetensors
    Ino refused_safetensors = 0;           // model.safetensors.error, when it cannot be made
    int first_rank = -1, first_dp = 0;     // the group's first rank, built in full
    uint64_t info_bytes = 0, extra_bytes = 0;
    bool has_extra = false;
  };
  std::map<std::tuple<int, int, int>, Shared> shared_files;  // (tp,pp,ep) -> the rank files DP replicas share
  for (int rank = 0; rank < l.World(); ++rank) {
    const auto c = layout::CoordsOf(l, rank);
    auto it = shared_files.try_emplace({c.tp, c.pp, c.ep}).first;
    Shared& shared = it->second;
    const bool sized_from_first = alike && shared.first_rank >= 0;
    // A DP replica links to the files it shares: only its own are built to be sized.
    views::RankFileSet want;
    want.model = want.model_safetensors = shared.first == 0;
    want.optim = l.zero != 0 || shared.first == 0;
    views::RankFiles files_of_rank;  // a replica sized from its first rank builds nothing
    if (!sized_from_first) {
      UCPFS_ASSIGN_OR_RETURN(files_of_rank, plan->Build(rank, want));
    }
    if (shared.first_rank < 0) {
      shared.first_rank = rank;
      shared.first_dp = c.dp;
      shared.info_bytes = files_of_rank.info->Size();
      shared.has_extra = files_of_rank.extra != nullptr;
      if (shared.has_extra) shared.extra_bytes = files_of_rank.extra->Size();
    }
    UCPFS_ASSIGN_OR_RETURN(Ino rdir, tree.AddDir(ldir, "rank_" + std::to_string(rank), mtime));
    auto lazy = std::make_shared<const LazyRankFiles>(plan, rank);
    auto add = [&](const char* name, RankFile which, Ino* share, std::optional<uint64_t> sized = {}) -> Status {
      if (share != nullptr && *share != 0) return tree.AddLink(rdir, name, *share);
      const uint64_t n_bytes = sized ? *sized : FileOf(files_of_rank, which)->Size();
      Opener open = [lazy, which, n_bytes]() { return lazy->Open(which, n_bytes); };
      UCPFS_ASSIGN_OR_RETURN(Ino ino, tree.AddFile(rdir, name, n_bytes, mtime, std::move(open)));
      UCPFS_RETURN_IF_ERROR(tree.SetAccess(ino, access.mode, access.uid, access.gid));
      if (share != nullptr) *share = ino;
      ++*n_files;
      return Status::Ok();
    };
    UCPFS_RETURN_IF_ERROR(add("model.pt", RankFile::kModel, &shared.first));
    if (files_of_rank.model_safetensors || shared.third != 0) {
      UCPFS_RETURN_IF_ERROR(add("model.safetensors", RankFile::kSafetensors, &shared.third));
    } else if (shared.refused_safetensors != 0) {
      UCPFS_RETURN_IF_ERROR(tree.AddLink(rdir, "model.safetensors.error", shared.refused_safetensors));
    } else if (!files_of_rank.model_safetensors_refused.empty()) {
      // Where safetensors cannot hold the rank's tensors the file is left out, and says why.
      const std::string text = files_of_rank.model_safetensors_refused + "\n";
      auto src = std::make_shared<MemorySource>(
          "target/" + l.name + "/rank_" + std::to_string(rank) + "/model.safetensors.error",
          std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
      UCPFS_ASSIGN_OR_RETURN(shared.refused_safetensors,
                             tree.AddFile(rdir, "model.safetensors.error", src->Size(), mtime, FixedSource(src)));
      UCPFS_RETURN_IF_ERROR(tree.SetAccess(shared.refused_safetensors, access.mode, access.uid, access.gid));
    }
    if (files_of_rank.optim || (l.zero == 0 && shared.second != 0)) {
      UCPFS_RETURN_IF_ERROR(add("optim.pt", RankFile::kOptim, l.zero == 0 ? &shared.second : nullptr));
    }
    if (sized_from_first) {
      if (shared.has_extra) UCPFS_RETURN_IF_ERROR(add("extra_state.pt", RankFile::kExtra, nullptr, shared.extra_bytes));
      const uint64_t info_bytes =
          views::TargetPlan::ReplicaInfoBytes(shared.info_bytes, shared.first_rank, shared.first_dp, rank, c.dp);
      UCPFS_RETURN_IF_ERROR(add("ucp_info.json", RankFile::kInfo, nullptr, info_bytes));
      continue;
    }
    if (files_of_rank.extra) UCPFS_RETURN_IF_ERROR(add("extra_state.pt", RankFile::kExtra, nullptr));
    UCPFS_RETURN_IF_ERROR(add("ucp_info.json", RankFile::kInfo, nullptr));
  }
  return Status::Ok();
}

// <dir>/ with the universal view's files, and `latest_universal` naming it. Checkpoint files
// (the model states ds_to_universal copies) are served from `source_dir` + `source_prefix` +
// source_rel, opened at open(2) and checked against the size seen now. Every one is resolved
// before the first node is added, so a missing source file or a taken name fails with the tree
// unchanged.
Status AddUniversal(Tree& tree, const index::UniversalView& u, const std::string& source_dir,
                    const std::string& source_prefix, struct timespec mtime, const ViewAccess& access,
                    size_t* n_files) {
  struct Copied {
    std::string path;
    struct stat st;
  };
  std::vector<Copied> copies;  // each checkpoint file, in order
  for (const auto& f : u.files) {
    if (f.source != nullptr) continue;
    const std::string path = source_dir + "/" + source_prefix + f.source_rel;
    struct stat st = {};
    if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
      return NotFoundError(u.dir + "/" + f.rel_path + ": source file " + source_prefix + f.source_rel +
                           " is not a regular file in the source");
    }
    copies.push_back({path, st});
  }
  if (tree.Lookup(kRootIno, u.dir) != nullptr) return InternalError(u.dir + ": the name is taken in the mount");
  UCPFS_ASSIGN_OR_RETURN(Ino udir, tree.AddDir(kRootIno, u.dir, mtime));
  size_t next_link = 0;
  for (const auto& f : u.files) {
    const size_t slash = f.rel_path.rfind('/');
    Ino parent = udir;
    if (slash != std::string::npos) {
      UCPFS_ASSIGN_OR_RETURN(parent, tree.MakeDirs(udir, f.rel_path.substr(0, slash), mtime));
    }
    const std::string name = f.rel_path.substr(slash == std::string::npos ? 0 : slash + 1);
    if (f.source == nullptr) {
      const Copied& c = copies[next_link++];
      Opener open = [path = c.path]() -> Result<std::shared_ptr<const ByteSource>> {
        UCPFS_ASSIGN_OR_RETURN(auto file, FileSource::Open(path));
        return std::shared_ptr<const ByteSource>(std::move(file));
      };
      UCPFS_ASSIGN_OR_RETURN(Ino ino, tree.AddFile(parent, name, static_cast<uint64_t>(c.st.st_size), c.st.st_mtim,
                                                   std::move(open)));
      UCPFS_RETURN_IF_ERROR(tree.SetAccess(ino, c.st.st_mode, c.st.st_uid, c.st.st_gid));
      continue;
    }
    const uint64_t n_bytes = f.source->Size();
    UCPFS_ASSIGN_OR_RETURN(Ino ino, tree.AddFile(parent, name, n_bytes, mtime, FixedSource(f.source)));
    UCPFS_RETURN_IF_ERROR(tree.SetAccess(ino, access.mode, access.uid, access.gid));
    ++*n_files;
  }
  if (!u.latest_universal.empty()) {
    auto text = std::make_shared<MemorySource>(
        "latest_universal", std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(u.latest_universal.data()),
                                                     u.latest_universal.size()));
    const uint64_t n_bytes = text->Size();
    UCPFS_ASSIGN_OR_RETURN(Ino ino, tree.AddFile(kRootIno, "latest_universal", n_bytes, mtime, FixedSource(text)));
    UCPFS_RETURN_IF_ERROR(tree.SetAccess(ino, access.mode, access.uid, access.gid));
  }
  return Status::Ok();
}

// `atomic/<param>/<state>.pt` files under `atomic`.
Status AddAtomicFiles(Tree& tree, Ino atomic, std::vector<index::AtomicView> atomic_views, struct timespec mtime,
                      const ViewAccess& access, size_t* n_atomic, uint64_t* atomic_bytes) {
  std::map<std::string, Ino> param_dirs;
  for (auto& v : atomic_views) {
    auto [dir, fresh] = param_dirs.try_emplace(v.dir, 0);
    if (fresh) {
      UCPFS_ASSIGN_OR_RETURN(dir->second, tree.AddDir(atomic, v.dir, mtime));
    }
    const uint64_t n_bytes = v.source->Size();
    *atomic_bytes += n_bytes;
    UCPFS_ASSIGN_OR_RETURN(Ino ino, tree.AddFile(dir->second, v.file, n_bytes, mtime, FixedSource(std::move(v.source))));
    UCPFS_RETURN_IF_ERROR(tree.SetAccess(ino, access.mode, access.uid, access.gid));
    ++*n_atomic;
  }
  return Status::Ok();
}

// `safetensors/` under `parent` (index/safetensors_view.h), when the source has weights
// safetensors can hold; otherwise *error says why there is none (the mount goes on without it).
Status AddSafetensorsView(Tree& tree, Ino parent, const index::Snapshot& snap, const index::PatternOptions& patterns,
                          uint64_t shard_n_bytes, struct timespec mtime, const ViewAccess& access, size_t* n_files,
                          std::string* error) {
  auto built = index::BuildSafetensorsView(snap.checkpoint(), snap.mapping, snap.files, patterns, shard_n_bytes);
  if (!built.ok()) {
    *error = built.error().ToString();
    std::fprintf(stderr, "ucpfs: warning: no safetensors/ view: %s\n", error->c_str());
    return Status::Ok();
  }
  auto& files = *built;
  if (files.empty()) return Status::Ok();
  UCPFS_ASSIGN_OR_RETURN(Ino dir, tree.AddDir(parent, "safetensors", mtime));
  for (auto& f : files) {
    const uint64_t n_bytes = f.source->Size();
    UCPFS_ASSIGN_OR_RETURN(Ino ino, tree.AddFile(dir, f.name, n_bytes, mtime, FixedSource(std::move(f.source))));
    UCPFS_RETURN_IF_ERROR(tree.SetAccess(ino, access.mode, access.uid, access.gid));
    ++*n_files;
  }
  return Status::Ok();
}

// `hf/` under `parent` (index/hf_view.h); when it cannot be made, `hf.error` there holds why
// (and *error, for status.json): the mount goes on without it.
Status AddHfView(Tree& tree, Ino parent, const index::Snapshot& snap, const index::PatternOptions& patterns,
                 const index::HfViewOptions& options, struct timespec mtime, const ViewAccess& access, size_t* n_files,
                 std::string* error) {
  auto built = index::BuildHfView(snap.checkpoint(), snap.mapping, snap.files, patterns, snap.source_dir(), options);
  if (!built.ok()) {
    *error = built.error().message();
    auto src = std::make_shared<MemorySource>("hf.error", std::vector<std::byte>(
        reinterpret_cast<const std::byte*>(error->data()), reinterpret_cast<const std::byte*>(error->data()) + error->size()));
    const uint64_t n = src->Size();
    UCPFS_ASSIGN_OR_RETURN(Ino ino, tree.AddFile(parent, "hf.error", n, mtime, FixedSource(std::move(src))));
    return tree.SetAccess(ino, access.mode, access.uid, access.gid);
  }
  UCPFS_ASSIGN_OR_RETURN(Ino dir, tree.AddDir(parent, "hf", mtime));
  for (auto& f : *built) {
    const uint64_t n_bytes = f.source->Size();
    UCPFS_ASSIGN_OR_RETURN(Ino ino, tree.AddFile(dir, f.name, n_bytes, mtime, FixedSource(std::move(f.source))));
    UCPFS_RETURN_IF_ERROR(tree.SetAccess(ino, access.mode, access.uid, access.gid));
    ++*n_files;
  }
  return Status::Ok();
}

// `.ucpfs/`: status.json (`status_text`), stats.json (counters as of open(2): `counters`' and
// the capture's, padded with spaces to a fixed size so the size is known before the content;
// JSON allows trailing white space) and, with a capture, `sync` (its open(2) returns once
// everything saved before it is durable).
// With `status_live`, status.json is made again at each open (what happened since the mount,
// e.g. refused layouts): status_live(n) returns the text in at most n - 1 bytes, padded with
// spaces to a fixed size of status_text's plus kStatusRefusalRoomBytes.
Status AddMeta(Tree& tree, struct timespec mtime, const std::string& status_text,
               std::function<void(nlohmann::ordered_json&)> counters, const MountHooks& hooks,
               std::function<std::string(uint64_t)> status_live = nullptr) {
  UCPFS_ASSIGN_OR_RETURN(Ino meta, tree.AddDir(kRootIno, ".ucpfs", mtime));
  if (status_live) {
    const uint64_t n_bytes = status_text.size() + kStatusRefusalRoomBytes;
    Opener open = [status_live, n_bytes]() -> Result<std::shared_ptr<const ByteSource>> {
      std::string text = status_live(n_bytes);
      if (text.size() >= n_bytes) return InternalError("status.json outgrew its " + std::to_string(n_bytes) + " bytes");
      text.pop_back();  // the newline goes last, after the padding
      text.resize(n_bytes - 1, ' ');
      text.push_back('\n');
      return std::shared_ptr<const ByteSource>(std::make_shared<MemorySource>(
          ".ucpfs/status.json", std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size())));
    };
    UCPFS_ASSIGN_OR_RETURN(Ino status_ino, tree.AddFile(meta, "status.json", n_bytes, Now(), std::move(open)));
    UCPFS_RETURN_IF_ERROR(tree.MarkVolatile(status_ino));
  } else {
    auto status_src = std::make_shared<MemorySource>(
        ".ucpfs/status.json",
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(status_text.data()), status_text.size()));
    const uint64_t status_n_bytes = status_src->Size();
    UCPFS_RETURN_IF_ERROR(
        tree.AddFile(meta, "status.json", status_n_bytes, Now(), FixedSource(std::move(status_src))).status());
  }
  Opener stats_open = [counters, capture = hooks.capture_stats,
                       report = hooks.report]() -> Result<std::shared_ptr<const ByteSource>> {
    nlohmann::ordered_json j;
    if (counters) counters(j);
    if (report) report->AddTo(j);
    if (capture) j["capture"] = capture();
    std::string text = JsonText(j) + "\n";
    if (text.size() > kStatsJsonBytes) return InternalError("stats.json outgrew its " + std::to_string(kStatsJsonBytes) + " bytes");
    text.resize(kStatsJsonBytes, ' ');
    text.back() = '\n';
    return std::shared_ptr<const ByteSource>(std::make_shared<MemorySource>(
        ".ucpfs/stats.json",
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size())));
  };
  UCPFS_ASSIGN_OR_RETURN(Ino stats_ino,
                         tree.AddFile(meta, "stats.json", kStatsJsonBytes, Now(), std::move(stats_open)));
  UCPFS_RETURN_IF_ERROR(tree.MarkVolatile(stats_ino));
  if (hooks.sync) {
    Opener sync_open = [sync = hooks.sync]() -> Result<std::shared_ptr<const ByteSource>> {
      UCPFS_RETURN_IF_ERROR(sync());
      return std::shared_ptr<const ByteSource>(std::make_shared<MemorySource>(".ucpfs/sync", std::vector<std::byte>{}));
    };
    UCPFS_ASSIGN_OR_RETURN(Ino sync_ino, tree.AddFile(meta, "sync", 0, Now(), std::move(sync_open)));
    UCPFS_RETURN_IF_ERROR(tree.MarkVolatile(sync_ino));
  }
  return Status::Ok();
}

}  // namespace

Result<std::shared_ptr<Tree>> BuildEmptyNamespace(const std::string& source_dir, const std::string& why,
                                                  uint64_t generation, const MountHooks& hooks, NamespaceInfo* info) {
  auto tree = std::make_shared<Tree>();
  const struct timespec mtime = Now();
  nlohmann::ordered_json status;
  status["source"] = source_dir;
  status["format"] = "none";
  status["no_checkpoint"] = why;
  status["generation"] = generation;
  const std::string status_text = JsonText(status) + "\n";
  UCPFS_RETURN_IF_ERROR(AddMeta(*tree, mtime, status_text, nullptr, hooks));
  if (info != nullptr) {
    info->source_dir = source_dir;
    info->status_json = status_text;
  }
  return tree;
}


Result<std::shared_ptr<Tree>> BuildNamespace(std::shared_ptr<const index::Snapshot> snapshot,
                                             const TargetOptions& targets, const MountHooks& hooks,
                                             NamespaceInfo* info) {
  auto tree = std::make_shared<Tree>();
  const std::string& source_dir = snapshot->source_dir();
  const index::OpenedIndex& opened = snapshot->opened;
  const index::KeyMapping& mapping = snapshot->mapping;
  const auto& ckpt = opened.checkpoint;
  struct stat src_st;
  if (::stat(source_dir.c_str(), &src_st) != 0) {
    return IoError(source_dir + ": stat: " + std::strerror(errno), errno);
  }
  const struct timespec mtime = src_st.st_mtim;

  // Source files by id, opened on first read.
  const std::shared_ptr<IoCounters> counters = snapshot->counters;
  const index::FileTable& files = snapshot->files;
  const ViewAccess access = AccessOfSources(source_dir, ckpt.files);

  // DeepSpeed: <tag>_universal/ and latest_universal. A checkpoint the view cannot serve is
  // still mounted, without it; the reason goes to the log and status.json.
  std::optional<index::UniversalView> universal;
  std::string universal_error;
  {
    const std::string base = source_dir.substr(source_dir.find_last_of('/') + 1);
    auto built = index::BuildUniversalView(ckpt, mapping, files, base.empty() ? "checkpoint" : base);
    if (built.ok()) {
      universal = std::move(*built);
    } else {
      universal_error = built.error().message();
      std::fprintf(stderr, "ucpfs: warning: no universal view: %s\n", universal_error.c_str());
    }
  }
  // A save directory (`latest` names its tag): <tag>_universal/ for every other tag as well,
  // each built from its tag directory alone (index/deepspeed_tags.h). A tag that cannot be
  // served is left out with its error; the mount goes on.
  index::DeepSpeedTags other_tags;
  std::string other_tags_error;
  {
    auto built = index::BuildDeepSpeedTagViews(source_dir, ckpt, counters);
    if (built.ok()) {
      other_tags = std::move(*built);
    } else {
      other_tags_error = built.error().message();
      std::fprintf(stderr, "ucpfs: warning: no universal views of the other tags: %s\n", other_tags_error.c_str());
    }
    for (const auto& t : other_tags.tags) {
      if (!t.view) std::fprintf(stderr, "ucpfs: warning: no %s_universal: %s\n", t.name.c_str(), t.error.c_str());
    }
    if (other_tags.n_left_out > 0) {
      std::fprintf(stderr, "ucpfs: warning: %zu more subdirectories not examined for tags (at most %zu tags)\n",
                   other_tags.n_left_out, index::kMaxDeepSpeedTags);
    }
  }

  // The source's own files are served beside the tree by the mount's Passthrough.
  const size_t n_passthrough = ckpt.files.size();
  size_t n_universal = 0;
  if (universal) {
    UCPFS_RETURN_IF_ERROR(AddUniversal(*tree, *universal, source_dir, "", mtime, access, &n_universal));
  }
  for (auto& t : other_tags.tags) {
    if (!t.view) continue;
    const std::string tag_dir = source_dir + "/" + t.name;
    const Status added =
        AddUniversal(*tree, *t.view, source_dir, t.name + "/", mtime, AccessOfSources(tag_dir, t.files), &n_universal);
    if (!added.ok()) {
      t.error = added.message();
      std::fprintf(stderr, "ucpfs: warning: no %s: %s\n", t.view->dir.c_str(), t.error.c_str());
      t.view.reset();
    }
  }
  UCPFS_ASSIGN_OR_RETURN(Ino atomic, tree->AddDir(kRootIno, "atomic", mtime));
  size_t n_atomic = 0;
  uint64_t atomic_bytes = 0;
  UCPFS_ASSIGN_OR_RETURN(const index::PatternOptions patterns,
                         index::PatternOptionsFor(ckpt, targets.preset, targets.rules, targets.vocab_pad_multiple));
  UCPFS_ASSIGN_OR_RETURN(auto atomic_views, index::BuildAtomicViews(ckpt, mapping, files, patterns));
  UCPFS_RETURN_IF_ERROR(AddAtomicFiles(*tree, atomic, std::move(atomic_views), mtime, access, &n_atomic, &atomic_bytes));
  size_t n_safetensors = 0;
  std::string safetensors_error;
  UCPFS_RETURN_IF_ERROR(AddSafetensorsView(*tree, kRootIno, *snapshot, patterns, targets.safetensors_shard_n_bytes, mtime,
                                           access, &n_safetensors, &safetensors_error));
  size_t n_hf = 0;
  std::string hf_error;
  UCPFS_RETURN_IF_ERROR(AddHfView(*tree, kRootIno, *snapshot, patterns, targets.hf, mtime, access, &n_hf, &hf_error));

  // target/<layout>/rank_<N>/: the --layout views now; any other valid layout name when it is
  // first looked up (NamespaceInfo::resolve_target).
  UCPFS_ASSIGN_OR_RETURN(Ino target, tree->AddDir(kRootIno, "target", mtime));
  size_t n_target = 0;
  // Made now, not on first lookup: status.json lists the extra state and what is not served,
  // which takes decoding the small non-tensor items (tensor bytes stay unread).
  UCPFS_ASSIGN_OR_RETURN(auto target_input, MakeSharedTargetInput(ckpt, mapping, files, targets, patterns));
  {
    for (const auto& l : targets.layouts) {
      UCPFS_ASSIGN_OR_RETURN(auto plan, views::TargetPlan::Make(target_input, l));
      UCPFS_ASSIGN_OR_RETURN(Ino ldir, tree->AddDir(target, l.name, mtime));
      UCPFS_RETURN_IF_ERROR(AddLayoutRanks(*tree, ldir, std::make_shared<const views::TargetPlan>(std::move(plan)),
                                           mtime, access, &n_target));
    }
  }
  // Memory of the layouts built on lookup. A layout's estimate is reserved before it is built
  // and given back when its Tree is destroyed (the Filesystem evicts it once the kernel has
  // forgotten its inodes), so the budget bounds what they hold at once, not in a lifetime.
  struct LookupBudget {
    std::mutex mu;
    uint64_t limit = 0;
    uint64_t used = 0;   // guarded by mu
    uint64_t n_live = 0;  // layouts holding a reservation; guarded by mu
    // Their names (a name twice while a rebuilt layout races its evicted one); guarded by mu.
    std::multiset<std::string> names;
    // The last layouts a lookup named but could not build, with why (newest last; a name once);
    // guarded by mu. Shown in stats.json and `ucpfs status`: a refused lookup only says ENOENT.
    std::deque<std::pair<std::string, std::string>> refused;
    void Refused(const std::string& name, std::string why) {
      if (why.size() > kMaxRefusalBytes) why = why.substr(0, kMaxRefusalBytes - 3) + "...";
      std::lock_guard lock(mu);
      std::erase_if(refused, [&](const auto& r) { return r.first == name; });
      if (refused.size() == kMaxListedRefusals) refused.pop_front();
      refused.emplace_back(name, std::move(why));
    }
    // The reason the layout `name` was last refused, if it is still listed.
    std::optional<std::string> RefusalOf(const std::string& name) {
      std::lock_guard lock(mu);
      for (const auto& [layout_name, why] : refused) {
        if (layout_name == name) return why;
      }
      return std::nullopt;
    }
    void Release(const std::string& name, uint64_t n_bytes) {
      std::lock_guard lock(mu);
      used -= std::min(used, n_bytes);
      n_live -= std::min<uint64_t>(n_live, 1);
      if (auto it = names.find(name); it != names.end()) names.erase(it);
    }
  };
  // A subtree and its reservation: handed out through an aliasing shared_ptr to `tree`.
  struct BudgetedTree {
    BudgetedTree(struct timespec mtime, std::shared_ptr<LookupBudget> budget_in, std::string name_in,
                 uint64_t n_bytes_in)
        : tree(mtime), budget(std::move(budget_in)), name(std::move(name_in)), n_bytes(n_bytes_in) {}
    BudgetedTree(const BudgetedTree&) = delete;
    BudgetedTree& operator=(const BudgetedTree&) = delete;
    ~BudgetedTree() { budget->Release(name, n_bytes); }
    Tree tree;
    std::shared_ptr<LookupBudget> budget;
    std::string name;
    uint64_t n_bytes;
  };
  auto budget = std::make_shared<LookupBudget>();
  budget->limit = targets.lookup_budget_bytes;
  auto build_layout = [snapshot, target_input, mtime, access, budget](
                          const layout::Layout& l) -> Result<std::shared_ptr<const Tree>> {
    // A stray lookup must not make the daemon build thousands of rank directories; larger
    // layouts can still be given explicitly with --layout.
    if (l.World() > kMaxLookupWorld) {
      return InvalidArgumentError("layout " + l.name + " has " + std::to_string(l.World()) +
                                  " ranks; layouts built on lookup are limited to " +
                                  std::to_string(kMaxLookupWorld) + " (use --layout)");
    }
    UCPFS_ASSIGN_OR_RETURN(auto made, views::TargetPlan::Make(target_input, l));
    auto plan = std::make_shared<const views::TargetPlan>(std::move(made));
    // Bounded memory: a layout keeps only its tree (rank files are built again on open:
    // LazyRankFiles), so its estimate is rank 0's tree bytes × ranks, reserved before any rank
    // is added; a layout that would pass the budget shared by all layouts built on lookup is
    // refused.
    UCPFS_ASSIGN_OR_RETURN(auto probe, plan->Build(0));
    const uint64_t estimate = RankTreeBytes(probe) * static_cast<uint64_t>(l.World());
    {
      std::lock_guard lock(budget->mu);
      if (budget->used + estimate > budget->limit) {
        return ResourceExhaustedError(
            "layout " + l.name + " would take about " + std::to_string(estimate >> 20) + " MiB (" +
            std::to_string(l.World()) + " ranks); layouts built on lookup may take " +
            std::to_string(budget->limit >> 20) + " MiB together and " + std::to_string(budget->used >> 20) +
            " MiB are in use (raise --lookup-memory-mib, or give it with --layout; layouts no longer in "
            "use are released when the kernel forgets them)");
      }
      budget->used += estimate;  // reserved now, so racing lookups cannot both pass
      ++budget->n_live;
      budget->names.insert(l.name);
    }
    auto sub = std::make_shared<BudgetedTree>(mtime, budget, l.name, estimate);  // releases on failure too
    size_t n_files = 0;
    UCPFS_RETURN_IF_ERROR(AddLayoutRanks(sub->tree, kRootIno, std::move(plan), mtime, access, &n_files));
    return std::shared_ptr<const Tree>(sub, &sub->tree);
  };
  SubtreeResolver resolve_target = [build_layout, budget, mtime, access](
                                       const std::string& name) -> Result<std::shared_ptr<const Tree>> {
    if (name.ends_with(kRefusalSuffix)) {
      return RefusalFile(name.substr(0, name.size() - kRefusalSuffix.size()),
                         budget->RefusalOf(name.substr(0, name.size() - kRefusalSuffix.size())), mtime, access);
    }
    UCPFS_ASSIGN_OR_RETURN(auto l, layout::ParseLayout(name));
    if (l.name != name) {
      return InvalidArgumentError("layout '" + name + "' is not spelled canonically (use '" +
                                  l.name + "')");
    }
    // A well-formed layout that cannot be built is remembered with its reason (names that are
    // no layout are not: shells and file managers probe many).
    Result<std::shared_ptr<const Tree>> made = build_layout(l);
    if (!made.ok()) budget->Refused(l.name, made.error().message());
    return made;
  };
  // target/ lists `<layout>.error` for each refusal still remembered.
  SubtreeLister list_target = [budget]() {
    std::vector<std::string> names;
    std::lock_guard lock(budget->mu);
    for (const auto& refusal : budget->refused) names.push_back(refusal.first + std::string(kRefusalSuffix));
    return names;
  };

  nlohmann::ordered_json status;
  status["source"] = source_dir;
  status["format"] = ckpt.format;
  status["flavor"] = ckpt.flavor;
  status["index"] = {{"dir", opened.index_dir},
                     {"state", index::IndexStateName(opened.state)},
                     {"reused", opened.state == index::IndexState::kReused},
                     {"schema", index::kCatalogSchemaVersion},
                     {"fingerprint", opened.fingerprint},
                     {"open_seconds", opened.elapsed_s}};
  status["counts"] = {{"params", mapping.params.size()},
                      {"atomic_files", n_atomic},
                      {"target_files", n_target},
                      {"safetensors_files", n_safetensors},
                      {"hf_files", n_hf},
                      {"atomic_bytes", atomic_bytes},
                      {"source_files", n_passthrough},
                      {"universal_files", n_universal},
                      {"items", ckpt.items.size()},
                      {"unmapped_keys", mapping.unmapped_keys.size()}};
  if (!safetensors_error.empty()) status["safetensors"] = {{"error", safetensors_error}};
  if (!hf_error.empty()) status["hf"] = {{"error", hf_error}};
  status["target_layouts"] = nlohmann::ordered_json::array();
  for (const auto& l : targets.layouts) status["target_layouts"].push_back(l.name);
  if (universal) {
    status["universal"] = {{"dir", universal->dir}, {"latest_universal", universal->latest_universal}};
  } else if (!universal_error.empty()) {
    status["universal"] = {{"error", universal_error}};
  }
  if (!other_tags_error.empty()) {
    status["universal_tags_error"] = other_tags_error;
  }
  if (!other_tags.tags.empty()) {
    status["universal_tags"] = nlohmann::ordered_json::array();
    for (const auto& t : other_tags.tags) {
      nlohmann::ordered_json j = {{"tag", t.name}, {"dir", t.name + "_universal"}};
      if (!t.view) j["error"] = t.error;
      status["universal_tags"].push_back(std::move(j));
    }
  }
  if (other_tags.n_left_out > 0) {
    status["universal_tags_left_out"] = {
        {"subdirectories", other_tags.n_left_out},
        {"reason", "at most " + std::to_string(index::kMaxDeepSpeedTags) +
                       " tags get a universal view; the subdirectories after them (in name order) were not examined"}};
  }
  status["unmapped_keys"] = mapping.unmapped_keys;
  // What the key mapping read from the checkpoint's structure, and what it would not guess.
  status["key_structure"] = {{"model_prefix", mapping.model_prefix},
                             {"optimizer_prefixes", mapping.optimizer_prefixes},
                             {"ambiguities", mapping.ambiguities}};
  // Parameters the optimizer holds fused and the model saves split (views::FusedParam).
  status["fused_params"] = nlohmann::ordered_json::array();
  for (const auto& f : target_input->fused) {
    status["fused_params"].push_back({{"param", f.param}, {"stored_as", f.stored_as}, {"note", views::FusedParam::kNote}});
  }
  status["extra_state"] = nlohmann::ordered_json::array();
  for (const auto& e : target_input->extras) {
    nlohmann::ordered_json j = {{"key", e.key}};
    if (e.dp_rank >= 0) j["source_dp_rank"] = e.dp_rank;
    status["extra_state"].push_back(std::move(j));
  }
  // Parameters whose atomic/ directory name is not their fqn (views::AtomicDirName).
  status["escaped_names"] = nlohmann::ordered_json::array();
  for (const auto& p : mapping.params) {
    const std::string dir = views::AtomicDirName(p.name);
    if (dir != p.name) status["escaped_names"].push_back({{"param", p.name}, {"dir", "atomic/" + dir}});
  }
  status["not_served"] = nlohmann::ordered_json::array();
  for (const auto& n : target_input->not_served) {
    status["not_served"].push_back({{"key", n.key}, {"reason", n.reason}});
  }
  status["generation"] = snapshot->generation;
  for (const auto& [key, value] : hooks.status_extra.items()) status[key] = value;
  // Layouts a lookup named and could not build, with why (newest last): filled in at each open
  // of status.json (status_live below), as in stats.json's lookup_layouts.refused.
  status["target_refused"] = nlohmann::ordered_json::array();
  const std::string status_text = JsonText(status) + "\n";
  auto status_live = [status, budget](uint64_t n_bytes) {
    nlohmann::ordered_json j = status;
    {
      std::lock_guard lock(budget->mu);
      for (const auto& [name, why] : budget->refused) j["target_refused"].push_back({{"layout", name}, {"reason", why}});
    }
    std::string text = JsonText(j) + "\n";
    // The oldest refusals give way when escapes make them outgrow the room (never in practice).
    while (text.size() >= n_bytes && !j["target_refused"].empty()) {
      j["target_refused"].erase(0);
      text = JsonText(j) + "\n";
    }
    return text;
  };
  auto source_counters = [counters, budget](nlohmann::ordered_json& j) {
    j["source_bytes_read"] = counters->source_bytes_read.load();
    j["source_reads"] = counters->source_reads.load();
    j["source_read_errors"] = counters->source_read_errors.load();
    j["source_files_opened"] = counters->files_opened.load();
    std::lock_guard lock(budget->mu);
    // Layouts built on lookup and not yet released, by name (at most kMaxListedLookupLayouts:
    // stats.json has a fixed size).
    nlohmann::ordered_json names = nlohmann::ordered_json::array();
    for (const std::string& name : std::set<std::string>(budget->names.begin(), budget->names.end())) {
      if (names.size() == kMaxListedLookupLayouts) break;
      names.push_back(name);
    }
    nlohmann::ordered_json refused = nlohmann::ordered_json::array();
    for (const auto& [name, why] : budget->refused) refused.push_back({{"layout", name}, {"reason", why}});
    j["lookup_layouts"] = {{"live", budget->n_live},
                           {"names", std::move(names)},
                           {"memory_bytes", budget->used},
                           {"memory_limit_bytes", budget->limit},
                           {"max_ranks", kMaxLookupWorld},
                           {"refused", std::move(refused)}};
  };
  UCPFS_RETURN_IF_ERROR(AddMeta(*tree, mtime, status_text, source_counters, hooks, status_live));
  if (info != nullptr) {
    info->source_dir = source_dir;
    info->n_atomic_files = n_atomic;
    info->n_passthrough_files = n_passthrough;
    info->n_target_files = n_target;
    info->status_json = std::move(status_text);
    info->target_dir = target;
    info->resolve_target = std::move(resolve_target);
    info->list_target = std::move(list_target);
  }
  return tree;
}

Result<std::shared_ptr<Tree>> BuildRunNamespace(const std::vector<NamedSnapshot>& run, const TargetOptions& targets,
                                                const MountHooks& hooks, NamespaceInfo* info) {
  if (run.empty()) return InvalidArgumentError("a run with no checkpoint");
  UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<Tree> tree, BuildNamespace(run.back().snapshot, targets, hooks, info));
  if (tree->Lookup(kRootIno, "checkpoints") != nullptr) {
    return InvalidArgumentError("the views of the newest checkpoint already use the name 'checkpoints'");
  }
  const struct timespec mtime = Now();
  UCPFS_ASSIGN_OR_RETURN(Ino all, tree->AddDir(kRootIno, "checkpoints", mtime));
  for (const NamedSnapshot& named : run) {
    const index::Snapshot& snap = *named.snapshot;
    const index::Checkpoint& ckpt = snap.checkpoint();
    const ViewAccess access = AccessOfSources(snap.source_dir(), ckpt.files);
    UCPFS_ASSIGN_OR_RETURN(Ino dir, tree->AddDir(all, named.name, mtime));
    UCPFS_ASSIGN_OR_RETURN(Ino atomic, tree->AddDir(dir, "atomic", mtime));
    UCPFS_ASSIGN_OR_RETURN(const index::PatternOptions patterns,
                           index::PatternOptionsFor(ckpt, targets.preset, targets.rules, targets.vocab_pad_multiple));
    UCPFS_ASSIGN_OR_RETURN(auto atomic_views, index::BuildAtomicViews(ckpt, snap.mapping, snap.files, patterns));
    size_t n_atomic = 0;
    uint64_t atomic_bytes = 0;
    UCPFS_RETURN_IF_ERROR(AddAtomicFiles(*tree, atomic, std::move(atomic_views), mtime, access, &n_atomic, &atomic_bytes));
    size_t n_safetensors = 0;
    std::string safetensors_error;
    UCPFS_RETURN_IF_ERROR(AddSafetensorsView(*tree, dir, snap, patterns, targets.safetensors_shard_n_bytes, mtime, access,
                                             &n_safetensors, &safetensors_error));
    if (!targets.layouts.empty()) {
      UCPFS_ASSIGN_OR_RETURN(Ino target, tree->AddDir(dir, "target", mtime));
      UCPFS_ASSIGN_OR_RETURN(auto input, MakeSharedTargetInput(ckpt, snap.mapping, snap.files, targets, patterns));
      size_t n_target = 0;
      for (const auto& l : targets.layouts) {
        UCPFS_ASSIGN_OR_RETURN(auto plan, views::TargetPlan::Make(input, l));
        UCPFS_ASSIGN_OR_RETURN(Ino ldir, tree->AddDir(target, l.name, mtime));
        UCPFS_RETURN_IF_ERROR(AddLayoutRanks(*tree, ldir, std::make_shared<const views::TargetPlan>(std::move(plan)),
                                             mtime, access, &n_target));
      }
    }
  }
  return tree;
}

}  // namespace ucpfs::fs
