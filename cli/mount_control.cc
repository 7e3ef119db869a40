// `ucpfs sync`, `ucpfs status`, `ucpfs umount`: the commands that act on a live mount through
// its `.ucpfs/` files (sync, status.json, stats.json), never on its source directly.
#include "cli/mount_control.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "cli/checkpoint_cmds.h"
#include "cli/progress.h"
#include "cli/text.h"
#include "core/json_text.h"
#include "fs/mounts.h"

namespace ucpfs::cli {

namespace {

// Opens MNT/.ucpfs/sync: the daemon answers the open once everything captured before it is
// durable. Errors: kNotFound when MNT is not a writable ucpfs mount; kIo with the errno the
// daemon returned (EIO, ENOSPC) when a flush failed.
Status SyncMount(const std::string& mnt) {
  const std::string path = mnt + "/.ucpfs/sync";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    struct stat st = {};
    if (err == ENOENT && ::stat(path.c_str(), &st) != 0) {
      return NotFoundError(mnt + " is not a writable ucpfs mount (no .ucpfs/sync)");
    }
    return IoError("sync " + mnt + " (see the daemon's log for the file)", err);
  }
  ::close(fd);
  return Status::Ok();
}

std::string ReadText(const std::string& path) {
  std::ifstream f(path);
  std::stringstream text;
  text << f.rdbuf();
  return text.str();
}

// A pidfd of the daemon serving MNT (status.json's daemon_pid), or -1 when it cannot be told:
// an older daemon, another pid namespace, or a pid that is no ucpfs serving MNT.
int DaemonPidfd(const std::string& mnt) {
  const auto status = nlohmann::json::parse(ReadText(mnt + "/.ucpfs/status.json"), nullptr, false);
  if (status.is_discarded() || !status.contains("daemon_pid") || !status["daemon_pid"].is_number_integer()) return -1;
  const long pid = status["daemon_pid"].get<long>();
  if (pid <= 1) return -1;
  const int fd = static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
  if (fd < 0) return -1;
  // The pidfd pins the process: its cmdline, read now, is the daemon's or the pid was reused.
  std::string cmdline = ReadText("/proc/" + std::to_string(pid) + "/cmdline");
  for (char& c : cmdline) {
    if (c == '\0') c = ' ';
  }
  if (cmdline.find("ucpfs") == std::string::npos || cmdline.find(mnt) == std::string::npos) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// The files of MNT whose save was accepted but that are not placed (stats.json's
// capture.unplaced). After a failed sync the daemon is still making the held-back files durable
// in their parts: waits up to 5 s for that. Prints one line per file to stderr, prefixed by
// `who`; returns how many there are, and in *in_memory how many have bytes only in memory.
size_t ReportUnplaced(const std::string& mnt, const std::string& who, size_t* in_memory) {
  nlohmann::json list = nlohmann::json::array();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (;;) {
    const auto stats = nlohmann::json::parse(ReadText(mnt + "/.ucpfs/stats.json"), nullptr, false);
    list = stats.is_object() && stats.contains("capture") ? stats["capture"].value("unplaced", nlohmann::json::array())
                                                          : nlohmann::json::array();
    *in_memory = 0;
    for (const auto& u : list) *in_memory += u.value("kept_in", std::string()).empty() ? 1 : 0;
    if (*in_memory == 0 || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (const auto& u : list) {
    const std::string kept = u.value("kept_in", std::string());
    std::cerr << who << ": not placed: " << u.value("path", std::string("?")) << " (" << u.value("reason", std::string())
              << "; " << (kept.empty() ? std::string("its bytes are only in the daemon's memory") : "kept in " + kept) << ")\n";
  }
  return list.size();
}

// SyncMount(mnt) on a thread, calling `tick` every `period` while it waits; its status.
Status SyncTicking(const std::string& mnt, std::chrono::milliseconds period, const std::function<void()>& tick) {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status s;
  std::thread syncer([&] {
    Status r = SyncMount(mnt);
    std::lock_guard lock(mu);
    s = std::move(r);
    done = true;
    cv.notify_all();
  });
  {
    std::unique_lock lock(mu);
    while (!cv.wait_for(lock, period, [&] { return done; })) {
      lock.unlock();
      tick();
      lock.lock();
    }
  }
  syncer.join();
  return s;
}

// SyncMount(mnt), and while it waits on uploads to a bucket (an s3:// mount's stats.json
// `s3.upload`), a progress line every 2 s; after a failed sync, each object not uploaded named.
// Returns SyncMount's status and how many objects are not uploaded.
Status SyncWithUploads(const std::string& mnt, const std::string& who, size_t* not_uploaded) {
  auto upload = [&mnt] {
    const auto stats = nlohmann::json::parse(ReadText(mnt + "/.ucpfs/stats.json"), nullptr, false);
    if (stats.is_discarded() || !stats.contains("s3") || !stats["s3"].contains("upload")) return nlohmann::json();
    return stats["s3"]["upload"];
  };
  const Status s = SyncTicking(mnt, std::chrono::seconds(2), [&] {
    const nlohmann::json u = upload();
    if (u.is_object() && u.value("queued_files", uint64_t{0}) > 0) {
      std::cerr << who << ": uploading " << u.value("queued_files", uint64_t{0}) << " file(s), "
                << HumanBytes(static_cast<double>(u.value("queued_bytes", uint64_t{0}))) << " to go"
                << (u.value("failing", std::string()).empty() ? "" : " (failing: " + u.value("failing", std::string()) + ")")
                << '\n';
    }
  });
  *not_uploaded = 0;
  if (!s.ok()) {
    const nlohmann::json u = upload();
    if (u.is_object()) {
      for (const auto& w : u.value("waiting", nlohmann::json::array())) {
        std::cerr << who << ": not uploaded: " << w.get<std::string>() << '\n';
        ++*not_uploaded;
      }
    }
  }
  return s;
}

}  // namespace

int RunSync(const SyncArgs& args) {
  const std::string mnt = AbsPathOrJoined(args.mountpoint);
  // The capture counters of MNT/.ucpfs/stats.json: {bytes_flushed, dirty_bytes}; zeros when the
  // mount has no write capture (read-only) or the file cannot be read.
  auto counters = [&mnt]() -> std::pair<uint64_t, uint64_t> {
    const auto stats = nlohmann::json::parse(ReadText(mnt + "/.ucpfs/stats.json"), nullptr, false);
    if (stats.is_discarded() || !stats.contains("capture")) return {0, 0};
    const auto& c = stats["capture"];
    return {c.value("bytes_flushed", uint64_t{0}), c.value("dirty_bytes", uint64_t{0})};
  };
  // The syncs that gave up waiting for a RELEASE (of a file closed, yet open through another
  // descriptor), and the files the last one named.
  auto release_timeouts = [&mnt](std::vector<std::string>* named) -> uint64_t {
    const auto stats = nlohmann::json::parse(ReadText(mnt + "/.ucpfs/stats.json"), nullptr, false);
    if (stats.is_discarded() || !stats.contains("capture")) return 0;
    const auto& c = stats["capture"];
    if (named != nullptr && c.contains("sync_not_released") && c["sync_not_released"].is_array()) {
      for (const auto& p : c["sync_not_released"]) {
        if (p.is_string()) named->push_back(p.get<std::string>());
      }
    }
    return c.value("sync_release_timeouts", uint64_t{0});
  };
  const uint64_t timeouts0 = release_timeouts(nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  const auto [flushed0, dirty0] = counters();
  // The open of MNT/.ucpfs/sync blocks until everything is durable; meanwhile the counters are
  // shown: bytes flushed since the call, of those plus the bytes still dirty.
  Progress progress(StderrProgressOptions("ucpfs sync:", ProgressUnit::kBytes, args.quiet));
  uint64_t flushed = 0, dirty = dirty0;
  auto draw = [&](bool final) {
    const auto [f, d] = counters();
    flushed = f >= flushed0 ? f - flushed0 : 0;
    dirty = d;
    const std::string note = "flushed, " + HumanBytes(static_cast<double>(d)) + " still dirty";
    if (final) {
      progress.Finish(flushed, flushed + dirty, note);
    } else {
      progress.Update(flushed, flushed + dirty, note);
    }
  };
  const Status s = SyncTicking(mnt, std::chrono::milliseconds(100), [&] { draw(false); });
  if (!s.ok()) {
    size_t in_memory = 0;
    ReportUnplaced(mnt, "ucpfs sync", &in_memory);
    return Fail("sync", s);
  }
  // Only a sync that had to wait draws its final line; the counters are read once more for it
  // and for --json.
  draw(/*final=*/std::chrono::steady_clock::now() - t0 >= Progress::kTtyDelay);
  std::vector<std::string> not_released;
  if (release_timeouts(&not_released) > timeouts0) {
    std::cerr << "ucpfs sync: not waited for: closed before the sync but still open through another descriptor "
                 "(a dup or a fork) after 5 s, so not saved yet:";
    for (const std::string& p : not_released) std::cerr << ' ' << p;
    std::cerr << '\n';
  } else {
    not_released.clear();
  }
  if (args.json) {
    nlohmann::ordered_json out;
    out["mount"] = mnt;
    out["bytes_flushed"] = flushed;
    out["dirty_bytes"] = dirty;
    out["not_released"] = not_released;
    out["seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::cout << JsonText(out) << '\n';
  }
  return 0;
}

int RunStatus(const std::string& mountpoint, bool json) {
  const std::string mnt = AbsPathOrJoined(mountpoint);
  const std::string status_text = ReadText(mnt + "/.ucpfs/status.json");
  const std::string stats_text = ReadText(mnt + "/.ucpfs/stats.json");
  const auto status = nlohmann::json::parse(status_text, nullptr, false);
  const auto stats = nlohmann::json::parse(stats_text, nullptr, false);
  if (status.is_discarded() || stats.is_discarded()) {
    return Fail("status", NotFoundError(mnt + " is not a ucpfs mount (no readable .ucpfs/status.json)"));
  }
  if (json) {
    std::cout << JsonText(nlohmann::ordered_json{{"status", status}, {"stats", stats}}) << '\n';
    return 0;
  }
  auto mib = [](const nlohmann::json& v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.1f MiB", v.is_number() ? v.get<double>() / (1 << 20) : 0.0);
    return std::string(buf);
  };
  auto num = [](const nlohmann::json& j, const char* key) {
    return j.is_object() && j.contains(key) && j[key].is_number() ? j[key].get<uint64_t>() : uint64_t{0};
  };
  std::cout << "mount:       " << mnt << '\n' << "source:      " << status.value("source", "?") << '\n';
  if (status.contains("no_checkpoint")) {
    std::cout << "checkpoint:  none yet (" << status["no_checkpoint"].get<std::string>() << ")\n";
  } else {
    std::cout << "checkpoint:  " << status.value("format", "?") << " (" << status.value("flavor", "") << "), "
              << num(status["counts"], "params") << " parameters\n";
  }
  if (status.contains("run") && status["run"].is_object()) {
    const auto& run = status["run"];
    std::cout << "checkpoints: newest " << run.value("newest", "?") << " (served at the root)\n";
    for (const auto& c : run.value("checkpoints", nlohmann::json::array())) {
      std::cout << "  " << c.value("name", "?") << ": "
                << (c.contains("error") ? "not served: " + c["error"].get<std::string>() : std::string("served"))
                << '\n';
    }
    if (num(run, "left_out") > 0) std::cout << "  (" << num(run, "left_out") << " more left out)\n";
  }
  if (stats.contains("s3") && stats["s3"].contains("upload")) {
    // A writable s3:// mount: its saves, staged and uploaded in close order.
    const auto& u = stats["s3"]["upload"];
    std::cout << "uploads:     " << num(u, "queued_files") << " queued ("
              << mib(u.value("queued_bytes", uint64_t{0})) << "), " << num(u, "uploaded_files") << " uploaded ("
              << mib(u.value("uploaded_bytes", uint64_t{0})) << "), " << mib(u.value("staged_bytes", uint64_t{0}))
              << " staged in " << status.value("object_store", nlohmann::json::object()).value("stage_dir", "?")
              << " (" << num(u, "removed_files") << " uploaded copies removed)\n";
    if (!u.value("failing", std::string()).empty()) std::cout << "  failing:   " << u["failing"].get<std::string>() << '\n';
    if (u.contains("streamed") && u["streamed"].is_object()) {
      // Full parts sent while their files were still written.
      const auto& st = u["streamed"];
      std::cout << "  streamed:  " << num(st, "parts_sent") << " parts (" << mib(st.value("bytes_sent", uint64_t{0}))
                << ") sent while written, " << num(st, "files") << " file(s) being written now, "
                << num(st, "parts_stale") << " part(s) sent again after a rewrite\n";
    }
  }
  std::string layouts;
  for (const auto& l : status.value("target_layouts", nlohmann::json::array())) {
    layouts += (layouts.empty() ? "" : ", ") + l.get<std::string>() + " (given)";
  }
  const auto lookup = stats.value("lookup_layouts", nlohmann::json::object());
  for (const auto& l : lookup.value("names", nlohmann::json::array())) {
    layouts += (layouts.empty() ? "" : ", ") + l.get<std::string>() + " (built on lookup)";
  }
  if (!status.contains("no_checkpoint")) {
    std::cout << "layouts:     " << (layouts.empty() ? "none yet (any appears when target/<layout> is looked up)" : layouts)
              << "; on lookup: " << mib(lookup.value("memory_bytes", uint64_t{0})) << " of "
              << mib(lookup.value("memory_limit_bytes", uint64_t{0}))
              << '\n';
    // Layouts a lookup named but could not build (the lookup itself only answers ENOENT).
    for (const auto& r : lookup.value("refused", nlohmann::json::array())) {
      if (!r.is_object()) continue;
      std::cout << "  refused:   " << r.value("layout", "?") << ": " << r.value("reason", "?") << '\n';
    }
  }
  if (status.contains("index")) {
    const auto& ix = status["index"];
    std::cout << "index:       " << ix.value("state", "?") << " (current for generation " << status.value("generation", 1)
              << ") at " << ix.value("dir", "?") << ", schema " << num(ix, "schema") << ", fingerprint "
              << num(ix, "fingerprint") << ", opened in " << ix.value("open_seconds", 0.0) << " s\n";
  }
  std::cout << "generation:  " << status.value("generation", 1) << '\n';
  const auto views = stats.value("views", nlohmann::json::object());
  std::cout << "view reads:  " << mib(views.value("bytes_read", uint64_t{0})) << " in " << num(views, "reads") << " reads\n";
  std::cout << "source reads: " << mib(stats.value("source_bytes_read", uint64_t{0})) << " in " << stats.value("source_reads", uint64_t{0})
            << " reads, " << stats.value("source_read_errors", uint64_t{0}) << " errors\n";
  if (stats.contains("s3") && stats["s3"].is_object()) {  // an s3:// source: its client's counters
    const auto& c = stats["s3"];
    std::cout << "s3:          " << c.value("requests", uint64_t{0}) << " requests (" << c.value("retries", uint64_t{0})
              << " retries, " << c.value("failures", uint64_t{0}) << " failed), " << mib(c.value("bytes_get", uint64_t{0}))
              << " GET, " << c.value("connects", uint64_t{0}) << " connections made\n";
    if (c.contains("read_ahead") && c["read_ahead"].is_object()) {  // what the views announced, fetched ahead
      const auto& r = c["read_ahead"];
      std::cout << "  read-ahead: " << mib(r.value("bytes_served", uint64_t{0})) << " served from "
                << num(r, "blocks_fetched") << " blocks, " << mib(r.value("held_bytes", uint64_t{0}))
                << " held now (at most " << mib(r.value("peak_held_bytes", uint64_t{0})) << ", bound "
                << mib(r.value("max_held_bytes", uint64_t{0})) << ")\n";
    }
  }
  if (stats.contains("capture")) {
    const auto& c = stats["capture"];
    std::cout << "write cache: " << mib(c["cache_used_bytes"]) << " used, " << mib(c.value("cache_free_bytes", uint64_t{0}))
              << " free of " << mib(c["cache_bytes"]) << " (" << c.value("memory", "?") << "), "
              << mib(c["dirty_bytes"]) << " dirty\n"
              << "captured:    " << mib(c["bytes_captured"]) << ", flushed " << mib(c["bytes_flushed"]) << " at "
              << mib(c["flush_bytes_per_second"]) << "/s (" << c.value("engine", "?") << ")\n"
              << "files:       " << c.value("files_pending", uint64_t{0}) << " pending, " << c.value("files_committed", uint64_t{0})
              << " made durable, " << c.value("flush_errors", uint64_t{0}) << " flush errors\n"
              << "writers blocked: " << c.value("writers_blocked_seconds", 0.0) << " s\n";
    for (const auto& u : c.value("unplaced", nlohmann::json::array())) {
      const std::string kept = u.value("kept_in", std::string());
      std::cout << "not placed:  " << u.value("path", std::string("?")) << " (" << u.value("reason", std::string()) << "; "
                << (kept.empty() ? std::string("bytes only in memory") : "kept in " + kept) << ")\n";
    }
  } else {
    std::cout << "write cache: none (read-only mount)\n";
  }
  if (stats.contains("kernel") && stats["kernel"].is_object()) {
    const auto& k = stats["kernel"];
    std::cout << "kernel:      libfuse " << k.value("libfuse", "?") << "; passthrough " << k.value("passthrough", "?")
              << "; io_uring " << k.value("io_uring", "?") << '\n';
    if (k.contains("passthrough_opens")) {
      std::cout << "passed through: " << num(k["passthrough_opens"], "source") << " source opens, "
                << num(k["passthrough_opens"], "views") << " view opens\n";
    }
    if (k.contains("materialize")) {
      const auto& m = k["materialize"];
      std::cout << "materialized: " << num(m, "files") << " files, " << mib(m.value("bytes", uint64_t{0})) << " of "
                << mib(m.value("max_bytes", uint64_t{0})) << " in " << m.value("dir", "?") << " (" << num(m, "builds")
                << " built, " << num(m, "hits") << " reused, " << num(m, "evictions") << " evicted)\n";
    }
  }
  const auto errors = stats.value("errors", nlohmann::json::object());
  std::cout << "errors:      " << num(errors, "count") << '\n';
  for (const auto& m : errors.value("last", nlohmann::json::array())) std::cout << "  " << m.get<std::string>() << '\n';
  return 0;
}

int RunUmount(const std::string& mountpoint) {
  // Everything captured is made durable before the mount goes (the daemon drains on unmount
  // too, but only after umount has returned). A read-only mount has nothing to sync.
  // Files that cannot be placed (their directory removed from outside, the disk full) make it
  // fail, naming each: those durable in their parts are placed by the next mount (the mount
  // goes); while some file's bytes are only in memory, the mount stays, so nothing accepted is
  // lost (free space, or unlink the file through the mount, and run it again).
  // An s3:// mount's saves are uploaded first, in order, with progress; what cannot be (30 s of
  // failures without progress) is named, stays staged for the next mount, and makes it exit 1.
  const std::string mnt = AbsPathOrJoined(mountpoint);
  size_t unplaced = 0;
  size_t not_uploaded = 0;
  if (Status synced = SyncWithUploads(mnt, "ucpfs umount", &not_uploaded);
      !synced.ok() && synced.code() != StatusCode::kNotFound) {
    std::cerr << "ucpfs umount: " << synced.ToString() << '\n';
    size_t in_memory = 0;
    unplaced = ReportUnplaced(mnt, "ucpfs umount", &in_memory);
    if (in_memory > 0) {
      return Fail("umount", Status(StatusCode::kNoSpace,
                                   "not unmounted: " + std::to_string(in_memory) +
                                       " file(s) above have bytes only in memory (make room in the source, or unlink "
                                       "them through the mount, and run it again)"));
    }
    if (unplaced == 0 && not_uploaded == 0) unplaced = 1;  // the sync failed all the same
  }
  // Only ucpfs mounts: `ucpfs umount` of another filesystem is refused, naming its type.
  // Returns once the daemon has exited, so that nothing of the mount still touches SRC (its
  // capture state directory, its index lock) when a script goes on with the source.
  const int pidfd = DaemonPidfd(mnt);
  Status s = fs::UnmountUcpfs(mnt);
  if (!s.ok()) {
    if (pidfd >= 0) ::close(pidfd);
    return Fail("umount", s);
  }
  if (pidfd >= 0) {
    // Everything captured is durable already (the sync above); the daemon only closes its files.
    pollfd p = {pidfd, POLLIN, 0};
    for (int waited_s = 0; ::poll(&p, 1, 1000) == 0; ++waited_s) {
      if (waited_s == 5) std::cerr << "ucpfs umount: unmounted; waiting for the daemon to exit\n";
      if (waited_s == 60) {
        std::cerr << "ucpfs umount: unmounted; the daemon has not exited after 60 s (see its log)\n";
        break;
      }
    }
    ::close(pidfd);
  }
  if (unplaced > 0) {
    std::cerr << "ucpfs umount: unmounted, but " << unplaced
              << " file(s) above are not placed; the next mount of the source tries again\n";
    return 1;
  }
  if (not_uploaded > 0) {
    std::cerr << "ucpfs umount: unmounted, but " << not_uploaded
              << " file(s) above are not in the bucket; they stay staged, and the next mount with the same "
                 "--stage-dir uploads them\n";
    return 1;
  }
  return 0;
}

}  // namespace ucpfs::cli
