#include "cli/checkpoint_cmds.h"
#include "core/json_text.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "cli/progress.h"
#include "cli/text.h"
#include "cli/view_files.h"
#include "core/layout/layout.h"
#include "core/layout/patterns.h"
#include "views/atomic.h"
#include "fs/fuse_mount.h"
#include "fs/mounts.h"
#include "core/io/pinned_cache.h"
#include "core/io/write_capture.h"
#include "fs/namespace.h"
#include "views/mount_views.h"
#include "fs/passthrough.h"
#include "views/safetensors_view.h"
#include "fs/filesystem.h"
#include "index/run_dir.h"
#include "index/snapshot.h"
#include "index/catalog.h"
#include "index/key_map.h"
#include "views/view_inputs.h"

namespace ucpfs::cli {

std::string AbsPathOrJoined(const std::string& p) {
  std::string out = AbsPath(p);
  if (out.empty() || out[0] != '/') {
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof(cwd)) != nullptr) out = std::string(cwd) + "/" + out;
  }
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}

namespace {

// The snapshot options of SRC (rules loaded).
Result<index::SnapshotOptions> SnapshotOptionsOf(const SourceArgs& args, bool progress) {
  struct stat st;
  if (::stat(args.src.c_str(), &st) != 0) {
    return NotFoundError(args.src + ": no such directory");
  }
  if (!S_ISDIR(st.st_mode)) {
    return InvalidArgumentError(args.src + ": not a directory (for a torch.save file use `ucpfs inspect FILE`)");
  }
  index::SnapshotOptions o;
  o.source_dir = AbsPath(args.src);
  o.index_dir = args.index_dir;
  o.read_only_index = args.read_only_index;
  if (progress) o.progress = IndexingProgress(args.quiet);
  if (!args.rules.empty()) {
    UCPFS_ASSIGN_OR_RETURN(o.key_rules, index::LoadRules(args.rules));
  }
  return o;
}

uint64_t TensorBytes(const index::Item& it) { return it.layout.NumElems() * ItemSize(it.dtype); }

}  // namespace

int Fail(const char* cmd, const Status& s) {
  std::cerr << "ucpfs " << cmd << ": " << s.ToString() << '\n';
  return 1;
}

std::string AbsPath(const std::string& p) {
  char buf[PATH_MAX];
  if (::realpath(p.c_str(), buf) != nullptr) return buf;
  return p;
}

Result<std::shared_ptr<const index::Snapshot>> OpenSourceSnapshot(const SourceArgs& args, bool progress) {
  UCPFS_ASSIGN_OR_RETURN(const index::SnapshotOptions o, SnapshotOptionsOf(args, progress));
  return index::OpenSnapshot(o, 1);
}

int RunIndex(const SourceArgs& args, bool json) {
  auto l = OpenSourceSnapshot(args, /*progress=*/true);
  if (!l.ok()) return Fail("index", l.error());
  const auto& c = (*l)->opened.checkpoint;
  uint64_t tensor_bytes = 0, fragments = 0;
  for (const auto& it : c.items) {
    if (it.kind == index::ItemKind::kTensor) {
      tensor_bytes += TensorBytes(it);
      fragments += it.layout.fragments.size();
    }
  }
  if (json) {
    nlohmann::ordered_json out;
    out["path"] = AbsPath(args.src);
    out["format"] = c.format;
    out["flavor"] = c.flavor;
    out["files"] = c.files.size();
    out["items"] = c.items.size();
    out["fragments"] = fragments;
    out["tensor_bytes"] = tensor_bytes;
    out["params"] = (*l)->mapping.params.size();
    out["unmapped_keys"] = (*l)->mapping.unmapped_keys.size();
    out["index_state"] = index::IndexStateName((*l)->opened.state);
    out["index_dir"] = (*l)->opened.index_dir;
    out["seconds"] = (*l)->opened.elapsed_s;
    std::cout << JsonText(out) << '\n';
    return 0;
  }
  std::cout << "ucpfs index: " << AbsPath(args.src) << ": " << c.format << " (" << c.flavor << "), "
            << c.files.size() << " files, " << c.items.size() << " items, " << fragments
            << " fragments, " << tensor_bytes << " tensor bytes, " << (*l)->mapping.params.size()
            << " parameters, " << (*l)->mapping.unmapped_keys.size() << " unmapped keys\n"
            << "ucpfs index: " << index::IndexStateName((*l)->opened.state) << " at "
            << (*l)->opened.index_dir << " in " << (*l)->opened.elapsed_s << " s\n";
  return 0;
}

int RunInspectCheckpoint(const SourceArgs& args, bool json) {
  auto l = OpenSourceSnapshot(args, /*progress=*/true);
  if (!l.ok()) return Fail("inspect", l.error());
  const auto& c = (*l)->opened.checkpoint;
  nlohmann::ordered_json out;
  out["format"] = c.format;
  out["flavor"] = c.flavor;
  out["path"] = AbsPath(args.src);
  auto params = nlohmann::ordered_json::array();
  for (const auto& p : (*l)->mapping.params) {
    nlohmann::ordered_json states = nlohmann::ordered_json::object();
    for (int k = 0; k < index::kNumStateKinds; ++k) {
      if (p.item[k] < 0) continue;
      const auto& it = c.items[static_cast<size_t>(p.item[k])];
      nlohmann::ordered_json s;
      s["key"] = it.key;
      if (it.kind == index::ItemKind::kTensor) {
        std::set<std::string> files;
        for (const auto& f : it.layout.fragments) files.insert(c.files[f.file_id].rel_path);
        s["dtype"] = std::string(TorchName(it.dtype));
        s["shape"] = it.layout.shape;
        s["pattern"] = views::DescribePattern(it.layout);
        s["fragments"] = it.layout.fragments.size();
        s["nbytes"] = TensorBytes(it);
        s["files"] = std::vector<std::string>(files.begin(), files.end());
      } else {
        s["dtype"] = "bytes";
        s["nbytes"] = it.n_bytes;
        s["files"] = {c.files[it.file_id].rel_path};
      }
      states[index::StateKindName(static_cast<index::StateKind>(k))] = std::move(s);
    }
    params.push_back({{"name", p.name}, {"states", std::move(states)}});
  }
  out["params"] = std::move(params);
  out["unmapped_keys"] = (*l)->mapping.unmapped_keys;
  out["key_structure"] = {{"model_prefix", (*l)->mapping.model_prefix},
                          {"optimizer_prefixes", (*l)->mapping.optimizer_prefixes},
                          {"ambiguities", (*l)->mapping.ambiguities}};
  // Non-parameter state: what target views serve in extra_state.pt, and what no view serves.
  auto input = index::MakeTargetInput(c, (*l)->mapping, (*l)->files, nullptr);
  if (!input.ok()) return Fail("inspect", input.error());
  auto extra = nlohmann::ordered_json::array();
  for (const auto& e : (*input)->extras) {
    nlohmann::ordered_json j = {{"key", e.key}};
    if (e.dp_rank >= 0) j["source_dp_rank"] = e.dp_rank;
    extra.push_back(std::move(j));
  }
  auto not_served = nlohmann::ordered_json::array();
  for (const auto& n : (*input)->not_served) not_served.push_back({{"key", n.key}, {"reason", n.reason}});
  out["extra_state"] = std::move(extra);
  out["not_served"] = std::move(not_served);
  out["fused_params"] = nlohmann::ordered_json::array();
  for (const auto& f : (*input)->fused) {
    out["fused_params"].push_back({{"param", f.param}, {"stored_as", f.stored_as}, {"note", views::FusedParam::kNote}});
  }
  if (json) {
    std::cout << JsonText(out) << '\n';
    return 0;
  }
  std::cout << out["path"].get<std::string>() << ": " << c.format << " (" << c.flavor << "), "
            << (*l)->mapping.params.size() << " parameters, " << c.files.size() << " files\n";
  for (const auto& p : out["params"]) {
    std::cout << p["name"].get<std::string>() << '\n';
    for (const auto& [state, s] : p["states"].items()) {
      std::cout << "  " << state << ": ";
      if (s["dtype"] == "bytes") {
        std::cout << "a pickled Python value (served as a 0-d float32 tensor), " << s["nbytes"] << " B\n";
        continue;
      }
      std::string files;
      for (const auto& f : s["files"]) files += (files.empty() ? "" : ",") + f.get<std::string>();
      std::cout << s["dtype"].get<std::string>() << ' ' << Dims(s["shape"].get<std::vector<int64_t>>())
                << ' ' << s["pattern"].get<std::string>() << ", " << s["fragments"] << " fragments, "
                << s["nbytes"] << " B, in " << files << '\n';
    }
  }
  for (const auto& a : (*l)->mapping.ambiguities) std::cout << "ambiguous: " << a << '\n';
  for (const auto& f : (*input)->fused) {
    std::cout << "fused: " << f.param << " (optimizer state; optim.pt) is stored split as";
    for (const auto& n : f.stored_as) std::cout << ' ' << n;
    std::cout << " (weights; model.pt)\n";
  }
  if (!(*input)->fused.empty()) std::cout << "  note: " << views::FusedParam::kNote << '\n';
  if (!(*l)->mapping.unmapped_keys.empty()) {
    std::cout << "unmapped keys (" << (*l)->mapping.unmapped_keys.size() << "):\n";
    for (const auto& k : (*l)->mapping.unmapped_keys) std::cout << "  " << k << '\n';
  }
  if (!out["extra_state"].empty()) {
    std::cout << "extra state, served in target/<layout>/rank_N/extra_state.pt (" << out["extra_state"].size()
              << "):\n";
    for (const auto& e : out["extra_state"]) {
      std::cout << "  " << e["key"].get<std::string>();
      if (e.contains("source_dp_rank")) std::cout << "  (rank-local: dp rank " << e["source_dp_rank"] << ")";
      std::cout << '\n';
    }
  }
  if (!out["not_served"].empty()) {
    std::cout << "not served (" << out["not_served"].size() << "):\n";
    for (const auto& n : out["not_served"]) {
      std::cout << "  " << n["key"].get<std::string>() << ": " << n["reason"].get<std::string>() << '\n';
    }
  }
  return 0;
}

Result<ReadAheadSizes> ParseReadAhead(const std::string& readahead, const std::string& prefetch) {
  ReadAheadSizes out;
  if (!readahead.empty()) {
    UCPFS_ASSIGN_OR_RETURN(uint64_t n, io::ParseByteSize(readahead));
    if (n < 4096 || n > (uint64_t{1} << 30)) {
      return InvalidArgumentError("--readahead " + readahead + ": between 4K and 1G");
    }
    out.kernel_n_bytes = static_cast<uint32_t>(n);
  }
  if (!prefetch.empty()) {
    UCPFS_ASSIGN_OR_RETURN(out.prefetch_n_bytes, io::ParseByteSize(prefetch));
    if (out.prefetch_n_bytes > (uint64_t{1} << 34)) {
      return InvalidArgumentError("--prefetch " + prefetch + ": at most 16G");
    }
  }
  return out;
}

Result<uint64_t> ParseShardSize(const std::string& text) {
  if (text.empty()) return index::kDefaultSafetensorsShardBytes;
  UCPFS_ASSIGN_OR_RETURN(uint64_t n, io::ParseByteSize(text));
  if (n == 0) return InvalidArgumentError("--safetensors-shard-size: a shard holds at least 1 byte");
  return n;
}

namespace {

// Parses the target-view options (before the daemon forks, so typos fail at once).
Result<views::ViewOptions> ParseTargetOptions(const MountArgs& args) {
  UCPFS_ASSIGN_OR_RETURN(ViewSelection v, ParseViewArgs({args.layouts, false, false, args.safetensors_shard_size,
                                                         args.preset, args.pattern_rules, args.pp_split,
                                                         args.vocab_pad_multiple}));
  views::ViewOptions t;
  t.layouts = std::move(v.layouts);
  t.preset = v.preset;
  t.rules = std::move(v.rules);
  t.pp_split = std::move(v.pp_split);
  t.vocab_pad_multiple = v.vocab_pad_multiple;
  if (args.lookup_memory_mib > kMaxLookupMemoryMib) {
    return InvalidArgumentError("lookup memory " + std::to_string(args.lookup_memory_mib) + " MiB: at most " +
                                std::to_string(kMaxLookupMemoryMib) + " (1 TiB)");
  }
  t.lookup_budget_bytes = args.lookup_memory_mib << 20;
  t.safetensors_shard_n_bytes = v.safetensors_shard_n_bytes;
  return t;
}

// The file names whose durability completes a checkpoint. Any durable file triggers a try (a
// `cp -r` of a checkpoint lands in directory order, its pointer not necessarily last), but
// these are tried at once, the rest after a quiet spell.
bool IsCompletionMarker(const std::string& rel) {
  const std::string name = rel.substr(rel.find_last_of('/') + 1);
  return name == "latest" || name == "latest_checkpointed_iteration.txt" || name == ".metadata" ||
         name == "model.safetensors.index.json" || name == "pytorch_model.bin.index.json" ||
         (name.size() > 9 && name.compare(name.size() - 9, 9, ".metadata") == 0);
}

// Re-indexes the source in the background after saves into the mount and swaps the mount's
// views to the new generation (Filesystem::Swap); the views of an incomplete checkpoint never
// replace complete ones (a failed build keeps the served generation, logged once per reason).
// Once a checkpoint is served, a new generation replaces it only after a completion marker
// changed: a save over it writes its shards first, and an index of the old marker (DCP's
// .metadata) over a mix of new and old shards is valid-looking and wrong.
// One generation of the views, and the snapshot they read (null: no checkpoint yet).
struct Generation {
  std::shared_ptr<fs::Tree> tree;
  fs::NamespaceInfo info;
  std::shared_ptr<const index::Snapshot> snapshot;
};

// The snapshot whose views the root serves. Before a save renames a file over one of its source
// files, that file is opened (index::OpenSourceFile), so the served views, and readers who keep
// them, read the bytes indexed even after the next generation replaces them.
class ServedSnapshot {
 public:
  void Set(std::shared_ptr<const index::Snapshot> s) {
    std::lock_guard lock(mu_);
    snapshot_ = std::move(s);
  }
  void BeforeReplace(const std::string& rel) {
    std::shared_ptr<const index::Snapshot> s;
    {
      std::lock_guard lock(mu_);
      s = snapshot_;
    }
    if (s) index::OpenSourceFile(*s, rel);
  }

 private:
  std::mutex mu_;
  std::shared_ptr<const index::Snapshot> snapshot_;  // guarded by mu_
};

class Reindexer {
 public:
  using Build = std::function<Result<Generation>(uint64_t generation)>;
  Reindexer(Build build, bool serving_checkpoint, std::shared_ptr<ServedSnapshot> served)
      : build_(std::move(build)), serving_checkpoint_(serving_checkpoint), served_(std::move(served)),
        thread_([this] { Loop(); }) {}
  ~Reindexer() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Attach(fs::Filesystem* filesystem) {
    std::lock_guard lock(mu_);
    fs_ = filesystem;
  }
  void Detach() { Attach(nullptr); }
  // A file became durable (or was renamed or removed) at `rel` beneath the source.
  void Changed(const std::string& rel) {
    {
      std::lock_guard lock(mu_);
      dirty_ = true;
      const bool marker = IsCompletionMarker(rel);
      urgent_ = urgent_ || marker;
      marker_changed_ = marker_changed_ || marker;
      last_change_ = std::chrono::steady_clock::now();
    }
    cv_.notify_all();
  }

 private:
  void Loop() {
    std::unique_lock lock(mu_);
    uint64_t generation = 1;
    std::string last_error;
    for (;;) {
      cv_.wait(lock, [&] { return stopping_ || dirty_; });
      if (stopping_) return;
      // Quiet for 200 ms, or a completion marker.
      while (!stopping_ && !urgent_ && std::chrono::steady_clock::now() - last_change_ < std::chrono::milliseconds(200)) {
        cv_.wait_for(lock, std::chrono::milliseconds(50));
      }
      if (stopping_) return;
      dirty_ = false;
      urgent_ = false;
      // Only a marker changed before the build started counts for what it reads.
      const bool marker = marker_changed_;
      marker_changed_ = false;
      lock.unlock();
      const auto t0 = std::chrono::steady_clock::now();
      auto built = build_(generation + 1);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      lock.lock();
      if (!built.ok()) {
        marker_changed_ = marker_changed_ || marker;  // still to be served once complete
        if (built.error().message() != last_error) {
          std::cerr << "ucpfs: views not updated (the source is not a complete checkpoint yet?): "
                    << built.error().ToString() << std::endl;
          last_error = built.error().message();
        }
        continue;
      }
      last_error.clear();
      if (fs_ == nullptr) {
        marker_changed_ = marker_changed_ || marker;
        continue;
      }
      if (serving_checkpoint_ && !marker) continue;  // shards of a save not finished yet
      auto& [tree, info, snapshot] = *built;
      const Status swapped = fs_->Swap(std::move(tree), info.target_dir, info.resolve_target, info.list_target);
      if (!swapped.ok()) {
        std::cerr << "ucpfs: views not updated: " << swapped.ToString() << std::endl;
        continue;
      }
      ++generation;
      serving_checkpoint_ = true;
      served_->Set(std::move(snapshot));
      std::cerr << "ucpfs: generation " << generation << ": views of " << info.source_dir << " rebuilt in "
                << seconds << " s (" << info.n_atomic_files << " atomic files)" << std::endl;
    }
  }

  Build build_;
  std::mutex mu_;
  std::condition_variable cv_;
  fs::Filesystem* fs_ = nullptr;  // guarded by mu_; set while the mount serves
  bool dirty_ = false, urgent_ = false, stopping_ = false;
  bool marker_changed_ = false;  // a completion marker changed since the last build started
  bool serving_checkpoint_;      // the served generation holds a checkpoint (not only .ucpfs/)
  const std::shared_ptr<ServedSnapshot> served_;
  std::chrono::steady_clock::time_point last_change_;
  std::thread thread_;  // last: started once the members above exist
};

// Builds the namespace and serves it; reports failure through `ready_fd` as text when >= 0.
int ServeMount(const MountArgs& args, int ready_fd) {
  auto report = [&](const char* what, const Status& s) {
    std::string msg = std::string("ucpfs mount: ") + what + ": " + s.ToString() + "\n";
    if (ready_fd >= 0) {
      ssize_t n = ::write(ready_fd, msg.data(), msg.size());
      (void)n;
      ::close(ready_fd);
    } else {
      std::cerr << msg;
    }
    return 1;
  };
  auto snapshot_options = SnapshotOptionsOf(args.source, /*progress=*/ready_fd < 0);
  if (!snapshot_options.ok()) return report("source", snapshot_options.error());
  auto targets = ParseTargetOptions(args);
  if (!targets.ok()) return report("options", targets.error());
  auto read_ahead = ParseReadAhead(args.readahead, args.prefetch);
  if (!read_ahead.ok()) return report("options", read_ahead.error());
  const std::string source_dir = snapshot_options->source_dir;

  // The write capture first: its recovery finishes what a killed daemon left before indexing.
  std::shared_ptr<io::WriteCapture> capture;
  std::shared_ptr<Reindexer> reindexer;
  std::weak_ptr<Reindexer> weak_reindexer;
  // Where durable files are reported (the reindexer, once it exists); guarded: the committer
  // thread calls it.
  struct ChangeSink {
    std::mutex mu;
    std::function<void(const std::string&)> to;
    void operator()(const std::string& rel) {
      std::lock_guard lock(mu);
      if (to) to(rel);
    }
    void Set(std::function<void(const std::string&)> f) {
      std::lock_guard lock(mu);
      to = std::move(f);
    }
  };
  auto changed = std::make_shared<ChangeSink>();
  auto served = std::make_shared<ServedSnapshot>();
  auto mount_report = std::make_shared<fs::MountReport>();
  // --read-only-index writes nothing into SRC or the index (a shared, prebuilt index: saves
  // could never be indexed either): the mount is read-only, with no write capture.
  bool read_only = args.read_only || args.source.read_only_index;
  if (!read_only) {
    io::PinnedCacheOptions co;
    auto size = io::ParseByteSize(args.cache_size);
    if (!size.ok()) return report("--cache-size", size.error());
    const uint64_t physical = static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    if (*size < 2 * co.chunk_bytes || *size > physical) {
      return report("--cache-size", InvalidArgumentError("the cache must hold at least 2 chunks of " +
                                                          std::to_string(co.chunk_bytes >> 20) + " MiB and fit in " +
                                                          std::to_string(physical >> 20) + " MiB of memory, not " +
                                                          args.cache_size));
    }
    co.capacity_bytes = *size;
    co.lock_on_first_use = true;  // no second-long populate of the whole cache before a save
    co.warn = [](const std::string& line) { std::cerr << "ucpfs: warning: " << line << std::endl; };
    io::WriteCaptureOptions wo;
    wo.source_dir = source_dir;
    wo.cache_options = co;  // made when the first file is saved: a mount only read pins no memory
    wo.write_stall_timeout_ms = args.write_stall_timeout_s * 1000;
    wo.log = [mount_report](const std::string& line) {
      std::cerr << line << std::endl;
      // Everything the capture logs is a failure (flush, journal) or a file recovery discarded,
      // but for the note that a recovery finished a file.
      if (line.find("capture recovery: finished") == std::string::npos) {
        mount_report->RecordError(line.starts_with("ucpfs: ") ? line.substr(7) : line);
      }
    };
    wo.on_durable = [changed](const std::string& rel) { (*changed)(rel); };
    wo.before_replace = [served](const std::string& rel) { served->BeforeReplace(rel); };
    const int src_fd = ::open(source_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (src_fd < 0) return report("source", IoError("open " + source_dir, errno));
    wo.source_dirfd = src_fd;
    auto started = io::WriteCapture::Start(std::move(wo));
    const int err = started.ok() ? 0 : started.error().sys_errno();
    if (!started.ok() && (err == EROFS || err == EACCES || err == EPERM)) {
      // A source we may not write (a shared, read-only checkpoint): served read-only.
      std::cerr << "ucpfs mount: warning: " << started.error().ToString() << ": the source is not writable, "
                << "so the mount is read-only (no write capture)" << std::endl;
      read_only = true;
      ::close(src_fd);
    } else if (!started.ok()) {
      return report("write capture", started.error());
    } else {
      capture = std::shared_ptr<io::WriteCapture>(std::move(*started));
    }
  }
  fs::MountHooks hooks;
  hooks.report = mount_report;
  // Who serves the mount: after a plain umount(8) it drains the write cache, then exits.
  hooks.status_extra["daemon_pid"] = static_cast<int64_t>(::getpid());
  if (capture) {
    hooks.sync = [capture] { return capture->Sync(); };
    hooks.capture_stats = [capture] {
      const io::CaptureStats s = capture->Stats();
      nlohmann::ordered_json j;
      j["cache_bytes"] = s.cache_capacity_bytes;
      j["cache_used_bytes"] = s.cache_used_bytes;
      j["cache_free_bytes"] = s.cache_capacity_bytes - std::min(s.cache_used_bytes, s.cache_capacity_bytes);
      j["dirty_bytes"] = s.dirty_bytes;
      j["bytes_captured"] = s.bytes_captured;
      j["bytes_flushed"] = s.bytes_flushed;
      j["flush_busy_seconds"] = static_cast<double>(s.flush_busy_ns) / 1e9;
      j["flush_bytes_per_second"] =
          s.flush_busy_ns == 0 ? 0.0 : static_cast<double>(s.bytes_flushed) / (static_cast<double>(s.flush_busy_ns) / 1e9);
      j["writers_blocked_seconds"] = static_cast<double>(s.writers_blocked_ns) / 1e9;
      j["files_pending"] = s.files_pending;
      j["files_committed"] = s.files_committed;
      j["flush_errors"] = s.flush_errors;
      j["chunks_coalesced"] = s.chunks_coalesced;
      j["memory"] = s.memory_kind;
      j["engine"] = s.engine;
      j["state_dir"] = s.state_dir;
      nlohmann::ordered_json unplaced = nlohmann::ordered_json::array();
      for (const io::UnplacedFile& u : s.unplaced) {
        unplaced.push_back({{"path", u.path}, {"reason", u.reason}, {"kept_in", u.kept_in}});
      }
      j["unplaced"] = std::move(unplaced);
      return j;
    };
  }
  // One generation of the views: the checkpoint in SRC now, or, while it holds none, `.ucpfs/`.
  const views::ViewOptions target_options = *targets;
  const index::SnapshotOptions so = *snapshot_options;
  auto build = [so, target_options, hooks](uint64_t generation, bool allow_empty)
      -> Result<Generation> {
    fs::NamespaceInfo info;
    index::SnapshotOptions o = so;
    if (generation > 1) o.progress = nullptr;
    Result<std::shared_ptr<const index::Snapshot>> snapshot = index::OpenSnapshot(o, generation);
    if (!snapshot.ok() && snapshot.error().code() == StatusCode::kNotFound) {
      // Not a checkpoint itself: a run directory holding several (index/run_dir.h)?
      UCPFS_ASSIGN_OR_RETURN(const index::RunCheckpoints found, index::FindRunCheckpoints(o.source_dir));
      std::vector<views::NamedSnapshot> run;
      nlohmann::ordered_json listed = nlohmann::ordered_json::array();
      for (const auto& c : found.checkpoints) {
        index::SnapshotOptions sub = o;
        sub.source_dir = o.source_dir + "/" + c.name;
        if (!o.index_dir.empty()) sub.index_dir = o.index_dir + "/" + c.name;
        auto opened = index::OpenSnapshot(sub, generation);
        nlohmann::ordered_json entry = {{"name", c.name}, {"marker", c.marker}};
        if (opened.ok()) {
          run.push_back({c.name, std::move(*opened)});
        } else {
          entry["error"] = opened.error().ToString();  // still being saved, or not readable
        }
        listed.push_back(std::move(entry));
      }
      if (!run.empty()) {
        fs::MountHooks run_hooks = hooks;
        run_hooks.status_extra["run"] = {{"newest", run.back().name}, {"checkpoints", listed},
                                         {"left_out", found.n_left_out}};
        UCPFS_ASSIGN_OR_RETURN(auto tree, views::BuildRunNamespace(run, target_options, run_hooks, &info));
        info.index_state = index::IndexStateName(run.back().snapshot->opened.state);
        info.index_seconds = run.back().snapshot->opened.elapsed_s;
        // The newest is the served snapshot whose files a save replacing them keeps open.
        return Generation{std::move(tree), std::move(info), run.back().snapshot};
      }
      if (!allow_empty) return snapshot.error();
      UCPFS_ASSIGN_OR_RETURN(auto tree, fs::BuildEmptyNamespace(o.source_dir, snapshot.error().message(), generation,
                                                                hooks, &info));
      return Generation{std::move(tree), std::move(info), nullptr};
    }
    if (!snapshot.ok()) return snapshot.error();
    UCPFS_ASSIGN_OR_RETURN(auto tree, views::BuildNamespace(*snapshot, target_options, hooks, &info));
    info.index_state = index::IndexStateName((*snapshot)->opened.state);
    info.index_seconds = (*snapshot)->opened.elapsed_s;
    return Generation{std::move(tree), std::move(info), *snapshot};
  };
  // A source with no checkpoint yet mounts empty (its views appear when one is saved), but not
  // with --read-only-index: there "no index" means the shared index is missing, which must fail
  // the mount as a stale one does (nothing could ever index a later save either).
  auto first = build(1, /*allow_empty=*/!so.read_only_index);
  if (!first.ok()) return report("index", first.error());
  auto& [tree, info, first_snapshot] = *first;
  if (capture) {
    served->Set(first_snapshot);
    const bool has_checkpoint = info.n_atomic_files != 0 || info.target_dir != 0;
    reindexer = std::make_shared<Reindexer>([build](uint64_t generation) { return build(generation, false); },
                                            has_checkpoint, served);
    changed->Set([r = reindexer.get()](const std::string& rel) { r->Changed(rel); });
  }
  fs::MountOptions mo;
  mo.mountpoint = args.mountpoint;
  mo.fuse_options = args.fuse_options;
  // The source as the mount's "device" (findmnt, df), as sshfs and squashfuse show theirs, so
  // `mount -a` finds an fstab line already mounted; an fsname= option overrides it.
  mo.fsname = source_dir;
  mo.ready_fd = ready_fd;
  mo.report = mount_report;
  mo.readahead_bytes = read_ahead->kernel_n_bytes;
  mo.source_read_ahead_bytes = read_ahead->prefetch_n_bytes;
  // target/<layout>/ for layouts not given with --layout: built on first lookup.
  mo.dynamic_dir = info.target_dir;
  mo.resolve = info.resolve_target;
  mo.list = info.list_target;
  auto passthrough = fs::Passthrough::Make(source_dir, capture);
  if (!passthrough.ok()) return report("source", passthrough.error());
  if (reindexer) (*passthrough)->SetChanged([r = reindexer.get()](const std::string& rel) { r->Changed(rel); });
  mo.passthrough = std::shared_ptr<fs::Passthrough>(std::move(*passthrough));
  if (read_only) mo.fuse_options.push_back("ro");
  mo.started = [reindexer](fs::Filesystem* filesystem) {
    if (reindexer) reindexer->Attach(filesystem);
  };
  if (info.n_atomic_files == 0 && info.target_dir == 0) {
    std::cerr << "ucpfs mount: serving " << source_dir << " at " << args.mountpoint
              << " (no checkpoint yet: views appear when one is saved)" << std::endl;
  } else {
    std::cerr << "ucpfs mount: serving " << info.source_dir << " at " << args.mountpoint << " ("
              << info.n_atomic_files << " atomic files, " << info.n_target_files << " target files, index "
              << info.index_state << " in " << info.index_seconds << " s)" << std::endl;
  }
  Status s = fs::ServeTree(std::move(tree), mo);
  // Unmounted (umount(8), `ucpfs umount`, or SIGTERM/SIGINT/SIGHUP). What is still in the write
  // cache is made durable below; a stop signal now (systemd sends SIGTERM to a mount unit's
  // processes right after its umount) must not cut that short: only SIGKILL does.
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) ::signal(sig, SIG_IGN);
  if (reindexer) reindexer->Detach();
  changed->Set(nullptr);
  reindexer.reset();
  mo.passthrough.reset();
  capture.reset();  // drains: everything captured is made durable before the daemon exits
  if (!s.ok()) return report("serve", s);
  return 0;
}

}  // namespace

int RunMount(const MountArgs& mount_args) {
  // The daemon changes to "/": make every path absolute first.
  MountArgs args = mount_args;
  args.source.src = AbsPath(args.source.src);
  args.mountpoint = AbsPathOrJoined(args.mountpoint);
  if (!args.source.index_dir.empty()) args.source.index_dir = AbsPath(args.source.index_dir);
  if (!args.source.rules.empty()) args.source.rules = AbsPath(args.source.rules);
  if (!args.pattern_rules.empty()) args.pattern_rules = AbsPath(args.pattern_rules);
  if (auto t = ParseTargetOptions(args); !t.ok()) return Fail("mount", t.error());
  if (auto r = ParseReadAhead(args.readahead, args.prefetch); !r.ok()) return Fail("mount", r.error());
  if (!args.log_file.empty() && args.log_file[0] != '/') {
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof(cwd)) != nullptr) args.log_file = std::string(cwd) + "/" + args.log_file;
  }
  // A dead ucpfs mount at MNT (its daemon gone) is cleared; a live one, or another
  // filesystem, is refused with how to clear it. Then MNT must be a directory, outside SRC.
  if (Status ready = fs::PrepareMountPoint(args.mountpoint); !ready.ok()) return Fail("mount", ready);
  args.mountpoint = AbsPath(args.mountpoint);  // resolvable now that a dead mount is gone
  struct stat st;
  if (::stat(args.mountpoint.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    std::cerr << "ucpfs mount: " << args.mountpoint << ": mount point is not a directory\n";
    return 1;
  }
  if (Status apart = fs::CheckMountPointAgainstSource(args.source.src, args.mountpoint); !apart.ok()) {
    return Fail("mount", apart);
  }
  if (args.foreground) return ServeMount(args, -1);

  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    std::cerr << "ucpfs mount: pipe: " << std::strerror(errno) << '\n';
    return 1;
  }
  pid_t pid = ::fork();
  if (pid < 0) {
    std::cerr << "ucpfs mount: fork: " << std::strerror(errno) << '\n';
    return 1;
  }
  if (pid == 0) {
    // Daemon: own session, no terminal; stderr to the log file.
    ::close(fds[0]);
    ::setsid();
    if (::chdir("/") != 0) _exit(1);
    int devnull = ::open("/dev/null", O_RDWR);
    if (devnull >= 0) {
      ::dup2(devnull, 0);
      ::dup2(devnull, 1);
    }
    std::string log = args.log_file.empty() ? "/dev/null" : args.log_file;
    int logfd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    ::dup2(logfd >= 0 ? logfd : devnull, 2);
    // Whatever else the caller left open without O_CLOEXEC (a pipe a script waits on, a file
    // it holds) is not the daemon's to keep alive for the mount's life: only 0-2 and the
    // readiness pipe stay.
    const auto ready = static_cast<unsigned>(fds[1]);
    if (ready > 3) ::close_range(3, ready - 1, 0);
    ::close_range(ready + 1, ~0u, 0);
    _exit(ServeMount(args, fds[1]));
  }
  ::close(fds[1]);
  // The daemon writes one byte when the mount is live, or an error text (one write, shorter
  // than PIPE_BUF, so it arrives whole) and exits.
  std::string got;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fds[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
    if (got.size() == 1) break;
  }
  ::close(fds[0]);
  if (got.size() == 1) return 0;
  int wstatus = 0;
  ::waitpid(pid, &wstatus, 0);
  if (got.empty()) got = "ucpfs mount: the daemon exited before the mount was ready\n";
  std::cerr << got;
  return 1;
}

}  // namespace ucpfs::cli
