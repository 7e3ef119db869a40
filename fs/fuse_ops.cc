// The namespace, directory, attribute and xattr handlers of the FUSE server, and its ops
// table (see fuse_server.h for the handlers' contract). The file data path (open, read,
// release) is fuse_read.cc.
#include "fs/fuse_server.h"

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "fs/errno_map.h"

namespace ucpfs::fs::fuse_server {
namespace {

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
    // Not zeroed: the kernel's buffer may be many pages while a directory has a few entries, and
    // only the entries written are sent (zeroing it was 7 % of the daemon's CPU listing 5,007
    // small directories).
    const std::unique_ptr<char[]> buf = std::make_unique_for_overwrite<char[]>(size);
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
        n_bytes = fuse_add_direntry_plus(req, buf.get() + used, size - used, item.name.c_str(), &e, next);
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
          n_bytes = fuse_add_direntry_plus(req, buf.get() + used, size - used, item.name.c_str(), &e, next);
        } else {
          n_bytes = fuse_add_direntry(req, buf.get() + used, size - used, item.name.c_str(), &*st, next);
        }
        if (n_bytes > size - used) break;
      }
      used += n_bytes;
    }
    if (fuse_reply_buf(req, buf.get(), used) != 0) {
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
}  // namespace

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

}  // namespace ucpfs::fs::fuse_server
