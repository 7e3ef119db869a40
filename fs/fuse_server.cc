// See fuse_server.h: the session's INIT, who is asking, and the replies handlers share.
#include "fs/fuse_server.h"

#include <fcntl.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace ucpfs::fs::fuse_server {

bool SpliceRepliesOff() {
  static const bool off = [] {
    const char* v = std::getenv("UCPFS_READ_PATH");
    return v != nullptr && (std::string(v) == "copy" || std::string(v) == "legacy");
  }();
  return off;
}

size_t PipeCapacityBytes(size_t want_bytes) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return 0;
  int got = fcntl(fds[0], F_SETPIPE_SZ, static_cast<int>(want_bytes));
  if (got < 0) {
    // Above fs.pipe-max-size without CAP_SYS_RESOURCE: the most it allows.
    long max_bytes = 0;
    if (FILE* f = std::fopen("/proc/sys/fs/pipe-max-size", "r")) {
      if (std::fscanf(f, "%ld", &max_bytes) != 1) max_bytes = 0;
      std::fclose(f);
    }
    got = max_bytes > 0 ? fcntl(fds[0], F_SETPIPE_SZ, static_cast<int>(max_bytes)) : -1;
    if (got < 0) got = fcntl(fds[0], F_GETPIPE_SZ);
  }
  close(fds[0]);
  close(fds[1]);
  return got < 0 ? 0 : static_cast<size_t>(got);
}

int ReplyEntry(fuse_req_t req, Filesystem& fs, const Entry& entry) {
  const fuse_entry_param e = EntryParam(entry);
  if (fuse_reply_entry(req, &e) != 0) fs.Forget(entry.ino, 1);
  return 0;
}

Caller CallerOf(fuse_req_t req) {
  static const bool can_switch = geteuid() == 0;
  static const gid_t daemon_gid = getegid();
  const fuse_ctx* ctx = fuse_req_ctx(req);
  Caller caller;
  caller.uid = ctx->uid;
  caller.gid = ctx->gid;
  caller.umask = ctx->umask;
  caller.has_umask = true;
  caller.switch_creds = can_switch && !(ctx->uid == 0 && ctx->gid == daemon_gid);
  if (!caller.switch_creds) return caller;
  // From /proc/<tid>/status; when it cannot be read (the caller is gone, another pid
  // namespace) the caller acts with no supplementary group: it may be refused more, never granted more.
  std::vector<gid_t> groups(32);
  for (int attempt = 0; attempt < 4; ++attempt) {
    const int n = fuse_req_getgroups(req, static_cast<int>(groups.size()), groups.data());
    if (n < 0) {
      groups.clear();
      break;
    }
    if (static_cast<size_t>(n) <= groups.size()) {
      groups.resize(static_cast<size_t>(n));
      break;
    }
    groups.resize(static_cast<size_t>(n));
  }
  caller.groups = std::move(groups);
  return caller;
}


uint32_t MaxBackground(uint32_t readahead_bytes, uint32_t max_read_bytes) {
  const uint64_t per_window = (uint64_t{readahead_bytes} + max_read_bytes - 1) / std::max<uint32_t>(max_read_bytes, 1);
  return static_cast<uint32_t>(
      std::clamp<uint64_t>(per_window * kReadAheadWindowsInFlight, kMinMaxBackground, kMaxMaxBackground));
}

void OpInit(void* userdata, fuse_conn_info* conn) {
  Server& server = *static_cast<Server*>(userdata);
  // Must equal the -o max_read given to fuse_session_new, or libfuse refuses the INIT.
  conn->max_read = server.max_read_bytes;
  // The kernel clamps this to its per-mount default (128 KiB); ServeTree's readiness thread
  // raises the mount's bdi read_ahead_kb afterwards.
  conn->max_readahead = server.max_read_bytes;
  conn->max_background = server.max_background;
  conn->congestion_threshold = CongestionThreshold(server.max_background);
  // ATOMIC_O_TRUNC: open(O_TRUNC) arrives as such (not as a truncate, then an open), so a file
  // rewritten through the mount is captured and replaces the old one atomically.
  // DONT_MASK: create/mkdir arrive with the caller's mode and umask unapplied, and the umask is
  // applied by the kernel when the daemon creates as the caller (so a default ACL wins over it).
  const unsigned wanted = FUSE_CAP_ASYNC_READ | FUSE_CAP_READDIRPLUS | FUSE_CAP_READDIRPLUS_AUTO |
                          FUSE_CAP_PARALLEL_DIROPS | FUSE_CAP_ATOMIC_O_TRUNC | FUSE_CAP_DONT_MASK;
  conn->want |= wanted & conn->capable;
  conn->want &= ~static_cast<unsigned>(FUSE_CAP_WRITEBACK_CACHE);
  // PARALLEL_DIROPS reaches the kernel through DeviceWritev where libfuse (< 3.17) drops it.
  // Requests are read, not spliced (SPLICE_READ: only writes would gain, and they go to the
  // capture); SPLICE_MOVE would only steal pages the pipe owns alone, never the source's
  // page-cache pages that spliced replies carry.
  conn->want &= ~static_cast<unsigned>(FUSE_CAP_SPLICE_READ | FUSE_CAP_SPLICE_WRITE |
                                       FUSE_CAP_SPLICE_MOVE);
  // With --materialize, the open of a view that queues its copy's build reads it direct_io
  // (OpOpen): such a file must still map MAP_SHARED (safetensors does). The flag holds for the mount's written
  // files too, opened direct_io: a writable shared mapping of one is then written back through
  // the capture (docs/reference.md), where without it the mmap fails with ENODEV.
#ifdef FUSE_CAP_DIRECT_IO_ALLOW_MMAP
  if (server.materialize != nullptr && (conn->capable & FUSE_CAP_DIRECT_IO_ALLOW_MMAP) != 0) {
    conn->want |= FUSE_CAP_DIRECT_IO_ALLOW_MMAP;
    server.direct_first_open.store(true);
  }
#endif
  MountReport::Kernel kernel;
  kernel.libfuse = fuse_pkgversion();
  kernel.max_background = conn->max_background;
  if (!server.splice_wanted) {
    kernel.splice_why = server.splice_why;
  } else if ((conn->capable & FUSE_CAP_SPLICE_WRITE) == 0) {
    kernel.splice_why = "the kernel or libfuse does not offer splice";
  } else {
    conn->want |= FUSE_CAP_SPLICE_WRITE;
    kernel.splice = true;
    server.splice_on.store(true);
  }
#ifdef UCPFS_HAVE_PASSTHROUGH
  // The kernel offers it with CONFIG_FUSE_PASSTHROUGH to a daemon with CAP_SYS_ADMIN; it cannot
  // be combined with the writeback cache (off above).
  if (!server.passthrough_wanted) {
    kernel.passthrough_why = "turned off (--no-passthrough)";
  } else if ((conn->capable & FUSE_CAP_PASSTHROUGH) == 0) {
    kernel.passthrough_why = "the kernel does not offer it (CONFIG_FUSE_PASSTHROUGH, and the daemon must be root)";
  } else {
    conn->want |= FUSE_CAP_PASSTHROUGH;
    conn->max_backing_stack_depth = 1;  // a backing file may itself be on a stacked file system
    kernel.passthrough = true;
    server.passthrough_on.store(true);
  }
#else
  kernel.passthrough_why = "libfuse " + kernel.libfuse + " has none (needs >= 3.17: tests/build-libfuse.sh)";
#endif
#if FUSE_VERSION >= FUSE_MAKE_VERSION(3, 18) && UCPFS_LIBFUSE_URING
  // Requested with -o io_uring (ServeTree); the kernel offers it when the fuse module's
  // enable_uring parameter is on. libfuse falls back to /dev/fuse reads if its rings fail to start.
  if ((conn->capable & FUSE_CAP_OVER_IO_URING) != 0) {
    kernel.io_uring = true;
  } else {
    kernel.io_uring_why = "the kernel does not offer it (/sys/module/fuse/parameters/enable_uring is off; root may "
                          "set it to Y): requests come through /dev/fuse reads";
  }
#else
  kernel.io_uring_why = "libfuse " + kernel.libfuse + " has none (needs >= 3.18 built with liburing and libnuma)";
#endif
  if (server.report) server.report->SetKernel(std::move(kernel));
}

void NoteTransport(fuse_req_t req) {
#if FUSE_VERSION >= FUSE_MAKE_VERSION(3, 18) && UCPFS_LIBFUSE_URING
  if (fuse_req_is_uring(req) && ServerOf(req).report) ServerOf(req).report->CountUringRequest();
#else
  (void)req;
#endif
}

bool IsUring(fuse_req_t req) {
#if FUSE_VERSION >= FUSE_MAKE_VERSION(3, 18) && UCPFS_LIBFUSE_URING
  return fuse_req_is_uring(req);
#else
  (void)req;
  return false;
#endif
}

void SourceOpenFlags(fuse_file_info* fi, bool writable) {
  if (writable) {
    fi->direct_io = 1;
  } else {
    fi->keep_cache = 0;
  }
}

}  // namespace ucpfs::fs::fuse_server
