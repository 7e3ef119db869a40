// The FUSE server's file data path: open (choosing passthrough, cached or direct_io per inode:
// InodeModes), read (spliced replies of located source pages, or copied ones) and release. See
// fuse_server.h for the handlers' contract and "spliced replies" there.
#include "fs/fuse_server.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/io/beneath.h"
#include "fs/errno_map.h"
#include "fs/materialize.h"
#include "fs/mount_report.h"

namespace ucpfs::fs::fuse_server {
namespace {

#ifdef UCPFS_HAVE_PASSTHROUGH
// A descriptor of the file an open of `file` may pass through to, or -1 when it may not: a
// source file not being captured (opened for writing only when the daemon has nothing to do at
// its first write), reopened by the daemon read-write where it can, so later writable opens can
// join the same backing; or a view's materialised copy once it is built (until then the open
// is served by the daemon, and its build is queued behind it: fs/materialize.h).
// `writable` says whether the descriptor is open for writing; `queued_now` whether it is -1
// because this open found no copy of the view and queued its build (the first open since the
// view had none).
int BackingFdOf(Server& server, const OpenFile& file, bool* writable, bool* queued_now) {
  *writable = false;
  *queued_now = false;
  if (const auto& h = file.passthrough) {
    if (h->captured != nullptr || h->fd < 0 || (h->writable && h->kill_privs.load())) return -1;
    const std::string proc = io::ProcFdPath(h->fd);
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
  Result<int> fd = server.materialize->Open(node, file.source, queued_now);
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
// passes through to a backing file this open cannot share (InodeModes). *first_of_build: served
// by the daemon, the open that queued the view's build, and no other open of the inode is.
int ChooseMode(fuse_req_t req, Server& server, Ino ino, const OpenFile& file, fuse_file_info* fi, bool* passthrough,
               bool* first_of_build) {
  *passthrough = false;
  *first_of_build = false;
  bool queued_now = false;
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
    const int fd = BackingFdOf(server, file, &backing_writable, &queued_now);  // may queue a build: no lock held
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
  *first_of_build = queued_now && m.n_other == 0;
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

}  // namespace

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
    bool first_of_build = false;
    int err = ChooseMode(req, server, ino, *file, fi, &passthrough, &first_of_build);
    if (err == ETXTBSY && server.modes.WaitNoPassthrough(ino, kReleaseGrace)) {
      // the conflicting open was closed
      err = ChooseMode(req, server, ino, *file, fi, &passthrough, &first_of_build);
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
    } else if (first_of_build && server.direct_first_open.load() && file->source != nullptr &&
               file->source->Size() >= kDirectFirstOpenMinBytes) {
      // This open queued the copy that later opens pass through to: the bytes it reads go
      // straight into the reader's buffer, never into a page cache of the mount's that the
      // copy replaces (one copy and the cache's pages fewer: a cold torch.load of 1.88 GB of
      // rank files 1.63 s -> 1.25 s on 2 cores). Opens made meanwhile and until the copy is
      // built are cached as before, so readers of one file at once share its pages, and a
      // reload keeps what a map of this open brought in (the kernel drops the inode's pages
      // when a direct_io file is mapped; MAP_SHARED maps: OpInit). keep_cache: this open does
      // not drop the pages others read either.
      fi->direct_io = 1;
      fi->keep_cache = 1;
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

namespace {

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

}  // namespace

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

}  // namespace ucpfs::fs::fuse_server
