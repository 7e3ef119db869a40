// The FUSE server's per-session state and the helpers its request handlers share, for the
// files that serve a Filesystem through the libfuse3 low-level API: fuse_server.cc (INIT, who is
// asking, shared replies), fuse_ops.cc (the namespace, directory, attribute and xattr
// handlers and the ops table), fuse_read.cc (open, read and release: passthrough, spliced and
// copied replies) and fuse_mount.cc (mounting, the session loop). Internal to fs/.
//
// Invariants (every handler):
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
#pragma once

// API 3.12 (= FUSE_MAKE_VERSION(3, 12)): below it, fuse_session_loop_mt() binds to the 3.2 entry
// point, which reads the opaque fuse_loop_cfg_create() object as the old public struct (clone_fd,
// max_idle_threads garbage: a thread per request).
#define FUSE_USE_VERSION 312
#include <fuse_lowlevel.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "fs/caller.h"
#include "fs/filesystem.h"
#include "fs/fuse_mount.h"
#include "fs/passthrough.h"

namespace ucpfs::fs::fuse_server {

// Views are immutable: the kernel may cache names, attributes and negative lookups for long.
constexpr double kCacheTimeoutS = 3600.0;
// Largest FUSE read request. libfuse 3.14's receive buffer holds 256 pages, and the kernel's
// max_pages_limit is 256 by default, so 1 MiB is the most one request can carry.
constexpr uint32_t kDefaultMaxReadBytes = 1u << 20;
// Asynchronous requests (read-ahead, async direct I/O) the kernel keeps in flight to the daemon:
// at least kMinMaxBackground, and room for kReadAheadWindowsInFlight read-ahead windows of
// max_read requests (MaxBackground). The kernel's default is 12 in flight, congested at 9: an
// 8 MiB window is 10 requests of 896 KiB, so a page fault's read-ahead found the connection
// congested and skipped the next window, and mmap loads stalled on each one (cold
// `torch.load(mmap=True)` 1.31 s with 12, 1.15 s with 64; docs/benchmarks.md).
constexpr uint32_t kMinMaxBackground = 64;
constexpr uint32_t kReadAheadWindowsInFlight = 4;
constexpr uint32_t kMaxMaxBackground = 1024;
// The kernel's congestion threshold (read-ahead skipped above it): 3/4 of max_background, as its
// own default (9 of 12).
constexpr uint32_t CongestionThreshold(uint32_t max_background) { return max_background * 3 / 4; }
uint32_t MaxBackground(uint32_t readahead_bytes, uint32_t max_read_bytes);

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
bool SpliceRepliesOff();

// The largest pipe this process can make, up to `want_bytes` (0 when it cannot make one).
size_t PipeCapacityBytes(size_t want_bytes);

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

// With --materialize, the smallest view file whose open that queues its copy's build reads it
// direct_io (OpOpen). Such an open has no read-ahead: a reader taking 4 KiB at a time gets 0.14 GB/s where
// the cached open's read-ahead gives 1.2 GB/s (1 MiB reads: 4.2 against 2.4 GB/s). Small files,
// read in small pieces more often (pickles, configs, many small tensors) and cheap to cache
// twice, keep the page cache.
constexpr uint64_t kDirectFirstOpenMinBytes = uint64_t{32} << 20;

// How long an open that conflicts with a passthrough open waits for that open's RELEASE
// (InodeModes::WaitNoPassthrough) before it is refused with ETXTBSY.
constexpr std::chrono::milliseconds kReleaseGrace{200};

struct Server {
  std::unique_ptr<Filesystem> fs;
  bool passthrough_wanted = false;          // MountOptions::passthrough (and libfuse >= 3.17)
  std::atomic<bool> passthrough_on{false};  // negotiated at INIT
  std::shared_ptr<Materializer> materialize;
  // With --materialize, agreed at INIT (FUSE_CAP_DIRECT_IO_ALLOW_MMAP, so MAP_SHARED still maps
  // a direct_io file): the open of a view (kDirectFirstOpenMinBytes or more) that queues its
  // copy's build reads it direct_io, straight into the reader's buffer, when no other open of it
  // is served by the daemon (OpOpen).
  std::atomic<bool> direct_first_open{false};
  std::shared_ptr<MountReport> report;
  InodeModes modes;
  uint32_t max_read_bytes = kDefaultMaxReadBytes;
  uint32_t max_background = kMinMaxBackground;  // MaxBackground of the mount's read-ahead; sent at INIT
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

inline Server& ServerOf(fuse_req_t req) { return *static_cast<Server*>(fuse_req_userdata(req)); }
inline Filesystem& FsOf(fuse_req_t req) { return *ServerOf(req).fs; }

template <typename T>
T* HandleOf(const fuse_file_info* fi) {
  return static_cast<T*>(reinterpret_cast<OpenHandle*>(static_cast<uintptr_t>(fi->fh)));
}

// Registers `handle`, stores it in fi->fh and replies to the open(dir) request.
inline void ReplyOpen(fuse_req_t req, fuse_file_info* fi, std::unique_ptr<OpenHandle> handle) {
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

inline double TimeoutOf(Ino ino) { return Passthrough::Owns(ino) ? kSourceTimeoutS : kCacheTimeoutS; }

// `short_names`: names of the mount's root, whose views a new generation replaces (Swap), so the
// kernel asks again within a second.
inline fuse_entry_param EntryParam(const Entry& entry, double negative_timeout = kCacheTimeoutS, bool short_names = false) {
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
int ReplyEntry(fuse_req_t req, Filesystem& fs, const Entry& entry);

// Who sent `req`: its fsuid, fsgid, umask and (when the daemon will switch to it) supplementary
// groups. A root daemon acts as every other caller (fs/caller.h); a request from the daemon's own
// user and group needs no switch.
Caller CallerOf(fuse_req_t req);

// A request that came through FUSE over io_uring (libfuse >= 3.18) is counted (status).
void NoteTransport(fuse_req_t req);
bool IsUring(fuse_req_t req);

// Options of an open source file: written ones bypass the page cache (the capture holds their
// bytes; no second copy), read ones drop stale pages at open.
void SourceOpenFlags(fuse_file_info* fi, bool writable);

// INIT: what the session asks of the kernel (fuse_server.cc).
void OpInit(void* userdata, fuse_conn_info* conn);
// The file data path (fuse_read.cc).
void OpOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi);
void OpRead(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi);
void OpRelease(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi);

// Every handler (fuse_ops.cc).
extern const fuse_lowlevel_ops kOps;

}  // namespace ucpfs::fs::fuse_server
