#include "mount/daemon.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>

#include <nlohmann/json.hpp>

#include "core/io/bucket_uploader.h"
#include "core/io/pinned_cache.h"
#include "core/io/s3_readahead.h"
#include "core/io/s3_tree.h"
#include "core/io/write_capture.h"
#include "fs/bucket_files.h"
#include "fs/errno_map.h"
#include "fs/filesystem.h"
#include "fs/fuse_mount.h"
#include "fs/materialize.h"
#include "fs/namespace.h"
#include "fs/passthrough.h"
#include "index/catalog.h"
#include "index/run_dir.h"
#include "mount/reindexer.h"
#include "views/mount_views.h"

namespace ucpfs::mount {

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

namespace {

// What `ucpfs sync` waits for before the capture's Sync (fs::Passthrough::WaitClosesReleased),
// set once the passthrough is made, and what its waits gave up on.
class CloseWaits {
 public:
  void Set(const std::shared_ptr<fs::Passthrough>& p) {
    std::lock_guard lock(mu_);
    passthrough_ = p;
  }
  void Wait(std::chrono::milliseconds max) {
    std::shared_ptr<fs::Passthrough> p;
    {
      std::lock_guard lock(mu_);
      p = passthrough_.lock();
    }
    if (p == nullptr) return;
    std::vector<std::string> left = p->WaitClosesReleased(max);
    if (left.empty()) return;
    std::lock_guard lock(mu_);
    ++timeouts_;
    if (left.size() > 16) left.resize(16);
    not_released_ = std::move(left);
  }
  // How many syncs gave up waiting, and the files the last one named.
  std::pair<uint64_t, std::vector<std::string>> Stats() const {
    std::lock_guard lock(mu_);
    return {timeouts_, not_released_};
  }

 private:
  mutable std::mutex mu_;
  std::weak_ptr<fs::Passthrough> passthrough_;
  uint64_t timeouts_ = 0;
  std::vector<std::string> not_released_;
};

// The default readahead follows the source disk's window between the FUSE request size (1 MiB,
// fs/fuse_mount.cc's default max_read: the window it has anyway) and 64 MiB.
constexpr uint64_t kRequestBytes = uint64_t{1} << 20;
constexpr uint64_t kMaxDefaultReadAheadBytes = uint64_t{64} << 20;

// The readahead window of the block device holding `dir` (its queue's read_ahead_kb, a
// partition's disk's), or of its filesystem's bdi (NFS, FUSE); 0 when unknown. What a reader
// of the source's files straight from disk gets ahead of it.
uint64_t SourceReadAheadBytes(const std::string& dir) {
  struct stat st = {};
  if (::stat(dir.c_str(), &st) != 0) return 0;
  const std::string dev = std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev));
  for (const std::string& path : {"/sys/dev/block/" + dev + "/queue/read_ahead_kb",
                                  "/sys/dev/block/" + dev + "/../queue/read_ahead_kb",
                                  "/sys/class/bdi/" + dev + "/read_ahead_kb"}) {
    FILE* f = std::fopen(path.c_str(), "r");
    if (f == nullptr) continue;
    unsigned long kb = 0;
    const bool read = std::fscanf(f, "%lu", &kb) == 1;
    std::fclose(f);
    if (read) return static_cast<uint64_t>(kb) << 10;
  }
  return 0;
}

}  // namespace

// Builds the namespace and serves it; reports failure through `ready_fd` as text when >= 0.
int ServeMount(const DaemonOptions& args, int ready_fd) {
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
  auto read_ahead = ParseReadAhead(args.readahead, args.prefetch);
  if (!read_ahead.ok()) return report("options", read_ahead.error());
  const std::string source_dir = args.snapshot.source_dir;
  // A bucket prefix (s3://BUCKET/PREFIX, read through an S3Tree): the views read the bucket.
  // Read-only, only the views are served. Else the read-write area is the local staging
  // directory (args.stage_dir), captured as a local SRC is, and every file made durable there is
  // uploaded to the bucket in close order (the BucketUploader); the views are indexed again from
  // the bucket once uploads land.
  const bool object_store = source_dir.starts_with("s3://");
  const bool staged = object_store && !args.stage_dir.empty() && !args.read_only && !args.snapshot.read_only_index;
  // What write capture and the passthrough serve: SRC, or the staging directory.
  const std::string write_dir = staged ? args.stage_dir : source_dir;

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
  bool read_only = args.read_only || args.snapshot.read_only_index || (object_store && !staged);
  std::shared_ptr<io::BucketUploader> uploader;
  std::shared_ptr<fs::BucketFiles> bucket_files;
  if (staged) {
    auto s3_tree = std::dynamic_pointer_cast<const S3Tree>(args.snapshot.tree);
    if (!s3_tree) return report("stage", InvalidArgumentError(source_dir + ": no S3 tree"));
    // The staging directory and its state directory: the mounting user's, 0700, never a symlink.
    // The staging directory is MNT's read-write root, whose mode the mount shows (as a local
    // SRC's): with -o allow_other (or allow_root) it is made readable and searchable by all
    // (0755; its files keep their own modes), else no other user could reach even the views.
    const bool shared = std::any_of(args.fuse_options.begin(), args.fuse_options.end(),
                                    [](const std::string& o) { return o == "allow_other" || o == "allow_root"; });
    for (const std::string& dir : {args.stage_dir, args.stage_dir + "/.ucpfs"}) {
      if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return report("--stage-dir", IoError("mkdir " + dir, errno));
      struct stat st = {};
      if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) {
        return report("--stage-dir", InvalidArgumentError(dir + " is not a directory (not a symbolic link) owned by this user"));
      }
      if (shared && dir == args.stage_dir && (st.st_mode & 0055) != 0055 &&
          ::chmod(dir.c_str(), (st.st_mode & 07777) | 0055) != 0) {
        return report("--stage-dir", IoError("chmod " + dir + " (for -o allow_other)", errno));
      }
    }
    io::BucketUploaderOptions uo;
    uo.client = s3_tree->client();
    uo.bucket = s3_tree->bucket();
    uo.prefix = s3_tree->prefix();
    uo.stage_dir = args.stage_dir;
    uo.state_dir = args.stage_dir + "/.ucpfs/upload";
    uo.keep_ms = args.stage_keep_s * 1000;
    // UCPFS_UPLOAD_STREAM=off: every part goes at the file's turn (to measure what streaming saves).
    if (const char* v = std::getenv("UCPFS_UPLOAD_STREAM"); v != nullptr && std::string(v) == "off") {
      uo.stream_parts = false;
    }
    uo.log = [mount_report](const std::string& line) {
      std::cerr << line << std::endl;
      if (line.find(" failed: ") != std::string::npos || line.find("journal") != std::string::npos) {
        mount_report->RecordError(line.starts_with("ucpfs: ") ? line.substr(7) : line);
      }
    };
    // The read-write area shows the bucket's objects beside the staged files (fs/bucket_files.h).
    bucket_files = std::make_shared<fs::BucketFiles>(s3_tree);
    // Once an object is in the bucket (or deleted), the views are indexed again from it and the
    // read-write area lists its directory again.
    uo.on_uploaded = [changed, bucket_files](const std::string& rel) {
      bucket_files->Landed(rel);
      (*changed)(rel);
    };
    auto started = io::BucketUploader::Start(std::move(uo));
    if (!started.ok()) return report("upload", started.error());
    uploader = std::shared_ptr<io::BucketUploader>(std::move(*started));
  }
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
    wo.source_dir = write_dir;
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
    if (uploader) {
      // Queued (durably) before the file shows under its name in the staging directory; the
      // views change when the upload lands (on_uploaded), not now.
      wo.before_settled = [uploader](const std::string& rel, const struct stat& st) { return uploader->Queue(rel, st); };
      // Full parts go to the bucket while the file is written; its close sends the rest.
      wo.on_part_change = [uploader](const io::PartChange& change) { uploader->PartChanged(change); };
    } else {
      wo.on_durable = [changed](const std::string& rel) { (*changed)(rel); };
      wo.before_replace = [served](const std::string& rel) { served->BeforeReplace(rel); };
    }
    const int src_fd = ::open(write_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (src_fd < 0) return report("source", IoError("open " + write_dir, errno));
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
  if (auto s3_tree = std::dynamic_pointer_cast<const S3Tree>(args.snapshot.tree)) {
    hooks.s3_stats = [client = s3_tree->client(), uploader] {
      const s3::CounterValues c = client->counters();
      const s3::ObjectBytes by_object = client->ObjectBytesGet();
      nlohmann::ordered_json objects = nlohmann::ordered_json::object();
      for (const auto& [name, n_bytes] : by_object.by_object) objects[name] = n_bytes;
      nlohmann::ordered_json j{{"requests", c.requests}, {"retries", c.retries}, {"failures", c.failures},
                               {"bytes_get", c.bytes_get}, {"bytes_put", c.bytes_put}, {"connects", c.connects},
                               {"object_bytes_get", std::move(objects)},
                               {"object_bytes_get_uncounted", by_object.uncounted}};
      const s3::ReadAheadStats ra = s3::S3ReadAhead::Stats();
      j["read_ahead"] = {{"held_bytes", ra.held_bytes},           {"peak_held_bytes", ra.peak_held_bytes},
                         {"max_held_bytes", s3::kMaxHeldBytesTotal}, {"pooled_bytes", ra.pooled_bytes},
                         {"blocks_fetched", ra.blocks_fetched},   {"bytes_served", ra.bytes_served},
                         {"hint_bytes_dropped", ra.hint_bytes_dropped}};
      if (uploader) {
        const io::UploaderStats u = uploader->Stats();
        j["upload"] = {{"queued_files", u.queued_files}, {"queued_bytes", u.queued_bytes},
                       {"uploaded_files", u.uploaded_files}, {"uploaded_bytes", u.uploaded_bytes},
                       {"deleted_objects", u.deleted_objects}, {"skipped", u.skipped}, {"failing", u.failing},
                       {"waiting", u.waiting}, {"staged_bytes", u.staged_bytes},
                       {"removed_files", u.removed_files},
                       {"streamed", {{"files", u.streamed.files}, {"uploads_open", u.streamed.uploads_open},
                                     {"parts_sent", u.streamed.parts_sent}, {"bytes_sent", u.streamed.bytes_sent},
                                     {"parts_taken", u.streamed.parts_taken},
                                     {"parts_stale", u.streamed.parts_stale},
                                     {"uploads_aborted", u.streamed.uploads_aborted}}}};
      }
      return j;
    };
  }
  if (object_store && !staged) {
    hooks.status_extra["object_store"] = {
        {"url", source_dir},
        {"off", {"write capture (the mount is read-only)", "the source's own files (no passthrough)",
                 "reindex on a change of the source (remount after a new save)"}}};
  } else if (staged) {
    hooks.status_extra["object_store"] = {
        {"url", source_dir},
        {"stage_dir", args.stage_dir},
        {"saves", "staged on local disk, uploaded to the bucket in close order"},
        {"off", nlohmann::ordered_json::array()}};
  }
  // Saves into a bucket mount: `ucpfs sync` (and umount) return once they are in the bucket too,
  // or fail naming what is not after 30 s of failures without progress.
  constexpr uint64_t kUploadStuckMs = 30000;
  // close(2) returns before the RELEASE that queues a saved file's commit reaches the daemon: a
  // sync first waits that long at most for the RELEASEs of closes made before it (the files
  // still open through another descriptor after that are named in stats.json, and by sync).
  constexpr std::chrono::milliseconds kCloseReleaseWait{5000};
  const auto closes = std::make_shared<CloseWaits>();
  if (capture) {
    hooks.sync = [capture, uploader, closes, kCloseReleaseWait] {
      closes->Wait(kCloseReleaseWait);
      UCPFS_RETURN_IF_ERROR(capture->Sync());
      return uploader ? uploader->WaitUploaded(kUploadStuckMs, nullptr) : Status::Ok();
    };
    hooks.capture_stats = [capture, closes] {
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
      const auto [timeouts, not_released] = closes->Stats();
      j["sync_release_timeouts"] = timeouts;
      j["sync_not_released"] = not_released;
      return j;
    };
  }
  // One generation of the views: the checkpoint in SRC now, or, while it holds none, `.ucpfs/`.
  const views::ViewOptions target_options = args.views;
  const index::SnapshotOptions so = args.snapshot;
  auto build = [so, target_options, hooks, first_index = args.opened_index](uint64_t generation, bool allow_empty)
      -> Result<Generation> {
    fs::NamespaceInfo info;
    index::SnapshotOptions o = so;
    if (generation > 1) o.progress = nullptr;
    Result<std::shared_ptr<const index::Snapshot>> snapshot =
        generation == 1 && first_index ? index::SnapshotOf(*first_index, o, generation) : index::OpenSnapshot(o, generation);
    if (!snapshot.ok() && snapshot.error().code() == StatusCode::kNotFound) {
      // Not a checkpoint itself: a run directory holding several (index/run_dir.h)?
      const std::shared_ptr<const SourceTree> source = o.tree ? o.tree : LocalTree::Make(o.source_dir);
      Result<index::RunCheckpoints> run_found = index::FindRunCheckpoints(*source);
      // An empty bucket prefix lists as no directory at all: no checkpoint yet.
      if (!run_found.ok() && !(allow_empty && run_found.error().code() == StatusCode::kNotFound)) return run_found.error();
      const index::RunCheckpoints found = run_found.ok() ? *run_found : index::RunCheckpoints{};
      std::vector<views::NamedSnapshot> run;
      nlohmann::ordered_json listed = nlohmann::ordered_json::array();
      for (const auto& c : found.checkpoints) {
        index::SnapshotOptions sub = o;
        sub.source_dir = o.source_dir + "/" + c.name;
        if (!o.index_dir.empty()) sub.index_dir = o.index_dir + "/" + c.name;
        Result<std::shared_ptr<const SourceTree>> sub_tree = source->Subtree(c.name);
        if (sub_tree.ok()) sub.tree = *sub_tree;
        auto opened = sub_tree.ok() ? index::OpenSnapshot(sub, generation)
                                    : Result<std::shared_ptr<const index::Snapshot>>(sub_tree.error());
        nlohmann::ordered_json entry = {{"name", c.name}, {"marker", c.marker}};
        if (opened.ok()) {
          run.push_back({c.name, std::move(*opened)});
        } else {
          entry["error"] = opened.error().ToString();  // still being saved, or not readable
        }
        listed.push_back(std::move(entry));
      }
      if (!run.empty()) {
        const bool incomplete = run.size() < found.checkpoints.size();
        fs::MountHooks run_hooks = hooks;
        run_hooks.status_extra["run"] = {{"newest", run.back().name}, {"checkpoints", listed},
                                         {"left_out", found.n_left_out}};
        UCPFS_ASSIGN_OR_RETURN(auto tree, views::BuildRunNamespace(run, target_options, run_hooks, &info));
        info.index_state = index::IndexStateName(run.back().snapshot->opened.state);
        info.index_seconds = run.back().snapshot->opened.elapsed_s;
        // The newest is the served snapshot whose files a save replacing them keeps open.
        return Generation{std::move(tree), std::move(info), run.back().snapshot, incomplete};
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
  auto& [tree, info, first_snapshot, first_incomplete] = *first;
  if (capture) {
    served->Set(first_snapshot);
    const bool has_checkpoint = info.n_atomic_files != 0 || info.target_dir != 0;
    reindexer = std::make_shared<Reindexer>([build](uint64_t generation) { return build(generation, false); },
                                            has_checkpoint, first_incomplete, served);
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
  mo.spliceable_sources = !object_store;
  if (args.readahead.empty() && !object_store) {
    // No --readahead: the source disk's own window when it is larger than the request size, so
    // a view read cold is read ahead as far as the source's files would be. mmap readers
    // (safetensors, from_pretrained) fault page by page and get only this window in flight:
    // with 1 MiB against the disk's 8 MiB, from_pretrained(MNT/hf) cold was 1.3-1.6x the disk
    // copy's time, with 8 MiB 0.9-1.3x (docs/benchmarks.md).
    const uint64_t disk = std::min<uint64_t>(SourceReadAheadBytes(source_dir), kMaxDefaultReadAheadBytes);
    if (disk > kRequestBytes) mo.readahead_bytes = static_cast<uint32_t>(disk);
  }
  mo.source_read_ahead_bytes = read_ahead->prefetch_n_bytes;
  // target/<layout>/ for layouts not given with --layout: built on first lookup.
  mo.dynamic_dir = info.target_dir;
  mo.resolve = info.resolve_target;
  mo.list = info.list_target;
  if (!object_store || capture) {
    auto passthrough = fs::Passthrough::Make(write_dir, capture);
    if (!passthrough.ok()) return report("source", passthrough.error());
    // A change in the bucket (a rename or unlink in the staging directory, an unlink of an
    // object), journaled behind the uploads of every file closed before it: write capture queues
    // a file's upload when it makes it durable, so Sync first, and an unlink right after a save
    // never deletes before it lands.
    const auto bucket_change = [weak_capture = std::weak_ptr<io::WriteCapture>(capture),
                                weak = std::weak_ptr<io::BucketUploader>(uploader)](const std::string& rel) -> Status {
      const std::shared_ptr<io::WriteCapture> c = weak_capture.lock();
      const std::shared_ptr<io::BucketUploader> u = weak.lock();
      if (!c || !u) return fs::PosixError(EROFS, rel + ": the mount is stopping");
      if (Status s = c->Sync(); !s.ok()) return s.WithContext("change of " + u->Url(rel) + ": the saves before it");
      return u->Changed(rel);
    };
    if (uploader) {
      // The new name uploaded, what is gone deleted.
      (*passthrough)->SetChanged([bucket_change](const std::string& rel) {
        if (Status s = bucket_change(rel); !s.ok()) std::cerr << "ucpfs: upload: " << s.ToString() << std::endl;
      });
    } else if (reindexer) {
      (*passthrough)->SetChanged([r = reindexer.get()](const std::string& rel) { r->Changed(rel); });
    }
    mo.passthrough = std::shared_ptr<fs::Passthrough>(std::move(*passthrough));
    if (bucket_files) bucket_files->SetRemove(bucket_change);  // an unlink of an object: a DELETE
    mo.bucket = bucket_files;
    closes->Set(mo.passthrough);
    if (uploader) {
      // Uploaded copies are removed once kept long enough, never one in use through the mount
      // (unset before the passthrough goes, below); the mount then lets go of their inodes.
      uploader->SetInUse([weak = std::weak_ptr<fs::Passthrough>(mo.passthrough)](uint64_t recent_ms) {
        const std::shared_ptr<fs::Passthrough> p = weak.lock();
        return p ? p->InUsePaths(recent_ms) : std::vector<std::string>{};
      });
      uploader->SetRemoved([weak = std::weak_ptr<fs::Passthrough>(mo.passthrough)] {
        if (const std::shared_ptr<fs::Passthrough> p = weak.lock()) p->ReleaseRemoved();
      });
      // An emptied staging directory the kernel still holds stays (a save may create in it next).
      uploader->SetDirInUse([weak = std::weak_ptr<fs::Passthrough>(mo.passthrough)](dev_t dev, ino_t ino) {
        const std::shared_ptr<fs::Passthrough> p = weak.lock();
        return p != nullptr && p->KnowsDirectory(dev, ino);
      });
    }
  }
  mo.kernel_passthrough = !args.no_passthrough;
  if (!args.materialize_dir.empty()) {
    // Checked by RunMount before the daemon started: a size that parses, a directory outside MNT.
    auto max_bytes = io::ParseByteSize(args.materialize_size);
    if (!max_bytes.ok()) return report("materialize", max_bytes.error());
    auto materializer = fs::Materializer::Make(args.materialize_dir, *max_bytes, read_ahead->prefetch_n_bytes);
    if (!materializer.ok()) return report("materialize", materializer.error());
    mo.materialize = std::shared_ptr<fs::Materializer>(std::move(*materializer));
  }
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
  if (uploader) {
    uploader->SetInUse(nullptr);
    uploader->SetRemoved(nullptr);
    uploader->SetDirInUse(nullptr);
  }
  mo.passthrough.reset();
  capture.reset();  // drains: everything captured is made durable before the daemon exits
  int rc = 0;
  if (uploader) {
    // Then in the bucket, in order; what cannot be (30 s of failures without progress) stays
    // staged for the next mount with this staging directory, each file named.
    const Status up = uploader->Stop(kUploadStuckMs, [](const std::string& line) { std::cerr << "ucpfs: " << line << std::endl; });
    if (!up.ok()) {
      std::cerr << "ucpfs mount: not all saves are in the bucket: " << up.ToString() << std::endl;
      rc = 1;
    }
    uploader.reset();
  }
  if (!s.ok()) return report("serve", s);
  return rc;
}

int StartMount(const DaemonOptions& args) {
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

}  // namespace ucpfs::mount
