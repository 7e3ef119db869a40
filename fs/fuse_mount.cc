// Serves a Filesystem through the libfuse3 low-level API (multi-threaded loop). See
// fuse_mount.h.
//
// Not for: what is served (filesystem.cc), building the namespace (tree.cc, namespace.cc) or
// producing file bytes (ByteSource openers).
//
// Invariants:
// - Every Op* handler unpacks the request, calls one Filesystem method and replies exactly
//   once. Handlers run their body through Handle(): the body either replies as its last
//   statement and returns 0, or returns an errno that Handle() replies with. An exception can
//   therefore only escape before any reply, and Handle() turns it into EIO; nothing ever
//   propagates into libfuse.
// - Errors become errnos in ErrnoFromStatus() (errno_map.cc) and nowhere else.
// - Kernel references: every entry replied by lookup or readdirplus was counted by the
//   Filesystem (Lookup/Reference); a reply that does not reach the kernel is given back at once
//   (Forget), and forget/forget_multi give the kernel's back, so subtrees the kernel no longer
//   knows are evicted.
// - fi->fh of an open file is an OpenFileHandle (one per open(2), freed by release); of an open
//   directory an OpenDirHandle snapshot (freed by releasedir). The session's HandleRegistry
//   owns both, so handles still open when the mount goes away are freed too.
// API 3.12 (= FUSE_MAKE_VERSION(3, 12)): below it, fuse_session_loop_mt() binds to the 3.2 entry
// point, which reads the opaque fuse_loop_cfg_create() object as the old public struct (clone_fd,
// max_idle_threads garbage: a thread per request).
#define FUSE_USE_VERSION 312
#include "fs/fuse_mount.h"

#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "fs/direct_mount.h"
#include "fs/errno_map.h"
#include "fs/filesystem.h"
#include "fs/passthrough.h"

extern char** environ;

namespace ucpfs::fs {
namespace {

// Views are immutable: the kernel may cache names, attributes and negative lookups for long.
constexpr double kCacheTimeoutS = 3600.0;
// Largest FUSE read request. libfuse 3.14's receive buffer holds 256 pages, and the kernel's
// max_pages_limit is 256 by default, so 1 MiB is the most one request can carry.
constexpr uint32_t kDefaultMaxReadBytes = 1u << 20;

// ---- spliced replies ----
//
// A view read's plain bytes (source bytes copied unconverted) are not read by the daemon: the
// read runs in a LocateScope (core/byte_source.h), which leaves them unread and says where they
// lie in the open source files, and the reply (fuse_reply_data) is a fuse_bufvec of memory
// buffers (headers, converted or gathered bytes) and descriptor buffers over those files, which
// libfuse splices into /dev/fuse through a per-thread pipe: the kernel copies the source's
// pages into the reply once, where a copy reply takes them through the daemon's buffer.
// - The whole reply must fit the pipe (libfuse: pagesize * (buffers + 2) + the message), and a
//   pipe above fs.pipe-max-size (1 MiB by default) needs CAP_SYS_RESOURCE: where the daemon
//   cannot make a pipe of max_read plus kSpliceSlackBytes, a default max_read is lowered to fit
//   (896 KiB), and a max_read given with -o turns splicing off. At most kMaxSplicedPieces
//   descriptor buffers, fewer where the slack is smaller (more pieces are read, as today).
// - Pieces under kMinSplicedPieceBytes are read: a descriptor buffer costs a splice call and
//   a pipe slot per page it touches.
// - Not for FUSE over io_uring (libfuse copies a bufvec into the ring: no splice), volatile
//   files, source files, or with UCPFS_READ_PATH=copy (or legacy) in the environment.
// - A source edited in place is caught as before the read: LocatePieces checks the file (fstat)
//   before the reply. An edit landing between that check and the kernel's copy (microseconds)
//   can reach that one reply; the next read of the file fails (EIO).
constexpr uint32_t kSpliceSlackBytes = 128u << 10;
constexpr uint32_t kMinSplicedMaxReadBytes = 256u << 10;
constexpr uint64_t kMinSplicedPieceBytes = 16u << 10;
constexpr size_t kMaxSplicedPieces = 64;
constexpr size_t kPipePageBytes = 4096;

// UCPFS_READ_PATH=copy: every reply copied through the daemon's buffer (the batched path
// without splicing), for measuring one against the other and a way back; legacy implies it.
bool SpliceRepliesOff() {
  static const bool off = [] {
    const char* v = std::getenv("UCPFS_READ_PATH");
    return v != nullptr && (std::string(v) == "copy" || std::string(v) == "legacy");
  }();
  return off;
}

// The largest pipe this process can make, up to `want_bytes` (0 when it cannot make one).
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

// ---- per-session state ----

// Per-open state referenced by fi->fh.
struct OpenHandle {
  virtual ~OpenHandle() = default;
};

struct OpenFileHandle final : OpenHandle {
  explicit OpenFileHandle(OpenFile file_in) : file(std::move(file_in)) {}
  OpenFile file;
  bool kernel_passthrough = false;  // opened in passthrough mode (InodeModes)
};

struct OpenDirHandle final : OpenHandle {
  explicit OpenDirHandle(DirListing listing_in) : listing(std::move(listing_in)) {}
  DirListing listing;  // readdir offset i means "resume at items[i]"
};

// Every live OpenHandle. The kernel sends no RELEASE for files still open when the mount
// goes away, so ServeTree frees what is left here after the session ends. The lock is taken
// by open/opendir/release/releasedir only, never on the read path; handles are deleted
// outside it.
class HandleRegistry {
 public:
  // Takes ownership. Registered before the open is replied to, because RELEASE may arrive
  // on another worker as soon as the reply is out. If it throws, the handle is freed.
  OpenHandle* Adopt(std::unique_ptr<OpenHandle> handle) {
    std::lock_guard lock(mu_);
    live_.insert(handle.get());
    return handle.release();
  }
  void Destroy(OpenHandle* handle) noexcept {
    {
      std::lock_guard lock(mu_);
      live_.erase(handle);
    }
    delete handle;
  }
  void DestroyAll() noexcept {
    std::unordered_set<OpenHandle*> left;
    {
      std::lock_guard lock(mu_);
      left.swap(live_);
    }
    for (OpenHandle* handle : left) delete handle;
  }

 private:
  std::mutex mu_;
  std::unordered_set<OpenHandle*> live_;
};

// ---- FUSE passthrough (libfuse >= 3.17) ----
//
// The kernel's rules (fs/fuse/iomode.c): while an inode has a passthrough open, every other open
// of it must be a passthrough open of the same backing file (else the open fails with EIO after
// our reply); a passthrough open fails while the inode has open files in caching mode. So the
// daemon keeps, per inode, its open files of each kind and the one backing id: a file may pass
// through only when no other kind is open, joins the inode's backing when one is registered, and
// an open that cannot pass through while the inode's backing is in use is refused (ETXTBSY). The
// counts here only ever run ahead of the kernel's (counted before the reply, dropped at RELEASE,
// which comes after the kernel dropped its own), so they never allow what the kernel refuses.
#if FUSE_VERSION >= FUSE_MAKE_VERSION(3, 17)
#define UCPFS_HAVE_PASSTHROUGH 1
#endif

class InodeModes {
 public:
  struct Modes {
    int backing_id = 0;          // > 0 while n_passthrough > 0
    bool writable_backing = false;
    uint32_t n_passthrough = 0;  // open files passing through to the backing
    uint32_t n_other = 0;        // open files served by the daemon (cached or direct_io)
  };
  std::mutex mu;
  std::condition_variable dropped;        // notified when an open is dropped (RELEASE)
  std::unordered_map<Ino, Modes> by_ino;  // guarded by mu; only inodes with open files

  bool HasPassthrough(Ino ino) {
    std::lock_guard lock(mu);
    const auto it = by_ino.find(ino);
    return it != by_ino.end() && it->second.n_passthrough > 0;
  }
  // Waits at most `max` until `ino` has no passthrough open; whether it has none. A close(2)
  // returns before its RELEASE reaches us (every open is noflush) and other threads may handle
  // an open that came after it first: a conflict with an open its owner closed already is gone
  // once that RELEASE is handled, which this waits for, rather than refuse (ETXTBSY) at once.
  bool WaitNoPassthrough(Ino ino, std::chrono::milliseconds max) {
    std::unique_lock lock(mu);
    return dropped.wait_for(lock, max, [&] {
      const auto it = by_ino.find(ino);
      return it == by_ino.end() || it->second.n_passthrough == 0;
    });
  }
  // Drops one open of `ino`; returns the backing id to close when its last passthrough open went.
  int Drop(Ino ino, bool passthrough) {
    std::lock_guard lock(mu);
    const auto it = by_ino.find(ino);
    if (it == by_ino.end()) return 0;
    Modes& m = it->second;
    int to_close = 0;
    if (passthrough) {
      if (m.n_passthrough > 0 && --m.n_passthrough == 0) {
        to_close = m.backing_id;
        m.backing_id = 0;
      }
    } else if (m.n_other > 0) {
      --m.n_other;
    }
    if (m.n_passthrough == 0 && m.n_other == 0) by_ino.erase(it);
    dropped.notify_all();
    return to_close;
  }
};

// How long an open that conflicts with a passthrough open waits for that open's RELEASE
// (InodeModes::WaitNoPassthrough) before it is refused with ETXTBSY.
constexpr std::chrono::milliseconds kReleaseGrace{200};

struct Server {
  std::unique_ptr<Filesystem> fs;
  bool passthrough_wanted = false;          // MountOptions::passthrough (and libfuse >= 3.17)
  std::atomic<bool> passthrough_on{false};  // negotiated at INIT
  std::shared_ptr<Materializer> materialize;
  std::shared_ptr<MountReport> report;
  InodeModes modes;
  uint32_t max_read_bytes = kDefaultMaxReadBytes;
  // Spliced replies (see above): wanted (decided in ServeTree), and agreed at INIT.
  bool splice_wanted = false;
  std::string splice_why;         // when not wanted: why
  size_t max_spliced_pieces = 0;  // descriptor buffers per reply
  std::atomic<bool> splice_on{false};
  HandleRegistry handles;
  // The INIT request's id, and whether the kernel offered FUSE_PARALLEL_DIROPS in it (DeviceRead).
  std::atomic<uint64_t> init_unique{0};
  std::atomic<bool> kernel_parallel_dirops{false};
};

// ---- /dev/fuse I/O: FUSE_PARALLEL_DIROPS reaches the kernel ----
//
// libfuse before 3.17 (commit c9905341, "Pass FUSE_PARALLEL_DIROPS to kernel") enables
// FUSE_CAP_PARALLEL_DIROPS in conn->want but never sets the flag in its INIT reply, so the
// kernel takes a per-directory mutex around every lookup and readdir (fuse_lock_inode): one
// slow lookup, such as a large layout built in target/, makes every other lookup in that
// directory wait for it (measured: 2.3 s for a lookup of another layout beside a 4096-rank
// build). The session's reads and writes go through these hooks (fuse_session_custom_io on the
// fd fuse_session_mount opened); they only note the INIT request and set the flag in the INIT
// reply when the kernel offered it (OpInit always asks for it). Every other message passes as is.
// Wire layout (linux/fuse.h, which libfuse does not install): fuse_in_header is
// {u32 len, u32 opcode, u64 unique, ...} (40 bytes), fuse_out_header {u32 len, i32 error,
// u64 unique} (16 bytes), fuse_init_in and fuse_init_out both start {u32 major, u32 minor,
// u32 max_readahead, u32 flags}. libfuse 3.17 and later send the flag themselves.
#if FUSE_VERSION < FUSE_MAKE_VERSION(3, 17)
#define UCPFS_PATCH_PARALLEL_DIROPS 1
constexpr uint32_t kFuseInitOpcode = 26;
constexpr uint32_t kFuseParallelDirops = 1u << 18;
constexpr size_t kInHeaderBytes = 40;
constexpr size_t kOutHeaderBytes = 16;
constexpr size_t kInitFlagsOffset = 12;

ssize_t DeviceRead(int fd, void* buf, size_t buf_len, void* userdata) {
  const ssize_t n = ::read(fd, buf, buf_len);
  if (n >= static_cast<ssize_t>(kInHeaderBytes + kInitFlagsOffset + 4)) {
    const auto* bytes = static_cast<const unsigned char*>(buf);
    uint32_t opcode = 0;
    std::memcpy(&opcode, bytes + 4, 4);
    if (opcode == kFuseInitOpcode) {
      auto& server = *static_cast<Server*>(userdata);
      uint64_t unique = 0;
      uint32_t flags = 0;
      std::memcpy(&unique, bytes + 8, 8);
      std::memcpy(&flags, bytes + kInHeaderBytes + kInitFlagsOffset, 4);
      server.kernel_parallel_dirops.store((flags & kFuseParallelDirops) != 0);
      server.init_unique.store(unique);
    }
  }
  return n;  // errno is read()'s: libfuse looks at it
}

ssize_t DeviceWritev(int fd, struct iovec* iov, int count, void* userdata) {
  auto& server = *static_cast<Server*>(userdata);
  const uint64_t init_unique = server.init_unique.load();
  // The INIT reply: libfuse sends it as {out header, fuse_init_out}.
  if (init_unique != 0 && count == 2 && iov[0].iov_len == kOutHeaderBytes &&
      iov[1].iov_len >= kInitFlagsOffset + 4) {
    uint64_t unique = 0;
    int32_t error = 0;
    std::memcpy(&error, static_cast<const char*>(iov[0].iov_base) + 4, 4);
    std::memcpy(&unique, static_cast<const char*>(iov[0].iov_base) + 8, 8);
    if (unique == init_unique && error == 0 && server.kernel_parallel_dirops.load()) {
      server.init_unique.store(0);
      std::vector<char> init_out(static_cast<const char*>(iov[1].iov_base),
                                 static_cast<const char*>(iov[1].iov_base) + iov[1].iov_len);
      uint32_t flags = 0;
      std::memcpy(&flags, init_out.data() + kInitFlagsOffset, 4);
      flags |= kFuseParallelDirops;
      std::memcpy(init_out.data() + kInitFlagsOffset, &flags, 4);
      struct iovec patched[2] = {iov[0], {init_out.data(), init_out.size()}};
      return ::writev(fd, patched, 2);
    }
  }
  return ::writev(fd, iov, count);
}
#endif  // FUSE_VERSION < 3.17

Server& ServerOf(fuse_req_t req) { return *static_cast<Server*>(fuse_req_userdata(req)); }
Filesystem& FsOf(fuse_req_t req) { return *ServerOf(req).fs; }

template <typename T>
T* HandleOf(const fuse_file_info* fi) {
  return static_cast<T*>(reinterpret_cast<OpenHandle*>(static_cast<uintptr_t>(fi->fh)));
}

// Registers `handle`, stores it in fi->fh and replies to the open(dir) request.
void ReplyOpen(fuse_req_t req, fuse_file_info* fi, std::unique_ptr<OpenHandle> handle) {
  Server& server = ServerOf(req);
  OpenHandle* raw = server.handles.Adopt(std::move(handle));
  fi->fh = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(raw));
  // A failed reply means the open was interrupted; no release will come for it.
  if (fuse_reply_open(req, fi) != 0) server.handles.Destroy(raw);
}

// Runs one handler body (see the file comment for the contract).
template <typename Body>
void Handle(fuse_req_t req, const char* op, Body&& body) noexcept {
  int err = EIO;
  try {
    err = body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ucpfs: %s: unexpected exception: %s\n", op, e.what());
  } catch (...) {
    std::fprintf(stderr, "ucpfs: %s: unexpected exception\n", op);
  }
  if (err != 0) fuse_reply_err(req, err);
}

// Source entries change (through the mount and beside it): cached briefly.
constexpr double kSourceTimeoutS = 1.0;

double TimeoutOf(Ino ino) { return Passthrough::Owns(ino) ? kSourceTimeoutS : kCacheTimeoutS; }

// `short_names`: names of the mount's root, whose views a new generation replaces (Swap), so the
// kernel asks again within a second.
fuse_entry_param EntryParam(const Entry& entry, double negative_timeout = kCacheTimeoutS, bool short_names = false) {
  fuse_entry_param e = {};
  // ino 0 is a negative entry, cached for entry_timeout like a positive one.
  if (entry.ino != 0) {
    e.ino = entry.ino;
    e.attr = entry.attr;
    e.attr_timeout = TimeoutOf(entry.ino);
    e.entry_timeout = short_names ? kSourceTimeoutS : TimeoutOf(entry.ino);
  } else {
    e.entry_timeout = negative_timeout;
  }
  return e;
}

// Replies to a request that made an entry (create, mkdir): the kernel holds one reference.
int ReplyEntry(fuse_req_t req, Filesystem& fs, const Entry& entry) {
  const fuse_entry_param e = EntryParam(entry);
  if (fuse_reply_entry(req, &e) != 0) fs.Forget(entry.ino, 1);
  return 0;
}

// Who sent `req`: its fsuid, fsgid, umask and (when the daemon will switch to it) supplementary
// groups. A root daemon acts as every other caller (fs/caller.h); a request from the daemon's own
// user and group needs no switch.
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

// ---- Op* adapters ----

void OpInit(void* userdata, fuse_conn_info* conn) {
  Server& server = *static_cast<Server*>(userdata);
  // Must equal the -o max_read given to fuse_session_new, or libfuse refuses the INIT.
  conn->max_read = server.max_read_bytes;
  // The kernel clamps this to its per-mount default (128 KiB); ServeTree's readiness thread
  // raises the mount's bdi read_ahead_kb afterwards.
  conn->max_readahead = server.max_read_bytes;
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
  MountReport::Kernel kernel;
  kernel.libfuse = fuse_pkgversion();
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

// A request that came through FUSE over io_uring (libfuse >= 3.18) is counted (status).
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

void OpLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  NoteTransport(req);
  Handle(req, "lookup", [&] {
    Filesystem& fs = FsOf(req);
    Result<Entry> entry = fs.Lookup(parent, name);
    // A resolve failure is not a negative entry: a later lookup tries again.
    if (!entry.ok()) return ErrnoFromStatus(entry.error());
    const bool source = Passthrough::Owns(parent) || (parent == kRootIno && fs.HasPassthrough());
    const fuse_entry_param e =
        EntryParam(*entry, source ? kSourceTimeoutS : kCacheTimeoutS, parent == kRootIno && fs.HasPassthrough());
    if (fuse_reply_entry(req, &e) != 0 && entry->ino != 0) fs.Forget(entry->ino, 1);
    return 0;
  });
}

void OpForget(fuse_req_t req, fuse_ino_t ino, uint64_t n_lookups) {
  FsOf(req).Forget(ino, n_lookups);
  fuse_reply_none(req);
}

void OpForgetMulti(fuse_req_t req, size_t count, fuse_forget_data* forgets) {
  Filesystem& fs = FsOf(req);
  for (size_t i = 0; i < count; ++i) fs.Forget(forgets[i].ino, forgets[i].nlookup);
  fuse_reply_none(req);
}

void OpGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  NoteTransport(req);
  Handle(req, "getattr", [&] {
    Result<struct stat> st = FsOf(req).GetAttr(ino);
    if (!st.ok()) return ErrnoFromStatus(st.error());
    fuse_reply_attr(req, &*st, ino == kRootIno && FsOf(req).HasPassthrough() ? kSourceTimeoutS : TimeoutOf(ino));
    return 0;
  });
}

void OpSetattr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int to_set, fuse_file_info* fi) {
  Handle(req, "setattr", [&] {
    int set = 0;
    if ((to_set & FUSE_SET_ATTR_MODE) != 0) set |= Passthrough::kSetMode;
    if ((to_set & FUSE_SET_ATTR_UID) != 0) set |= Passthrough::kSetUid;
    if ((to_set & FUSE_SET_ATTR_GID) != 0) set |= Passthrough::kSetGid;
    if ((to_set & FUSE_SET_ATTR_SIZE) != 0) set |= Passthrough::kSetSize;
    if ((to_set & FUSE_SET_ATTR_ATIME) != 0) set |= Passthrough::kSetAtime;
    if ((to_set & FUSE_SET_ATTR_MTIME) != 0) set |= Passthrough::kSetMtime;
    if ((to_set & FUSE_SET_ATTR_ATIME_NOW) != 0) set |= Passthrough::kSetAtime | Passthrough::kSetAtimeNow;
    if ((to_set & FUSE_SET_ATTR_MTIME_NOW) != 0) set |= Passthrough::kSetMtime | Passthrough::kSetMtimeNow;
    OpenFile* file = fi != nullptr ? &HandleOf<OpenFileHandle>(fi)->file : nullptr;
    Result<struct stat> st = FsOf(req).SetAttr(ino, *attr, set, file, CallerOf(req));
    if (!st.ok()) return ErrnoFromStatus(st.error());
    fuse_reply_attr(req, &*st, TimeoutOf(ino));
    return 0;
  });
}

void OpMkdir(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode) {
  Handle(req, "mkdir", [&] {
    Filesystem& fs = FsOf(req);
    Result<Entry> entry = fs.Mkdir(parent, name, mode, CallerOf(req));
    if (!entry.ok()) return ErrnoFromStatus(entry.error());
    return ReplyEntry(req, fs, *entry);
  });
}

void OpMknod(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode, dev_t) {
  Handle(req, "mknod", [&] {
    Filesystem& fs = FsOf(req);
    Result<Entry> entry = fs.Mknod(parent, name, mode, CallerOf(req));
    if (!entry.ok()) return ErrnoFromStatus(entry.error());
    return ReplyEntry(req, fs, *entry);
  });
}

void OpSymlink(fuse_req_t req, const char* target, fuse_ino_t parent, const char* name) {
  Handle(req, "symlink", [&] {
    Filesystem& fs = FsOf(req);
    Result<Entry> entry = fs.Symlink(parent, name, target, CallerOf(req));
    if (!entry.ok()) return ErrnoFromStatus(entry.error());
    return ReplyEntry(req, fs, *entry);
  });
}

void OpReadlink(fuse_req_t req, fuse_ino_t ino) {
  Handle(req, "readlink", [&] {
    Result<std::string> target = FsOf(req).Readlink(ino);
    if (!target.ok()) return ErrnoFromStatus(target.error());
    fuse_reply_readlink(req, target->c_str());
    return 0;
  });
}

// Hard links are not made in the source (a captured file has no inode to link yet).
void OpLink(fuse_req_t req, fuse_ino_t, fuse_ino_t, const char*) { fuse_reply_err(req, EPERM); }

void OpUnlink(fuse_req_t req, fuse_ino_t parent, const char* name) {
  Handle(req, "unlink", [&] {
    const Status s = FsOf(req).Unlink(parent, name, CallerOf(req));
    if (!s.ok()) return ErrnoFromStatus(s);
    fuse_reply_err(req, 0);
    return 0;
  });
}

void OpRmdir(fuse_req_t req, fuse_ino_t parent, const char* name) {
  Handle(req, "rmdir", [&] {
    const Status s = FsOf(req).Rmdir(parent, name, CallerOf(req));
    if (!s.ok()) return ErrnoFromStatus(s);
    fuse_reply_err(req, 0);
    return 0;
  });
}

void OpRename(fuse_req_t req, fuse_ino_t parent, const char* name, fuse_ino_t new_parent, const char* new_name,
              unsigned flags) {
  Handle(req, "rename", [&] {
    const Status s = FsOf(req).Rename(parent, name, new_parent, new_name, flags, CallerOf(req));
    if (!s.ok()) return ErrnoFromStatus(s);
    fuse_reply_err(req, 0);
    return 0;
  });
}

// Options of an open source file: written ones bypass the page cache (the capture holds their
// bytes; no second copy), read ones drop stale pages at open.
void SourceOpenFlags(fuse_file_info* fi, bool writable) {
  if (writable) {
    fi->direct_io = 1;
  } else {
    fi->keep_cache = 0;
  }
}

void OpCreate(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode, fuse_file_info* fi) {
  Handle(req, "create", [&] {
    Filesystem& fs = FsOf(req);
    Result<std::pair<Entry, OpenFile>> made = fs.Create(parent, name, mode, fi->flags, CallerOf(req));
    if (!made.ok()) return ErrnoFromStatus(made.error());
    SourceOpenFlags(fi, true);
    Server& server = ServerOf(req);
    {
      std::lock_guard lock(server.modes.mu);
      ++server.modes.by_ino[made->first.ino].n_other;
    }
    OpenHandle* raw = server.handles.Adopt(std::make_unique<OpenFileHandle>(std::move(made->second)));
    fi->fh = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(raw));
    const fuse_entry_param e = EntryParam(made->first);
    if (fuse_reply_create(req, &e, fi) != 0) {
      fs.Forget(made->first.ino, 1);
      (void)fs.Release(static_cast<OpenFileHandle*>(raw)->file);
      server.modes.Drop(made->first.ino, false);
      server.handles.Destroy(raw);
    }
    return 0;
  });
}

void OpWrite(fuse_req_t req, fuse_ino_t, const char* buf, size_t size, off_t off, fuse_file_info* fi) {
  Handle(req, "write", [&] {
    if (off < 0) return EINVAL;
    OpenFile& file = HandleOf<OpenFileHandle>(fi)->file;
    Result<size_t> n = FsOf(req).Write(file, static_cast<uint64_t>(off),
                                       std::span(reinterpret_cast<const std::byte*>(buf), size));
    if (!n.ok()) return ErrnoFromStatus(n.error());
    fuse_reply_write(req, *n);
    return 0;
  });
}

// close(2): views are opened noflush (never sent here); a source file reports its save's error.
void OpFlush(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  Handle(req, "flush", [&] {
    const Status s = FsOf(req).Flush(HandleOf<OpenFileHandle>(fi)->file);
    if (!s.ok()) return ErrnoFromStatus(s);
    fuse_reply_err(req, 0);
    return 0;
  });
}

void OpFsync(fuse_req_t req, fuse_ino_t, int datasync, fuse_file_info* fi) {
  Handle(req, "fsync", [&] {
    const Status s = FsOf(req).Fsync(HandleOf<OpenFileHandle>(fi)->file, datasync != 0);
    if (!s.ok()) return ErrnoFromStatus(s);
    fuse_reply_err(req, 0);
    return 0;
  });
}

// Every namespace or content change: the mount is read-only (the kernel usually answers
// EROFS itself because we mount with "ro"; these cover the rest).
template <typename... Args>
void OpReadOnly(fuse_req_t req, Args...) {
  fuse_reply_err(req, EROFS);
}

#ifdef UCPFS_HAVE_PASSTHROUGH
// A descriptor of the file an open of `file` may pass through to, or -1 when it may not: a
// source file not being captured (opened for writing only when the daemon has nothing to do at
// its first write), reopened by the daemon read-write where it can, so later writable opens can
// join the same backing; or a view's materialised copy once it is built (until then the open
// is served by the daemon, and its build is queued behind it: fs/materialize.h).
// `writable` says whether the descriptor is open for writing.
int BackingFdOf(Server& server, const OpenFile& file, bool* writable) {
  *writable = false;
  if (const auto& h = file.passthrough) {
    if (h->captured != nullptr || h->fd < 0 || (h->writable && h->kill_privs.load())) return -1;
    const std::string proc = "/proc/self/fd/" + std::to_string(h->fd);
    int fd = open(proc.c_str(), O_RDWR | O_CLOEXEC);
    if (fd >= 0) {
      *writable = true;
      return fd;
    }
    if (h->writable) return -1;
    return open(proc.c_str(), O_RDONLY | O_CLOEXEC);
  }
  if (server.materialize == nullptr || file.volatile_content || file.source == nullptr) return -1;
  const std::shared_ptr<const void> node = file.node.lock();
  if (node == nullptr) return -1;  // its tree is gone (an evicted subtree): served by the daemon
  Result<int> fd = server.materialize->Open(node, file.source);
  if (!fd.ok()) {
    if (fd.error().code() != StatusCode::kUnsupported) {
      std::fprintf(stderr, "ucpfs: materialize: %s\n", fd.error().ToString().c_str());
    }
    return -1;
  }
  return *fd;
}
#endif

// How an open file is served: sets fi's mode (passthrough with its backing id, or the daemon's
// cached/direct_io modes) and counts it in server.modes. Returns 0, or ETXTBSY when the inode
// passes through to a backing file this open cannot share (InodeModes).
int ChooseMode(fuse_req_t req, Server& server, Ino ino, const OpenFile& file, fuse_file_info* fi, bool* passthrough) {
  *passthrough = false;
#ifdef UCPFS_HAVE_PASSTHROUGH
  const bool writable = file.passthrough && file.passthrough->writable;
  if (server.passthrough_on.load()) {
    // A view whose inode already passes through joins it: the backing holds the same bytes.
    {
      std::lock_guard lock(server.modes.mu);
      InodeModes::Modes& m = server.modes.by_ino[ino];
      if (m.n_passthrough > 0) {
        const bool shareable = file.passthrough ? file.passthrough->captured == nullptr &&
                                                      (!writable || m.writable_backing) &&
                                                      !(writable && file.passthrough->kill_privs.load())
                                                : true;
        if (!shareable) {
          if (m.n_passthrough == 0 && m.n_other == 0) server.modes.by_ino.erase(ino);
          return ETXTBSY;
        }
        ++m.n_passthrough;
        fi->backing_id = m.backing_id;
        *passthrough = true;
        return 0;
      }
      if (m.n_other > 0) {  // open in caching or direct_io mode: served by the daemon
        ++m.n_other;
        return 0;
      }
    }
    bool backing_writable = false;
    const int fd = BackingFdOf(server, file, &backing_writable);  // may queue a view's build: no lock held
    if (fd >= 0) {
      std::lock_guard lock(server.modes.mu);
      InodeModes::Modes& m = server.modes.by_ino[ino];
      if (m.n_other == 0) {
        if (m.n_passthrough == 0) {
          const int id = fuse_passthrough_open(req, fd);
          if (id > 0) {
            m.backing_id = id;
            m.writable_backing = backing_writable;
          }
        }
        if (m.backing_id > 0 && (!writable || m.writable_backing)) {
          ++m.n_passthrough;
          fi->backing_id = m.backing_id;
          *passthrough = true;
          close(fd);
          return 0;
        }
        if (m.n_passthrough == 0 && m.backing_id > 0) {
          // Registered for this open, which cannot use it (a writer, a read-only backing): given
          // back now, or the kernel would hold the file until the mount ends.
          fuse_passthrough_close(req, m.backing_id);
          m.backing_id = 0;
        }
      }
      close(fd);
    }
  }
#else
  (void)req;
  (void)file;
  (void)fi;
#endif
  std::lock_guard lock(server.modes.mu);
  InodeModes::Modes& m = server.modes.by_ino[ino];
  if (m.n_passthrough > 0) {
#ifdef UCPFS_HAVE_PASSTHROUGH
    if (!file.passthrough) {  // a view passed through meanwhile by another open: join it
      ++m.n_passthrough;
      fi->backing_id = m.backing_id;
      *passthrough = true;
      return 0;
    }
#endif
    return ETXTBSY;
  }
  ++m.n_other;
  return 0;
}

// Gives back the backing id of an inode whose last passthrough open went.
void CloseBacking(fuse_req_t req, int backing_id) {
#ifdef UCPFS_HAVE_PASSTHROUGH
  if (backing_id > 0) fuse_passthrough_close(req, backing_id);
#else
  (void)req;
  (void)backing_id;
#endif
}

void OpOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Handle(req, "open", [&] {
    Server& server = ServerOf(req);
    const bool write = (fi->flags & O_ACCMODE) != O_RDONLY;
    // A rewrite (O_TRUNC) starts a capture served by the daemon: refused while the inode passes
    // through (the kernel would fail the open after the capture began).
    if (Passthrough::Owns(ino) && write && (fi->flags & O_TRUNC) != 0 &&
        !server.modes.WaitNoPassthrough(ino, kReleaseGrace)) {
      return ETXTBSY;
    }
    // Views need no caller: they are read-only, and the kernel checked access (default_permissions).
    Result<OpenFile> file = Passthrough::Owns(ino) ? FsOf(req).Open(ino, fi->flags, CallerOf(req))
                                                   : FsOf(req).Open(ino, fi->flags);
    if (!file.ok()) return ErrnoFromStatus(file.error());
    bool passthrough = false;
    int err = ChooseMode(req, server, ino, *file, fi, &passthrough);
    if (err == ETXTBSY && server.modes.WaitNoPassthrough(ino, kReleaseGrace)) {
      err = ChooseMode(req, server, ino, *file, fi, &passthrough);  // the conflicting open was closed
    }
    if (err != 0) {
      (void)FsOf(req).Release(*file);
      return err;
    }
    if (passthrough) {
      if (server.report) server.report->CountPassthroughOpen(!file->passthrough);
    } else if (file->passthrough) {
      SourceOpenFlags(fi, file->passthrough->writable);
    } else if (file->volatile_content) {
      fi->direct_io = 1;  // produced at open time: never serve stale cached pages
    } else {
      fi->keep_cache = 1;  // content never changes: keep pages across opens
    }
    // Nothing to flush on close: skip the FLUSH round trip; but a file being saved hears of each
    // close(2) before it returns (its RELEASE comes later: `ucpfs sync` waits for it).
    fi->noflush = file->passthrough && file->passthrough->captured && file->passthrough->writable ? 0 : 1;
    auto handle = std::make_unique<OpenFileHandle>(std::move(*file));
    handle->kernel_passthrough = passthrough;
    OpenHandle* raw = server.handles.Adopt(std::move(handle));
    fi->fh = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(raw));
    // A failed reply means the open was interrupted; no release will come for it.
    if (fuse_reply_open(req, fi) != 0) {
      (void)FsOf(req).Release(static_cast<OpenFileHandle*>(raw)->file);
      CloseBacking(req, server.modes.Drop(ino, passthrough));
      server.handles.Destroy(raw);
    }
    return 0;
  });
}

// Reads the located pieces into the buffer (a reply that cannot be spliced). Errors: kIo naming
// the file's offset.
Status ReadLocated(std::span<const LocatedPiece> pieces) {
  for (const LocatedPiece& p : pieces) {
    size_t done = 0;
    while (done < p.n_bytes) {
      const ssize_t n = pread(p.where.fd, p.out + done, p.n_bytes - done,
                              static_cast<off_t>(p.where.byte_offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = n < 0 ? errno : EIO;
        return IoError("pread at offset " + std::to_string(p.where.byte_offset + done) + ": " + std::strerror(err),
                       err);
      }
      done += static_cast<size_t>(n);
    }
  }
  return Status::Ok();
}

// Replies with [data, data + n_bytes) where each located piece's bytes come from its file
// (spliced: see "spliced replies"). Returns the bytes spliced (0: replied from memory).
uint64_t ReplySpliced(fuse_req_t req, std::byte* data, size_t n_bytes, const std::vector<LocatedPiece>& pieces) {
  thread_local std::vector<const LocatedPiece*> order;
  order.clear();
  for (const LocatedPiece& p : pieces) order.push_back(&p);
  std::sort(order.begin(), order.end(), [](const LocatedPiece* a, const LocatedPiece* b) { return a->out < b->out; });
  // The buffers, memory and descriptor ones in byte order; adjacent pieces of one file merged.
  thread_local std::vector<fuse_buf> bufs;
  bufs.clear();
  std::byte* pos = data;
  uint64_t spliced = 0;
  bool ok = true;
  for (const LocatedPiece* p : order) {
    if (p->out < pos || p->out + p->n_bytes > data + n_bytes) {  // overlapping or outside: never expected
      ok = false;
      break;
    }
    if (p->out > pos) {
      fuse_buf mem = {};
      mem.size = static_cast<size_t>(p->out - pos);
      mem.mem = pos;
      bufs.push_back(mem);
    }
    fuse_buf* last = bufs.empty() ? nullptr : &bufs.back();
    if (last != nullptr && (last->flags & FUSE_BUF_IS_FD) != 0 && last->fd == p->where.fd && p->out == pos &&
        static_cast<uint64_t>(last->pos) + last->size == p->where.byte_offset) {
      last->size += p->n_bytes;
    } else {
      fuse_buf fd_buf = {};
      fd_buf.size = p->n_bytes;
      fd_buf.flags = static_cast<fuse_buf_flags>(FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK | FUSE_BUF_FD_RETRY);
      fd_buf.fd = p->where.fd;
      fd_buf.pos = static_cast<off_t>(p->where.byte_offset);
      bufs.push_back(fd_buf);
    }
    spliced += p->n_bytes;
    pos = p->out + p->n_bytes;
  }
  if (ok && pos < data + n_bytes) {
    fuse_buf mem = {};
    mem.size = static_cast<size_t>(data + n_bytes - pos);
    mem.mem = pos;
    bufs.push_back(mem);
  }
  if (!ok) {
    const Status read = ReadLocated(pieces);
    if (!read.ok()) {
      fuse_reply_err(req, ErrnoFromStatus(read));
      return 0;
    }
    fuse_reply_buf(req, reinterpret_cast<const char*>(data), n_bytes);
    return 0;
  }
  // fuse_bufvec ends in a one-element array: room for bufs.size() of them.
  thread_local std::vector<std::max_align_t> storage;
  const size_t bytes = sizeof(fuse_bufvec) + (bufs.size() - 1) * sizeof(fuse_buf);
  storage.resize((bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t));
  auto* bufv = new (storage.data()) fuse_bufvec{};
  bufv->count = bufs.size();
  std::copy(bufs.begin(), bufs.end(), bufv->buf);
  // Answers the request whatever happens (an error reply when the send fails).
  if (fuse_reply_data(req, bufv, static_cast<fuse_buf_copy_flags>(0)) != 0) return 0;
  return spliced;
}

void OpRead(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  NoteTransport(req);
  Handle(req, "read", [&] {
    const OpenFile& file = HandleOf<OpenFileHandle>(fi)->file;
    if (off < 0) return EINVAL;
    if (file.passthrough) {  // a source file: its size is not fixed
      thread_local std::vector<std::byte> source_buffer;
      if (source_buffer.size() < size) source_buffer.resize(size);
      Result<size_t> n = FsOf(req).Read(file, static_cast<uint64_t>(off), std::span(source_buffer.data(), size));
      if (!n.ok()) return ErrnoFromStatus(n.error());
      fuse_reply_buf(req, reinterpret_cast<const char*>(source_buffer.data()), *n);
      return 0;
    }
    // A view read: --materialize's builds pause for it (not for the control files).
    if (Materializer* m = ServerOf(req).materialize.get(); m != nullptr && !file.volatile_content) {
      m->NoteForegroundRead();
    }
    // One buffer per worker thread, grown to the largest request seen (max_read): no
    // allocation per request. fuse_reply_buf writes it to /dev/fuse before returning.
    thread_local std::vector<std::byte> buffer;
    const auto byte_offset = static_cast<uint64_t>(off);
    const size_t wanted = byte_offset >= file.n_bytes
                              ? 0
                              : static_cast<size_t>(std::min<uint64_t>(size, file.n_bytes - byte_offset));
    if (buffer.size() < wanted) buffer.resize(wanted);
    Filesystem& fs = FsOf(req);
    Server& server = ServerOf(req);
    // Plain source bytes left unread, to be spliced into the reply (see "spliced replies").
    std::optional<LocateScope> locate;
    if (server.splice_on.load(std::memory_order_relaxed) && !file.volatile_content && !IsUring(req)) {
      locate.emplace(kMinSplicedPieceBytes, server.max_spliced_pieces);
    }
    Result<size_t> n_bytes = fs.Read(file, byte_offset, std::span(buffer.data(), wanted));
    if (!n_bytes.ok()) return ErrnoFromStatus(n_bytes.error());
    // Read-ahead runs after the reply, so the reader is not kept waiting. Once the reply is out
    // the kernel may release the handle on another thread: keep what read-ahead uses.
    std::optional<OpenFile> ahead;
    if (file.prefetched_until) ahead = file;
    if (locate && !locate->pieces().empty()) {
      const uint64_t spliced = ReplySpliced(req, buffer.data(), *n_bytes, locate->pieces());
      if (spliced != 0 && server.report) server.report->CountSplicedReply(spliced);
    } else {
      fuse_reply_buf(req, reinterpret_cast<const char*>(buffer.data()), *n_bytes);
    }
    locate.reset();  // lets go of the source files
    if (ahead) fs.ReadAhead(*ahead, byte_offset, *n_bytes);
    return 0;
  });
}

void OpRelease(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  OpenFileHandle* handle = HandleOf<OpenFileHandle>(fi);
  // The last close: its error went to flush (close(2)); a later flush error to fsync/sync.
  (void)FsOf(req).Release(handle->file);
  CloseBacking(req, ServerOf(req).modes.Drop(ino, handle->kernel_passthrough));
  ServerOf(req).handles.Destroy(handle);
  fuse_reply_err(req, 0);
}

void OpOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Handle(req, "opendir", [&] {
    Result<DirListing> listing = FsOf(req).OpenDir(ino);
    if (!listing.ok()) return ErrnoFromStatus(listing.error());
    if (listing->cacheable) {
      fi->cache_readdir = 1;  // listings never change: let the kernel cache them
      fi->keep_cache = 1;
    }
    ReplyOpen(req, fi, std::make_unique<OpenDirHandle>(std::move(*listing)));
    return 0;
  });
}

void ReadDir(fuse_req_t req, size_t size, off_t off, fuse_file_info* fi, bool plus) {
  Handle(req, plus ? "readdirplus" : "readdir", [&] {
    Filesystem& fs = FsOf(req);
    const DirListing& dir = HandleOf<OpenDirHandle>(fi)->listing;
    if (off < 0) return EINVAL;
    std::vector<char> buf(size);
    size_t used = 0;
    std::vector<Ino> referenced;  // entries the kernel will count, once the reply is out
    // Offsets are snapshot indices: the entry at index i carries offset i + 1 ("next").
    for (auto i = static_cast<size_t>(off); i < dir.items.size(); ++i) {
      const DirListing::Item& item = dir.items[i];
      const auto next = static_cast<off_t>(i + 1);
      size_t n_bytes;
      // "." and ".." are not looked up by the kernel (their lookup count is not taken).
      if (plus && item.name != "." && item.name != "..") {
        std::optional<Entry> entry;
        if (item.by_name) {  // a source entry: looked up (one reference) by name
          Result<Entry> found = fs.Lookup(dir.items[0].ino, item.name);
          if (found.ok() && found->ino != 0) entry = *found;
        } else {
          entry = fs.Reference(item.ino);
        }
        if (!entry) continue;  // gone since opendir (an evicted subtree, a removed file)
        const bool root = dir.items[0].ino == kRootIno && fs.HasPassthrough();
        const fuse_entry_param e = EntryParam(*entry, kCacheTimeoutS, root);
        n_bytes = fuse_add_direntry_plus(req, buf.data() + used, size - used, item.name.c_str(), &e, next);
        if (n_bytes > size - used) {
          fs.Forget(entry->ino, 1);
          break;  // full: the kernel asks again from `next`
        }
        referenced.push_back(entry->ino);
      } else {
        std::optional<struct stat> st;
        if (item.by_name) {  // readdir needs only the number and type
          st.emplace();
          st->st_ino = item.ino != 0 ? item.ino : (kPassthroughBit >> 1) + i;
          st->st_mode = item.type;
        } else {
          st = fs.StatOf(item.ino);
        }
        if (!st) continue;
        if (plus) {
          fuse_entry_param e = {};
          e.attr = *st;
          n_bytes = fuse_add_direntry_plus(req, buf.data() + used, size - used, item.name.c_str(), &e, next);
        } else {
          n_bytes = fuse_add_direntry(req, buf.data() + used, size - used, item.name.c_str(), &*st, next);
        }
        if (n_bytes > size - used) break;
      }
      used += n_bytes;
    }
    if (fuse_reply_buf(req, buf.data(), used) != 0) {
      for (Ino ino : referenced) fs.Forget(ino, 1);
    }
    return 0;
  });
}

void OpReaddir(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  ReadDir(req, size, off, fi, /*plus=*/false);
}

void OpReaddirplus(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  ReadDir(req, size, off, fi, /*plus=*/true);
}

void OpReleasedir(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  ServerOf(req).handles.Destroy(HandleOf<OpenDirHandle>(fi));
  fuse_reply_err(req, 0);
}

void OpStatfs(fuse_req_t req, fuse_ino_t) {
  Handle(req, "statfs", [&] {
    const struct statvfs sv = FsOf(req).StatFs();
    fuse_reply_statfs(req, &sv);
    return 0;
  });
}

// xattrs: `user.*` of source files, as the caller; views have none. A read-only mount (no
// source) answers ENOTSUP for every set.
void OpSetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, const char* value, size_t size, int flags) {
  Handle(req, "setxattr", [&] {
    const Status s = FsOf(req).SetXattr(ino, name, std::span(reinterpret_cast<const std::byte*>(value), size), flags,
                                        CallerOf(req));
    if (!s.ok()) return ErrnoFromStatus(s);
    fuse_reply_err(req, 0);
    return 0;
  });
}

// size 0 asks for the size only.
void ReplyXattr(fuse_req_t req, size_t size, const std::vector<std::byte>& value) {
  if (size == 0) {
    fuse_reply_xattr(req, value.size());
  } else {
    fuse_reply_buf(req, reinterpret_cast<const char*>(value.data()), value.size());
  }
}

void OpGetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, size_t size) {
  Handle(req, "getxattr", [&] {
    Result<std::vector<std::byte>> value = FsOf(req).GetXattr(ino, name, size, CallerOf(req));
    if (!value.ok()) return ErrnoFromStatus(value.error());
    if (size != 0 && value->size() > size) return ERANGE;
    ReplyXattr(req, size, *value);
    return 0;
  });
}

void OpListxattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
  Handle(req, "listxattr", [&] {
    Result<std::vector<std::byte>> names = FsOf(req).ListXattr(ino, size, CallerOf(req));
    if (!names.ok()) return ErrnoFromStatus(names.error());
    if (size != 0 && names->size() > size) return ERANGE;
    ReplyXattr(req, size, *names);
    return 0;
  });
}

void OpRemovexattr(fuse_req_t req, fuse_ino_t ino, const char* name) {
  Handle(req, "removexattr", [&] {
    const Status s = FsOf(req).RemoveXattr(ino, name, CallerOf(req));
    if (!s.ok()) return ErrnoFromStatus(s);
    fuse_reply_err(req, 0);
    return 0;
  });
}

void OpAccess(fuse_req_t req, fuse_ino_t ino, int mask) {
  Handle(req, "access", [&] {
    const Status status = FsOf(req).Access(ino, mask);
    if (!status.ok()) return ErrnoFromStatus(status);
    fuse_reply_err(req, 0);
    return 0;
  });
}

// The op table: the only place handlers are wired. Designated initializers in declaration
// order, so the compiler checks every name and the order; every member is listed, nullptr
// meaning "libfuse answers ENOSYS" (the kernel then stops sending that request, e.g. flush).
const fuse_lowlevel_ops kOps = {
    .init = OpInit,
    .destroy = nullptr,
    .lookup = OpLookup,
    .forget = OpForget,
    .getattr = OpGetattr,
    .setattr = OpSetattr,
    .readlink = OpReadlink,
    .mknod = OpMknod,
    .mkdir = OpMkdir,
    .unlink = OpUnlink,
    .rmdir = OpRmdir,
    .symlink = OpSymlink,
    .rename = OpRename,
    .link = OpLink,
    .open = OpOpen,
    .read = OpRead,
    .write = OpWrite,
    .flush = OpFlush,
    .release = OpRelease,
    .fsync = OpFsync,
    .opendir = OpOpendir,
    .readdir = OpReaddir,
    .releasedir = OpReleasedir,
    .fsyncdir = nullptr,
    .statfs = OpStatfs,
    .setxattr = OpSetxattr,
    .getxattr = OpGetxattr,
    .listxattr = OpListxattr,
    .removexattr = OpRemovexattr,
    .access = OpAccess,
    .create = OpCreate,
    .getlk = nullptr,  // local locks only
    .setlk = nullptr,
    .bmap = nullptr,
    .ioctl = nullptr,
    .poll = nullptr,
    .write_buf = nullptr,  // writes come through .write; no splice
    .retrieve_reply = nullptr,
    .forget_multi = OpForgetMulti,
    .flock = nullptr,
    .fallocate = OpReadOnly,
    .readdirplus = OpReaddirplus,
    .copy_file_range = nullptr,
    .lseek = nullptr,  // default SEEK_SET/CUR/END are done by the kernel
#if FUSE_VERSION >= FUSE_MAKE_VERSION(3, 16)
    .tmpfile = nullptr,
#endif
#if FUSE_VERSION >= FUSE_MAKE_VERSION(3, 18)
    .statx = nullptr,  // the kernel asks getattr
#endif
};

// ---- mounting ----

// libfuse splits -o values on ',' and treats '\' as an escape.
std::string EscapeOptionValue(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == ',' || c == '\\') out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

// Finds "max_read=N" among the comma-separated options; 0 when absent.
Result<uint32_t> MaxReadFromOptions(const std::vector<std::string>& options) {
  uint32_t max_read = 0;
  for (const std::string& group : options) {
    std::string_view rest = group;
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      const std::string_view opt = rest.substr(0, comma);
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
      constexpr std::string_view kKey = "max_read=";
      if (!opt.starts_with(kKey)) continue;
      const std::string_view value = opt.substr(kKey.size());
      uint32_t parsed = 0;
      const auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), parsed);
      if (ec != std::errc() || ptr != value.data() + value.size() || parsed == 0) {
        return InvalidArgumentError("bad mount option '" + std::string(opt) + "'");
      }
      max_read = parsed;
    }
  }
  return max_read;
}

// Runs once the session loop is up: waits until the mount answers (stat of its root goes
// through INIT and GETATTR), raises the mount's readahead window to the request size (the
// kernel sets the bdi's window at INIT, so it can only be raised afterwards; needs root, else
// silently skipped), then signals readiness on ready_fd (see MountOptions::ready_fd).
// Returns 0 once live, else the errno of the failed stat.
int AnnounceWhenLive(const std::string& mountpoint, int ready_fd, uint32_t readahead_bytes) {
  // Signals belong to the loop threads (libfuse's handlers end the session).
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);

  struct stat st = {};
  int rc;
  do {
    rc = stat(mountpoint.c_str(), &st);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return errno;
  const std::string bdi = "/sys/class/bdi/" + std::to_string(major(st.st_dev)) + ":" +
                          std::to_string(minor(st.st_dev)) + "/read_ahead_kb";
  if (FILE* f = std::fopen(bdi.c_str(), "w")) {
    std::fprintf(f, "%u\n", readahead_bytes / 1024);
    std::fclose(f);
  }
  if (ready_fd >= 0) {
    const char byte = 'R';
    while (write(ready_fd, &byte, 1) < 0 && errno == EINTR) {
    }
    // Release the pipe but keep the number valid: it belongs to the caller.
    const int devnull = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (devnull >= 0) {
      dup3(devnull, ready_fd, O_CLOEXEC);
      close(devnull);
    }
  }
  return 0;
}

}  // namespace

Status ServeTree(std::shared_ptr<const Tree> tree, const MountOptions& options) {
  // Failures before the mount is live leave options.ready_fd untouched (the caller reports).
  if (tree == nullptr) return InvalidArgumentError("ServeTree: no tree");
  const std::string& mountpoint = options.mountpoint;
  if (mountpoint.empty()) return InvalidArgumentError("no mountpoint given");
  struct stat st = {};
  if (stat(mountpoint.c_str(), &st) != 0) {
    const int err = errno;
    return Status(StatusCode::kInvalidArgument,
                  "mountpoint " + mountpoint + ": " + std::strerror(err), err);
  }
  if (!S_ISDIR(st.st_mode)) {
    return Status(StatusCode::kInvalidArgument,
                  "mountpoint " + mountpoint + ": not a directory", ENOTDIR);
  }
  Result<uint32_t> user_max_read = MaxReadFromOptions(options.fuse_options);
  if (!user_max_read.ok()) return user_max_read.error();

  FilesystemOptions fs_options;
  fs_options.uid = getuid();
  fs_options.gid = getgid();
  fs_options.dynamic_dir = options.dynamic_dir;
  fs_options.resolve = options.resolve;
  fs_options.list = options.list;
  fs_options.passthrough = options.passthrough;
  fs_options.bucket = options.passthrough ? options.bucket : nullptr;
  fs_options.read_ahead_bytes = options.source_read_ahead_bytes;
  fs_options.report = options.report;
  Server server;
  UCPFS_ASSIGN_OR_RETURN(server.fs, Filesystem::Make(std::move(tree), std::move(fs_options)));
#ifdef UCPFS_HAVE_PASSTHROUGH
  server.passthrough_wanted = options.kernel_passthrough;
#endif
  server.materialize = options.materialize;
  server.report = options.report;
  if (server.report && server.materialize) {
    server.report->SetMaterializeStats([m = server.materialize] { return m->Stats(); });
  }
  server.max_read_bytes = *user_max_read != 0 ? *user_max_read : kDefaultMaxReadBytes;
  // Spliced replies need a pipe that holds a whole reply (see "spliced replies").
  if (SpliceRepliesOff()) {
    server.splice_why = "turned off (UCPFS_READ_PATH in the environment)";
  } else if (!options.spliceable_sources) {
    server.splice_why = "the sources are not local files";
  } else {
    const size_t pipe_bytes = PipeCapacityBytes(server.max_read_bytes + kSpliceSlackBytes);
    if (pipe_bytes < server.max_read_bytes + kSpliceSlackBytes && *user_max_read == 0 &&
        pipe_bytes >= kMinSplicedMaxReadBytes + kSpliceSlackBytes) {
      server.max_read_bytes = static_cast<uint32_t>((pipe_bytes - kSpliceSlackBytes) & ~size_t{0xffff});
    }
    if (pipe_bytes >= server.max_read_bytes + kSpliceSlackBytes) {
      // Slots a reply may take besides its payload's pages: the header, and per piece up to two
      // partial pages of its own and one of the memory buffer after it.
      const size_t spare_slots = (pipe_bytes - server.max_read_bytes) / kPipePageBytes;
      server.max_spliced_pieces = std::min(kMaxSplicedPieces, (spare_slots - 3) / 3);
      server.splice_wanted = true;
    } else {
      server.splice_why = "a pipe of " + std::to_string(pipe_bytes) + " bytes cannot hold a reply of max_read " +
                          std::to_string(server.max_read_bytes) +
                          " (fs.pipe-max-size, or CAP_SYS_RESOURCE, would allow a larger pipe)";
    }
  }
  if (options.started) options.started(server.fs.get());

  std::vector<std::string> arg_strings = {
      "ucpfs",
      "-o", "fsname=" + EscapeOptionValue(options.fsname.empty() ? "ucpfs" : options.fsname),
      "-o", "subtype=ucpfs",
      "-o", "default_permissions",
  };
  if (!options.passthrough) arg_strings.insert(arg_strings.end(), {"-o", "ro"});
#if FUSE_VERSION >= FUSE_MAKE_VERSION(3, 18) && UCPFS_LIBFUSE_URING
  // FUSE over io_uring where the kernel offers it (OpInit says whether it did).
  arg_strings.insert(arg_strings.end(), {"-o", "io_uring"});
#endif
  if (*user_max_read == 0) {
    arg_strings.insert(arg_strings.end(),
                       {"-o", "max_read=" + std::to_string(server.max_read_bytes)});
  }
  for (const std::string& opt : options.fuse_options) {
    if (!opt.empty()) arg_strings.insert(arg_strings.end(), {"-o", opt});
  }
  std::vector<char*> argv;
  for (std::string& s : arg_strings) argv.push_back(s.data());
  argv.push_back(nullptr);
  fuse_args args = FUSE_ARGS_INIT(static_cast<int>(arg_strings.size()), argv.data());

  fuse_session* se = fuse_session_new(&args, &kOps, sizeof(kOps), &server);
  fuse_opt_free_args(&args);
  if (se == nullptr) {
    std::string joined;
    for (const std::string& opt : options.fuse_options) joined += " -o " + opt;
    return InvalidArgumentError("fuse_session_new failed (bad mount option?):" + joined);
  }
  if (fuse_set_signal_handlers(se) != 0) {
    fuse_session_destroy(se);
    return InternalError("fuse_set_signal_handlers failed");
  }
  // As root, mount(2) here and give libfuse the descriptor (direct_mount.h): no mount(8) run.
  DirectMountRequest direct;
  direct.mountpoint = mountpoint;
  direct.fsname = options.fsname.empty() ? "ucpfs" : options.fsname;
  direct.subtype = "ucpfs";
  direct.read_only = !options.passthrough;
  direct.max_read_bytes = server.max_read_bytes;
  direct.user_options = std::any_of(options.fuse_options.begin(), options.fuse_options.end(),
                                    [](const std::string& o) { return !o.empty(); });
  const int direct_fd = DirectMount(direct);
  const std::string session_mountpoint = direct_fd >= 0 ? "/dev/fd/" + std::to_string(direct_fd) : mountpoint;
  errno = 0;
  if (fuse_session_mount(se, session_mountpoint.c_str()) != 0) {
    const int err = errno != 0 ? errno : EIO;
    if (direct_fd >= 0) {
      DirectUnmount(direct_fd, mountpoint);
      ::close(direct_fd);
    }
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    return IoError("mounting at " + mountpoint + " failed", err);
  }
#ifdef UCPFS_PATCH_PARALLEL_DIROPS
  // Same fd, libfuse's own mount and unmount: only the reads and writes go through the hooks.
  const fuse_custom_io device_io = {.writev = DeviceWritev, .read = DeviceRead, .splice_receive = nullptr,
                                    .splice_send = nullptr};
  if (const int rc = fuse_session_custom_io(se, &device_io, fuse_session_fd(se)); rc != 0) {
    fuse_session_unmount(se);
    if (direct_fd >= 0) DirectUnmount(direct_fd, mountpoint);
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    return IoError("fuse_session_custom_io failed", -rc);
  }
#endif

  int announce_errno = EIO;
  std::thread announcer([&] {
    announce_errno = AnnounceWhenLive(mountpoint, options.ready_fd,
                                      options.readahead_bytes != 0 ? options.readahead_bytes : server.max_read_bytes);
  });

  fuse_loop_config* config = fuse_loop_cfg_create();
  fuse_loop_cfg_set_clone_fd(config, 0);
  fuse_loop_cfg_set_max_threads(config, static_cast<unsigned>(std::max(1, options.max_threads)));
  // max_idle_threads stays at libfuse's default (-1: idle workers are kept, never re-spawned
  // per request burst; libfuse discourages other values).
  const int loop_rc = fuse_session_loop_mt(se, config);
  fuse_loop_cfg_destroy(config);

  fuse_session_unmount(se);  // nothing, for a direct mount (libfuse never knew its path)
  if (direct_fd >= 0) DirectUnmount(direct_fd, mountpoint);
  fuse_remove_signal_handlers(se);
  // Closing /dev/fuse aborts the connection, so an announcer still waiting in stat() returns.
  fuse_session_destroy(se);
  announcer.join();
  // The builds read the views' sources: stopped before the Filesystem goes (the caller may
  // keep the Materializer itself).
  if (server.materialize) server.materialize->Stop();
  server.handles.DestroyAll();  // files still open at unmount get no RELEASE

  // loop_rc > 0 is the signal that ended the session (SIGINT/SIGTERM): a clean shutdown.
  if (loop_rc < 0) return IoError("serving " + mountpoint + " failed", -loop_rc);
  if (announce_errno != 0) {
    return IoError("the mount at " + mountpoint + " never answered: " +
                       std::strerror(announce_errno),
                   announce_errno);
  }
  return Status::Ok();
}

std::string LinkedFuseText() {
  std::string text = std::string("libfuse ") + fuse_pkgversion();
  std::vector<std::string> paths;
#ifdef UCPFS_HAVE_PASSTHROUGH
  paths.push_back("passthrough");
#endif
#if FUSE_VERSION >= FUSE_MAKE_VERSION(3, 18) && UCPFS_LIBFUSE_URING
  paths.push_back("io_uring");
#endif
  if (paths.empty()) return text + " (the kernel's fast paths off: passthrough needs libfuse >= 3.17, io_uring >= 3.18)";
  text += " (fast paths: ";
  for (size_t i = 0; i < paths.size(); ++i) text += (i == 0 ? "" : ", ") + paths[i];
  return text + "; each used where the kernel offers it)";
}

Status Unmount(const std::string& mountpoint) {
  if (umount2(mountpoint.c_str(), 0) == 0) return Status::Ok();
  const int err = errno;
  // Not root (EPERM), or a mount only fusermount3 may remove: let the setuid helper try.
  if (err != EBUSY && err != EINVAL && err != EPERM) {
    return IoError("unmounting " + mountpoint + ": " + std::strerror(err), err);
  }
  std::string target = mountpoint;
  if (!target.empty() && target[0] == '-') target = "./" + target;  // not an option
  std::string prog = "fusermount3", flag = "-u";
  char* argv[] = {prog.data(), flag.data(), target.data(), nullptr};
  pid_t pid = 0;
  const int spawn_err = posix_spawnp(&pid, "fusermount3", nullptr, nullptr, argv, environ);
  if (spawn_err != 0) {
    return IoError("unmounting " + mountpoint + ": " + std::strerror(err) +
                       "; cannot run fusermount3: " + std::strerror(spawn_err),
                   err);
  }
  int wstatus = 0;
  while (waitpid(pid, &wstatus, 0) < 0) {
    if (errno != EINTR) return IoError("unmounting " + mountpoint + ": waitpid", errno);
  }
  if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) return Status::Ok();
  return IoError("unmounting " + mountpoint + ": " + std::strerror(err) +
                     "; fusermount3 -u failed too",
                 err);
}

}  // namespace ucpfs::fs
