// Serves a Tree through the libfuse3 low-level API (multi-threaded loop). See fuse_mount.h.
//
// Not for: building the namespace (tree.cc) or producing file bytes (ByteSource openers).
//
// Invariants:
// - The Tree is immutable while served, so handlers read it without locks from any worker.
// - Every Op* handler replies exactly once. Handlers run their body through Handle(): the
//   body either replies as its last statement and returns 0, or returns an errno that
//   Handle() replies with. An exception can therefore only escape before any reply, and
//   Handle() turns it into EIO; nothing ever propagates into libfuse.
// - fi->fh of an open file is an OpenFile (one per open(2), freed by release); of an open
//   directory an OpenDir snapshot (freed by releasedir). The session's HandleRegistry owns
//   both, so handles still open when the mount goes away are freed too.
// - Status codes become errnos in ErrnoFromStatus() and nowhere else.
// - Inodes are never forgotten: the tree lives as long as the session, so forget is a no-op
//   and lookup counts are not tracked.
// - The optional dynamic directory's subtrees (MountOptions::resolve) are immutable Trees too,
//   kept in an append-only registry for the whole session: its lock is held only to find or
//   add a subtree, never while one is built or read. Inode numbers carry the subtree in their
//   high 32 bits (0: the main tree); Find() is the one place they are decoded.
#define FUSE_USE_VERSION 35
#include "fs/fuse_mount.h"

#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <set>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string_view>
#include <thread>
#include <unordered_set>
#include <utility>

extern char** environ;

namespace ucpfs::fs {
namespace {

// Views are immutable: the kernel may cache names, attributes and negative lookups for long.
constexpr double kCacheTimeoutS = 3600.0;
// Largest FUSE read request. libfuse 3.14's receive buffer holds 256 pages, and the kernel's
// max_pages_limit is 256 by default, so 1 MiB is the most one request can carry.
constexpr uint32_t kDefaultMaxReadBytes = 1u << 20;
// st_blksize: cp, cat and stdio size their reads by it; match the request size.
constexpr blksize_t kStatBlockSize = 1 << 20;
constexpr unsigned long kStatfsBlockSize = 4096;
constexpr unsigned long kNameMax = 255;
// Inode numbers of dynamic subtrees: (k + 1) << kSubtreeShift | local inode, for subtree k.
constexpr int kSubtreeShift = 32;
constexpr Ino kLocalInoMask = (Ino{1} << kSubtreeShift) - 1;
constexpr size_t kMaxSubtrees = size_t{1} << 20;

// ---- the one Status -> errno mapping ----

int ErrnoFromStatus(const Status& status) {
  switch (status.code()) {
    case StatusCode::kOk: return 0;
    case StatusCode::kNotFound: return ENOENT;
    case StatusCode::kIo: return status.sys_errno() != 0 ? status.sys_errno() : EIO;
    case StatusCode::kNoSpace: return ENOSPC;
    // kOutOfRange from a source means the tree and the source disagree (reads are clipped
    // to the node size first): a data error, not the caller's mistake.
    default: return EIO;
  }
}

// ---- per-session state ----

// Per-open state referenced by fi->fh.
struct OpenHandle {
  virtual ~OpenHandle() = default;
};

struct OpenFile final : OpenHandle {
  OpenFile(std::shared_ptr<const ByteSource> source_in, Ino ino_in, uint64_t n_bytes_in)
      : source(std::move(source_in)), ino(ino_in), n_bytes(n_bytes_in) {}
  std::shared_ptr<const ByteSource> source;
  Ino ino;
  uint64_t n_bytes;
};

struct DirEntry {
  std::string_view name;  // points into the tree's children map (or a literal): stable
  Ino ino = 0;
};

// Snapshot of a directory taken at opendir; readdir offset i means "resume at entries[i]".
struct OpenDir final : OpenHandle {
  std::vector<DirEntry> entries;  // ".", "..", then children in name order
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

struct Subtree {
  std::shared_ptr<const Tree> tree;
  const std::string* name = nullptr;  // the key in Server::subtree_index (stable)
};

struct Server {
  std::shared_ptr<const Tree> tree;
  uid_t uid = 0;
  gid_t gid = 0;
  uint32_t max_read_bytes = kDefaultMaxReadBytes;
  HandleRegistry handles;
  Ino dynamic_dir = 0;  // 0: none
  SubtreeResolver resolve;
  // Append-only: a subtree, once added, is served (at the same index) until the session ends.
  mutable std::shared_mutex subtrees_mu;
  std::vector<Subtree> subtrees;                           // guarded by subtrees_mu
  std::map<std::string, size_t, std::less<>> subtree_index;  // name -> index; guarded
  // Source data-loss errors already logged (a changed source file is logged once, not at every
  // read, until a remount re-indexes it), bounded so a storm of distinct ones cannot grow it.
  std::mutex logged_mu;
  std::set<std::string> logged_data_loss;  // guarded by logged_mu
};

// A node found by its (global) inode number.
struct Found {
  const Tree* tree = nullptr;      // the tree holding it
  const TreeNode* node = nullptr;  // nullptr: no such inode
  Ino base = 0;                    // (k + 1) << kSubtreeShift in subtree k; 0 in the main tree
};

Ino GlobalIno(const Found& f) { return f.base | f.node->ino; }

Ino GlobalParent(const Server& server, const Found& f) {
  if (f.base == 0) return f.node->parent;
  return f.node->ino == kRootIno ? server.dynamic_dir : (f.base | f.node->parent);
}

Found Find(const Server& server, Ino ino) {
  Found f;
  const Ino high = ino >> kSubtreeShift;
  if (high == 0) {
    f.tree = server.tree.get();
  } else {
    std::shared_lock lock(server.subtrees_mu);
    if (high > server.subtrees.size()) return f;
    f.tree = server.subtrees[high - 1].tree.get();  // lives as long as the session
    f.base = high << kSubtreeShift;
  }
  f.node = f.tree->Get(ino & kLocalInoMask);
  return f;
}

// The child `local` of a found directory.
Found ChildOf(const Found& dir, const TreeNode* local) { return {dir.tree, local, dir.base}; }

// "/a/b/c" for messages, through subtrees too.
std::string PathOf(const Server& server, Ino ino) {
  const Ino high = ino >> kSubtreeShift;
  if (high == 0) return server.tree->PathOf(ino);
  const Tree* tree = nullptr;
  std::string name;
  {
    std::shared_lock lock(server.subtrees_mu);
    if (high > server.subtrees.size()) return "<ino " + std::to_string(ino) + ">";
    tree = server.subtrees[high - 1].tree.get();
    name = *server.subtrees[high - 1].name;
  }
  const std::string base = server.tree->PathOf(server.dynamic_dir) + "/" + name;
  const std::string rest = tree->PathOf(ino & kLocalInoMask);
  return rest == "/" ? base : base + rest;
}

Found SubtreeRoot(const Server& server, size_t k) {
  return {server.subtrees[k].tree.get(), server.subtrees[k].tree->Get(kRootIno),
          static_cast<Ino>(k + 1) << kSubtreeShift};
}

// The dynamic child `name` of server.dynamic_dir: registered, or resolved and registered now.
// Returns 0 and sets *out, or an errno (a resolve failure is logged and is ENOENT).
int ResolveChild(Server& server, const std::string& name, Found* out) {
  {
    std::shared_lock lock(server.subtrees_mu);
    const auto it = server.subtree_index.find(name);
    if (it != server.subtree_index.end()) {
      *out = SubtreeRoot(server, it->second);
      return 0;
    }
  }
  std::string dir_path = server.tree->PathOf(server.dynamic_dir);
  if (!dir_path.empty() && dir_path[0] == '/') dir_path.erase(0, 1);
  const std::string label = dir_path.empty() ? name : dir_path + "/" + name;
  Result<std::shared_ptr<const Tree>> made = server.resolve(name);  // outside the lock
  if (!made.ok()) {
    std::fprintf(stderr, "ucpfs: %s: %s\n", label.c_str(), made.error().ToString().c_str());
    return ENOENT;
  }
  std::shared_ptr<const Tree> sub = std::move(*made);
  if (sub == nullptr || sub->size() > kLocalInoMask) {
    std::fprintf(stderr, "ucpfs: %s: resolver returned %s\n", label.c_str(),
                 sub == nullptr ? "no tree" : "too many nodes");
    return ENOENT;
  }
  std::unique_lock lock(server.subtrees_mu);
  auto it = server.subtree_index.find(name);
  if (it == server.subtree_index.end()) {  // else another worker won the race: use theirs
    if (server.subtrees.size() >= kMaxSubtrees) {
      std::fprintf(stderr, "ucpfs: %s: too many directories resolved (%zu)\n", label.c_str(),
                   kMaxSubtrees);
      return ENOSPC;
    }
    it = server.subtree_index.emplace(name, server.subtrees.size()).first;
    server.subtrees.push_back({std::move(sub), &it->first});
  }
  *out = SubtreeRoot(server, it->second);
  return 0;
}

Server& ServerOf(fuse_req_t req) { return *static_cast<Server*>(fuse_req_userdata(req)); }

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

struct stat StatOf(const Server& server, const Found& found) {
  const TreeNode& node = *found.node;
  struct stat st = {};
  st.st_ino = GlobalIno(found);
  st.st_mode = static_cast<mode_t>((node.is_dir ? S_IFDIR : S_IFREG) | (node.mode & 07777));
  // The dynamic directory's subdirectory count is unknown: 1 tells find(1) not to count.
  st.st_nlink = server.dynamic_dir != 0 && st.st_ino == server.dynamic_dir ? 1 : node.nlink;
  st.st_uid = node.uid >= 0 ? static_cast<uid_t>(node.uid) : server.uid;
  st.st_gid = node.gid >= 0 ? static_cast<gid_t>(node.gid) : server.gid;
  st.st_size = static_cast<off_t>(node.size);
  // In 512-byte units whatever st_blksize says; `du` reports the virtual size from this.
  st.st_blocks = static_cast<blkcnt_t>(node.size / 512 + (node.size % 512 != 0 ? 1 : 0));
  st.st_blksize = kStatBlockSize;
  st.st_atim = node.mtime;
  st.st_mtim = node.mtime;
  st.st_ctim = node.mtime;
  return st;
}

fuse_entry_param EntryOf(const Server& server, const Found& found) {
  fuse_entry_param e = {};
  // node == nullptr: ino 0 is a negative entry, cached for entry_timeout like a positive one.
  if (found.node != nullptr) {
    e.ino = GlobalIno(found);
    e.attr = StatOf(server, found);
    e.attr_timeout = kCacheTimeoutS;
  }
  e.entry_timeout = kCacheTimeoutS;
  return e;
}

// ---- Op* adapters ----

void OpInit(void* userdata, fuse_conn_info* conn) {
  const Server& server = *static_cast<const Server*>(userdata);
  // Must equal the -o max_read given to fuse_session_new, or libfuse refuses the INIT.
  conn->max_read = server.max_read_bytes;
  // The kernel clamps this to its per-mount default (128 KiB); ServeTree's readiness thread
  // raises the mount's bdi read_ahead_kb afterwards.
  conn->max_readahead = server.max_read_bytes;
  const unsigned wanted = FUSE_CAP_ASYNC_READ | FUSE_CAP_READDIRPLUS | FUSE_CAP_READDIRPLUS_AUTO |
                          FUSE_CAP_PARALLEL_DIROPS;
  conn->want |= wanted & conn->capable;
  // No splice: the reply comes from a gathered buffer anyway (docs: not worth it).
  conn->want &= ~static_cast<unsigned>(FUSE_CAP_SPLICE_READ | FUSE_CAP_SPLICE_WRITE |
                                       FUSE_CAP_SPLICE_MOVE);
}

void OpLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  Handle(req, "lookup", [&] {
    Server& server = ServerOf(req);
    const Found dir = Find(server, parent);
    if (dir.node == nullptr) return ENOENT;
    if (!dir.node->is_dir) return ENOTDIR;
    const std::string_view name_view(name);
    Found child;
    if (name_view == ".") {
      child = dir;
    } else if (name_view == "..") {
      child = Find(server, GlobalParent(server, dir));
    } else {
      const std::string name_str(name);
      child = ChildOf(dir, dir.tree->Lookup(dir.node->ino, name_str));
      if (child.node == nullptr && server.dynamic_dir != 0 && parent == server.dynamic_dir) {
        const int err = ResolveChild(server, name_str, &child);
        if (err != 0) return err;  // not a negative entry: a later lookup tries again
      }
    }
    const fuse_entry_param e = EntryOf(server, child);
    fuse_reply_entry(req, &e);
    return 0;
  });
}

// The tree outlives the session, so there is nothing to release.
void OpForget(fuse_req_t req, fuse_ino_t, uint64_t) { fuse_reply_none(req); }
void OpForgetMulti(fuse_req_t req, size_t, fuse_forget_data*) { fuse_reply_none(req); }

void OpGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  Handle(req, "getattr", [&] {
    const Server& server = ServerOf(req);
    const Found found = Find(server, ino);
    if (found.node == nullptr) return ENOENT;
    const struct stat st = StatOf(server, found);
    fuse_reply_attr(req, &st, kCacheTimeoutS);
    return 0;
  });
}

// Every namespace or content change: the mount is read-only (the kernel usually answers
// EROFS itself because we mount with "ro"; these cover the rest).
template <typename... Args>
void OpReadOnly(fuse_req_t req, Args...) {
  fuse_reply_err(req, EROFS);
}

void OpOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Handle(req, "open", [&] {
    const Server& server = ServerOf(req);
    const TreeNode* node = Find(server, ino).node;
    if (node == nullptr) return ENOENT;
    if (node->is_dir) return EISDIR;
    if ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & (O_TRUNC | O_APPEND)) != 0) {
      return EROFS;
    }
    const std::string path = PathOf(server, ino);
    if (!node->open) {
      std::fprintf(stderr, "ucpfs: open %s: file has no opener\n", path.c_str());
      return EIO;
    }
    Result<std::shared_ptr<const ByteSource>> source = node->open();
    if (!source.ok()) {
      std::fprintf(stderr, "ucpfs: open %s: %s\n", path.c_str(), source.error().ToString().c_str());
      return ErrnoFromStatus(source.error());
    }
    if (*source == nullptr || (*source)->Size() != node->size) {
      std::fprintf(stderr, "ucpfs: open %s: source has %llu bytes but the file has %llu\n",
                   path.c_str(),
                   static_cast<unsigned long long>(*source ? (*source)->Size() : 0),
                   static_cast<unsigned long long>(node->size));
      return EIO;
    }
    auto handle = std::make_unique<OpenFile>(std::move(*source), ino, node->size);
    if (node->volatile_content) {
      fi->direct_io = 1;  // produced at open time: never serve stale cached pages
    } else {
      fi->keep_cache = 1;  // content never changes: keep pages across opens
    }
    fi->noflush = 1;     // nothing to flush on close: skip the FLUSH round trip
    ReplyOpen(req, fi, std::move(handle));
    return 0;
  });
}

void OpRead(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  Handle(req, "read", [&] {
    const OpenFile& file = *HandleOf<OpenFile>(fi);
    if (off < 0) return EINVAL;
    const auto byte_offset = static_cast<uint64_t>(off);
    if (byte_offset >= file.n_bytes || size == 0) {
      fuse_reply_buf(req, nullptr, 0);
      return 0;
    }
    const auto n_bytes = static_cast<size_t>(std::min<uint64_t>(size, file.n_bytes - byte_offset));
    // One buffer per worker thread, grown to the largest request seen (max_read): no
    // allocation per request. fuse_reply_buf writes it to /dev/fuse before returning.
    thread_local std::vector<std::byte> buffer;
    if (buffer.size() < n_bytes) buffer.resize(n_bytes);
    const Status status = file.source->ReadAt(byte_offset, std::span(buffer.data(), n_bytes));
    if (!status.ok()) {
      Server& server = ServerOf(req);
      bool log = true;
      if (status.code() == StatusCode::kDataLoss) {
        std::lock_guard lock(server.logged_mu);
        log = server.logged_data_loss.size() < 4096 && server.logged_data_loss.insert(status.message()).second;
      }
      if (log) {
        std::fprintf(stderr, "ucpfs: read %s offset %llu: %s\n", PathOf(server, file.ino).c_str(),
                     static_cast<unsigned long long>(byte_offset), status.ToString().c_str());
      }
      return ErrnoFromStatus(status);
    }
    fuse_reply_buf(req, reinterpret_cast<const char*>(buffer.data()), n_bytes);
    return 0;
  });
}

void OpRelease(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  ServerOf(req).handles.Destroy(HandleOf<OpenFile>(fi));
  fuse_reply_err(req, 0);
}

void OpOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Handle(req, "opendir", [&] {
    const Server& server = ServerOf(req);
    const Found found = Find(server, ino);
    const TreeNode* node = found.node;
    if (node == nullptr) return ENOENT;
    if (!node->is_dir) return ENOTDIR;
    auto dir = std::make_unique<OpenDir>();
    dir->entries.reserve(node->children.size() + 2);
    dir->entries.push_back({".", GlobalIno(found)});
    dir->entries.push_back({"..", GlobalParent(server, found)});
    for (const auto& [name, child] : node->children) {
      dir->entries.push_back({name, found.base | child});
    }
    const bool dynamic = server.dynamic_dir != 0 && ino == server.dynamic_dir;
    if (dynamic) {  // plus the subtrees resolved so far, merged in name order
      {
        std::shared_lock lock(server.subtrees_mu);
        for (const auto& [name, k] : server.subtree_index) {
          if (node->children.contains(name)) continue;  // shadowed (never resolved, in fact)
          dir->entries.push_back({name, static_cast<Ino>(k + 1) << kSubtreeShift | kRootIno});
        }
      }
      std::sort(dir->entries.begin() + 2, dir->entries.end(),
                [](const DirEntry& a, const DirEntry& b) { return a.name < b.name; });
    } else {
      fi->cache_readdir = 1;  // listings never change: let the kernel cache them
      fi->keep_cache = 1;
    }
    ReplyOpen(req, fi, std::move(dir));
    return 0;
  });
}

void ReadDir(fuse_req_t req, size_t size, off_t off, fuse_file_info* fi, bool plus) {
  Handle(req, plus ? "readdirplus" : "readdir", [&] {
    const Server& server = ServerOf(req);
    const OpenDir& dir = *HandleOf<OpenDir>(fi);
    if (off < 0) return EINVAL;
    std::vector<char> buf(size);
    size_t used = 0;
    // Offsets are snapshot indices: the entry at index i carries offset i + 1 ("next").
    for (auto i = static_cast<size_t>(off); i < dir.entries.size(); ++i) {
      const DirEntry& entry = dir.entries[i];
      const Found found = Find(server, entry.ino);
      if (found.node == nullptr) continue;  // cannot happen in a well-formed tree
      const std::string name(entry.name);
      const auto next = static_cast<off_t>(i + 1);
      size_t n_bytes;
      if (plus) {
        fuse_entry_param e = EntryOf(server, found);
        // "." and ".." are not looked up by the kernel (their lookup count is not taken).
        if (entry.name == "." || entry.name == "..") e.ino = 0;
        n_bytes = fuse_add_direntry_plus(req, buf.data() + used, size - used, name.c_str(), &e,
                                         next);
      } else {
        const struct stat st = StatOf(server, found);
        n_bytes = fuse_add_direntry(req, buf.data() + used, size - used, name.c_str(), &st, next);
      }
      if (n_bytes > size - used) break;  // full: the kernel asks again from `next`
      used += n_bytes;
    }
    fuse_reply_buf(req, buf.data(), used);
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
  ServerOf(req).handles.Destroy(HandleOf<OpenDir>(fi));
  fuse_reply_err(req, 0);
}

void OpStatfs(fuse_req_t req, fuse_ino_t) {
  Handle(req, "statfs", [&] {
    const Tree& tree = *ServerOf(req).tree;
    const uint64_t n_bytes = tree.TotalFileBytes();
    struct statvfs sv = {};
    sv.f_bsize = kStatfsBlockSize;
    sv.f_frsize = kStatfsBlockSize;
    sv.f_blocks = n_bytes / kStatfsBlockSize + (n_bytes % kStatfsBlockSize != 0 ? 1 : 0);
    sv.f_files = tree.size();
    sv.f_namemax = kNameMax;
    sv.f_flag = ST_RDONLY;  // informational: statvfs(2) reports the mount's "ro" flag
    fuse_reply_statfs(req, &sv);
    return 0;
  });
}

// Answering ENOSYS makes the kernel remember that xattrs are unsupported and reply
// EOPNOTSUPP itself from then on: `ls -l` and friends cost no round trip per file.
void OpGetxattr(fuse_req_t req, fuse_ino_t, const char*, size_t) { fuse_reply_err(req, ENOSYS); }

void OpListxattr(fuse_req_t req, fuse_ino_t, size_t size) {
  // An empty list: the size probe gets 0, a read gets no bytes.
  if (size == 0) {
    fuse_reply_xattr(req, 0);
  } else {
    fuse_reply_buf(req, nullptr, 0);
  }
}

void OpAccess(fuse_req_t req, fuse_ino_t ino, int mask) {
  Handle(req, "access", [&] {
    if (Find(ServerOf(req), ino).node == nullptr) return ENOENT;
    if ((mask & W_OK) != 0) return EROFS;
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
    .setattr = OpReadOnly,
    .readlink = nullptr,  // no symlinks
    .mknod = OpReadOnly,
    .mkdir = OpReadOnly,
    .unlink = OpReadOnly,
    .rmdir = OpReadOnly,
    .symlink = OpReadOnly,
    .rename = OpReadOnly,
    .link = OpReadOnly,
    .open = OpOpen,
    .read = OpRead,
    .write = OpReadOnly,
    .flush = nullptr,  // files are opened with noflush; nothing to flush anyway
    .release = OpRelease,
    .fsync = nullptr,
    .opendir = OpOpendir,
    .readdir = OpReaddir,
    .releasedir = OpReleasedir,
    .fsyncdir = nullptr,
    .statfs = OpStatfs,
    .setxattr = OpReadOnly,
    .getxattr = OpGetxattr,
    .listxattr = OpListxattr,
    .removexattr = OpReadOnly,
    .access = OpAccess,
    .create = OpReadOnly,
    .getlk = nullptr,  // local locks only
    .setlk = nullptr,
    .bmap = nullptr,
    .ioctl = nullptr,
    .poll = nullptr,
    .write_buf = nullptr,  // writes come through .write (EROFS); no splice
    .retrieve_reply = nullptr,
    .forget_multi = OpForgetMulti,
    .flock = nullptr,
    .fallocate = OpReadOnly,
    .readdirplus = OpReaddirplus,
    .copy_file_range = nullptr,
    .lseek = nullptr,  // default SEEK_SET/CUR/END are done by the kernel
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

  if (options.dynamic_dir != 0) {
    const TreeNode* dir = tree->Get(options.dynamic_dir);
    if (dir == nullptr || !dir->is_dir || !options.resolve) {
      return InvalidArgumentError("ServeTree: dynamic_dir is not a directory or has no resolver");
    }
    if (tree->size() > kLocalInoMask) {
      return InvalidArgumentError("ServeTree: a tree with a dynamic directory needs < 2^32 nodes");
    }
  }

  Server server;
  server.tree = std::move(tree);
  server.dynamic_dir = options.dynamic_dir;
  server.resolve = options.resolve;
  server.uid = getuid();
  server.gid = getgid();
  server.max_read_bytes = *user_max_read != 0 ? *user_max_read : kDefaultMaxReadBytes;

  std::vector<std::string> arg_strings = {
      "ucpfs",
      "-o", "fsname=" + EscapeOptionValue(options.fsname.empty() ? "ucpfs" : options.fsname),
      "-o", "subtype=ucpfs",
      "-o", "ro",
      "-o", "default_permissions",
  };
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
  errno = 0;
  if (fuse_session_mount(se, mountpoint.c_str()) != 0) {
    const int err = errno != 0 ? errno : EIO;
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    return IoError("mounting at " + mountpoint + " failed", err);
  }

  int announce_errno = EIO;
  std::thread announcer([&] {
    announce_errno = AnnounceWhenLive(mountpoint, options.ready_fd, server.max_read_bytes);
  });

  fuse_loop_config* config = fuse_loop_cfg_create();
  fuse_loop_cfg_set_clone_fd(config, 0);
  fuse_loop_cfg_set_max_threads(config, static_cast<unsigned>(std::max(1, options.max_threads)));
  // max_idle_threads stays at libfuse's default (-1: idle workers are kept, never re-spawned
  // per request burst; libfuse discourages other values).
  const int loop_rc = fuse_session_loop_mt(se, config);
  fuse_loop_cfg_destroy(config);

  fuse_session_unmount(se);
  fuse_remove_signal_handlers(se);
  // Closing /dev/fuse aborts the connection, so an announcer still waiting in stat() returns.
  fuse_session_destroy(se);
  announcer.join();
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
