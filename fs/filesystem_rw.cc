// See filesystem.h: the read-write area beside the views — operations on the source
// (fs/passthrough.h) and, for an s3:// mount, on the bucket's objects (fs/bucket_files.h) —
// refused with EROFS/EEXIST where they touch a view. Not for: the trees of views and view
// reads (filesystem.cc).
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "fs/errno_map.h"
#include "fs/filesystem.h"

namespace ucpfs::fs {

Result<struct stat> Filesystem::SetAttr(Ino ino, const struct stat& attr, int to_set, OpenFile* file,
                                        const Caller& caller) {
  if (!Passthrough::Owns(ino) || !options_.passthrough) return PosixError(EROFS, PathOf(ino) + " is read-only");
  if (BucketFiles::Owns(ino)) {
    const std::optional<BucketFiles::File> bucket_file = options_.bucket ? options_.bucket->Get(ino) : std::nullopt;
    if (!bucket_file) return NotFoundError("no inode " + std::to_string(ino));
    if (bucket_file->shadow == 0) {
      LogError("setattr " + options_.bucket->Url(bucket_file->rel) +
               ": an object in the bucket cannot be changed in place (EPERM); rewrite it whole (O_TRUNC)");
      return PosixError(EPERM, PathOf(ino) + " is an object in the bucket");
    }
    UCPFS_ASSIGN_OR_RETURN(struct stat st, options_.passthrough->SetAttr(caller, bucket_file->shadow, attr, to_set,
                                                                          file != nullptr ? file->passthrough.get() : nullptr));
    st.st_ino = ino;
    return st;
  }
  return options_.passthrough->SetAttr(caller, ino, attr, to_set,
                                       file != nullptr ? file->passthrough.get() : nullptr);
}

Result<std::pair<Entry, OpenFile>> Filesystem::Create(Ino parent, std::string_view name, mode_t mode, int flags,
                                                      const Caller& caller) {
  UCPFS_ASSIGN_OR_RETURN(const bool to_source, ToSource(parent, name));
  if (!to_source) {
    if (parent == kRootIno && CurrentGeneration().tree->Lookup(kRootIno, std::string(name)) != nullptr) {
      return PosixError(EEXIST, "/" + std::string(name) + " is a view");
    }
    return PosixError(EROFS, PathOf(parent) + " is read-only");
  }
  UCPFS_ASSIGN_OR_RETURN(auto made, options_.passthrough->Create(caller, parent, name, mode, flags));
  OpenFile file;
  file.ino = made.first.st_ino;
  file.passthrough = std::move(made.second);
  return std::make_pair(PtEntry(made.first), std::move(file));
}

Result<size_t> Filesystem::Write(OpenFile& file, uint64_t byte_offset, std::span<const std::byte> data) {
  if (!file.passthrough) return PosixError(EROFS, PathOf(file.ino) + " is read-only");
  Result<size_t> n = options_.passthrough->Write(*file.passthrough, byte_offset, data);
  if (!n.ok()) {
    LogError("write " + PathOf(file.ino) + " offset " + std::to_string(byte_offset) + ": " + n.error().ToString());
  }
  return n;
}

Status Filesystem::Fsync(OpenFile& file, bool datasync) {
  if (!file.passthrough) return Status::Ok();  // views are immutable
  Status s = options_.passthrough->Fsync(*file.passthrough, datasync);
  if (!s.ok()) LogError("fsync " + PathOf(file.ino) + ": " + s.ToString());
  return s;
}

Status Filesystem::Flush(OpenFile& file) {
  if (!file.passthrough) return Status::Ok();
  return options_.passthrough->Flush(*file.passthrough);
}

Status Filesystem::Release(OpenFile& file) {
  if (!file.passthrough) return Status::Ok();
  Status s = options_.passthrough->Release(*file.passthrough);
  if (!s.ok()) LogError("close " + PathOf(file.ino) + ": " + s.ToString());
  return s;
}

Result<Entry> Filesystem::Mkdir(Ino parent, std::string_view name, mode_t mode, const Caller& caller) {
  UCPFS_ASSIGN_OR_RETURN(const bool to_source, ToSource(parent, name));
  if (!to_source) return PosixError(parent == kRootIno ? EEXIST : EROFS, "/" + std::string(name) + " is a view");
  UCPFS_ASSIGN_OR_RETURN(const struct stat st, options_.passthrough->Mkdir(caller, parent, name, mode));
  return PtEntry(st);
}

Result<Entry> Filesystem::Mknod(Ino parent, std::string_view name, mode_t mode, const Caller& caller) {
  UCPFS_ASSIGN_OR_RETURN(const bool to_source, ToSource(parent, name));
  if (!to_source) return PosixError(parent == kRootIno ? EEXIST : EROFS, "/" + std::string(name) + " is a view");
  UCPFS_ASSIGN_OR_RETURN(const struct stat st, options_.passthrough->Mknod(caller, parent, name, mode));
  return PtEntry(st);
}

Result<Entry> Filesystem::Symlink(Ino parent, std::string_view name, const std::string& target,
                                  const Caller& caller) {
  UCPFS_ASSIGN_OR_RETURN(const bool to_source, ToSource(parent, name));
  if (!to_source) return PosixError(parent == kRootIno ? EEXIST : EROFS, "/" + std::string(name) + " is a view");
  UCPFS_ASSIGN_OR_RETURN(const struct stat st, options_.passthrough->Symlink(caller, parent, name, target));
  return PtEntry(st);
}

Result<std::string> Filesystem::Readlink(Ino ino) const {
  if (!Passthrough::Owns(ino) || BucketFiles::Owns(ino) || !options_.passthrough) {
    return PosixError(EINVAL, PathOf(ino) + " is not a symlink");
  }
  return options_.passthrough->Readlink(ino);
}

Status Filesystem::Unlink(Ino parent, std::string_view name, const Caller& caller) {
  UCPFS_ASSIGN_OR_RETURN(const bool to_source, ToSource(parent, name));
  if (!to_source) return PosixError(EROFS, "/" + std::string(name) + " is a view");
  const std::optional<std::string> rel_dir = options_.bucket ? BucketDirOf(parent) : std::nullopt;
  if (!rel_dir) return options_.passthrough->Unlink(caller, parent, name);
  const std::string rel = rel_dir->empty() ? std::string(name) : *rel_dir + "/" + std::string(name);
  // Hidden first: the DELETE it queues may land (BucketFiles::Landed) before the unlink returns.
  // A staged copy's unlink deletes the object of its name too (the passthrough queues it).
  options_.bucket->Removed(rel);
  Status s = options_.passthrough->Unlink(caller, parent, name);
  if (s.ok()) return s;
  options_.bucket->Unhide(rel);
  if (s.sys_errno() != ENOENT) return s;
  UCPFS_ASSIGN_OR_RETURN(const std::optional<TreeEntry> entry, options_.bucket->Find(*rel_dir, std::string(name)));
  if (!entry) return s;
  if (entry->kind != EntryKind::kFile) return PosixError(EISDIR, "/" + rel + " is a directory");
  // DELETE, recorded in the upload journal behind the uploads of the files closed before it.
  options_.bucket->Removed(rel);
  if (Status r = options_.bucket->Remove(rel); !r.ok()) {
    options_.bucket->Unhide(rel);
    return r;
  }
  return Status::Ok();
}

Status Filesystem::Rmdir(Ino parent, std::string_view name, const Caller& caller) {
  UCPFS_ASSIGN_OR_RETURN(const bool to_source, ToSource(parent, name));
  if (!to_source) return PosixError(EROFS, "/" + std::string(name) + " is a view");
  if (const std::optional<std::string> rel_dir = options_.bucket ? BucketDirOf(parent) : std::nullopt) {
    const std::string rel = rel_dir->empty() ? std::string(name) : *rel_dir + "/" + std::string(name);
    UCPFS_ASSIGN_OR_RETURN(const std::vector<TreeEntry> inside, options_.bucket->List(rel));
    if (!inside.empty()) {
      LogError("rmdir " + options_.bucket->Url(rel) + ": it holds objects in the bucket (ENOTEMPTY)");
      return PosixError(ENOTEMPTY, "/" + rel + " holds objects in the bucket");
    }
  }
  return options_.passthrough->Rmdir(caller, parent, name);
}

Status Filesystem::Rename(Ino parent, std::string_view name, Ino new_parent, std::string_view new_name,
                          unsigned flags, const Caller& caller) {
  UCPFS_ASSIGN_OR_RETURN(const bool from_source, ToSource(parent, name));
  UCPFS_ASSIGN_OR_RETURN(const bool to_source, ToSource(new_parent, new_name));
  if (!from_source || !to_source) return PosixError(EROFS, "views cannot be renamed or replaced");
  const std::optional<std::string> rel_dir = options_.bucket ? BucketDirOf(parent) : std::nullopt;
  if (!rel_dir) return options_.passthrough->Rename(caller, parent, name, new_parent, new_name, flags);
  // An object in the bucket is not renamed in place (S3 has no rename; a copy could be torn):
  // EXDEV, which mv and shutil.move answer with a copy and an unlink, both of which work here.
  const std::string rel = rel_dir->empty() ? std::string(name) : *rel_dir + "/" + std::string(name);
  UCPFS_ASSIGN_OR_RETURN(const std::optional<TreeEntry> entry, options_.bucket->Find(*rel_dir, std::string(name)));
  const auto refuse = [&](const char* what) {
    LogError("rename " + options_.bucket->Url(rel) + ": " + what + " in the bucket cannot be renamed (EXDEV)");
    return PosixError(EXDEV, "/" + rel + ": " + what + " in the bucket cannot be renamed");
  };
  if (entry && entry->kind == EntryKind::kDirectory) return refuse("a directory holding objects");
  // The staging directory lacks the target's name; the bucket may have it.
  if ((flags & RENAME_NOREPLACE) != 0) {
    if (const std::optional<std::string> new_dir = BucketDirOf(new_parent)) {
      UCPFS_ASSIGN_OR_RETURN(const std::optional<TreeEntry> target,
                             options_.bucket->Find(*new_dir, std::string(new_name)));
      if (target) return PosixError(EEXIST, std::string(new_name) + " exists in the bucket");
    }
  }
  // The staged file moves; its old object's DELETE is queued by the passthrough: hidden first
  // (that DELETE may land before the rename returns).
  if (entry) options_.bucket->Removed(rel);
  Status s = options_.passthrough->Rename(caller, parent, name, new_parent, new_name, flags);
  if (!s.ok() && entry) options_.bucket->Unhide(rel);
  if (!s.ok() && s.sys_errno() == ENOENT && entry) return refuse("an object");
  return s;
}

// The root's own xattrs are the source root's (the mount's root stands for it).
Status Filesystem::SetXattr(Ino ino, const std::string& name, std::span<const std::byte> value, int flags,
                            const Caller& caller) {
  if (!options_.passthrough || (!Passthrough::Owns(ino) && ino != kRootIno) || BucketFiles::Owns(ino)) {
    return PosixError(ENOTSUP, PathOf(ino) + ": views and bucket objects have no xattrs");
  }
  return options_.passthrough->SetXattr(caller, ino, name, value, flags);
}

Result<std::vector<std::byte>> Filesystem::GetXattr(Ino ino, const std::string& name, size_t size,
                                                    const Caller& caller) {
  if (!options_.passthrough || (!Passthrough::Owns(ino) && ino != kRootIno) || BucketFiles::Owns(ino)) {
    return PosixError(ENODATA, PathOf(ino) + ": views and bucket objects have no xattrs");
  }
  return options_.passthrough->GetXattr(caller, ino, name, size);
}

Result<std::vector<std::byte>> Filesystem::ListXattr(Ino ino, size_t size, const Caller& caller) {
  if (!options_.passthrough || (!Passthrough::Owns(ino) && ino != kRootIno) || BucketFiles::Owns(ino)) {
    return std::vector<std::byte>{};
  }
  return options_.passthrough->ListXattr(caller, ino, size);
}

Status Filesystem::RemoveXattr(Ino ino, const std::string& name, const Caller& caller) {
  if (!options_.passthrough || (!Passthrough::Owns(ino) && ino != kRootIno) || BucketFiles::Owns(ino)) {
    return PosixError(ENODATA, PathOf(ino) + ": views and bucket objects have no xattrs");
  }
  return options_.passthrough->RemoveXattr(caller, ino, name);
}

std::optional<std::string> Filesystem::BucketDirOf(Ino dir) const {
  if (!options_.bucket || !options_.passthrough) return std::nullopt;
  if (dir != kRootIno && (!Passthrough::Owns(dir) || BucketFiles::Owns(dir))) return std::nullopt;
  std::string path = options_.passthrough->PathOf(dir);
  if (path.empty() || path[0] != '/') return std::nullopt;  // a node gone meanwhile
  path.erase(0, 1);
  if (path == ".ucpfs" || path.starts_with(".ucpfs/")) return std::nullopt;  // the mount's own
  return path;
}

Result<Entry> Filesystem::BucketLookup(Ino parent, std::string_view name_view) {
  const std::optional<std::string> rel_dir = BucketDirOf(parent);
  if (!rel_dir) return Entry{};
  const std::string name(name_view);
  Result<std::optional<TreeEntry>> entry = options_.bucket->Find(*rel_dir, name);
  if (!entry.ok()) {
    LogError("lookup " + options_.bucket->Url(rel_dir->empty() ? name : *rel_dir + "/" + name) + ": " +
             entry.error().ToString());
    return entry.error();
  }
  if (!*entry) return Entry{};
  if ((*entry)->kind == EntryKind::kDirectory) {
    // Made in the staging directory (by the daemon; directories are never uploaded), so the
    // staged files saved into it have a place, and its bucket objects a parent inode.
    Result<struct stat> made = options_.passthrough->Mkdir(Caller{}, parent, name, 0755);
    if (!made.ok() && made.error().sys_errno() == EEXIST) made = options_.passthrough->Lookup(parent, name);
    if (!made.ok()) return made.error();
    return PtEntry(*made);
  }
  UCPFS_ASSIGN_OR_RETURN(const struct stat st,
                         options_.bucket->Reference(parent, *rel_dir, **entry, options_.uid, options_.gid));
  return PtEntry(st);
}

Status Filesystem::AddBucketNames(Ino dir, DirListing& listing) const {
  const std::optional<std::string> rel_dir = BucketDirOf(dir);
  if (!rel_dir) return Status::Ok();
  Result<std::vector<TreeEntry>> entries = options_.bucket->List(*rel_dir);
  if (!entries.ok()) {
    LogError("list " + options_.bucket->Url(*rel_dir) + ": " + entries.error().ToString());
    return entries.error();
  }
  std::set<std::string> listed;
  for (const DirListing::Item& item : listing.items) listed.insert(item.name);
  bool added = false;
  for (TreeEntry& e : *entries) {
    if (listed.contains(e.name)) continue;  // staged (or a view's name): it wins
    listing.items.push_back({std::move(e.name), 0, true, static_cast<mode_t>(e.kind == EntryKind::kDirectory ? S_IFDIR : S_IFREG)});
    added = true;
  }
  if (added) {
    std::sort(listing.items.begin() + 2, listing.items.end(),
              [](const DirListing::Item& a, const DirListing::Item& b) { return a.name < b.name; });
  }
  listing.cacheable = false;
  return Status::Ok();
}

Result<OpenFile> Filesystem::OpenRemovedCopy(Ino ino, int flags, const Caller& caller, const Status& error) const {
  // A staged copy the bucket uploader removed (uploaded, kept --stage-keep) since the kernel
  // looked the name up: the bucket's object answers, as a fresh lookup would (the kernel keeps
  // the old inode for up to its 1 s entry timeout).
  const std::optional<std::pair<Ino, std::string>> where = options_.passthrough->ParentOf(ino);
  const std::optional<std::string> rel_dir = where ? BucketDirOf(where->first) : std::nullopt;
  if (!rel_dir) return error;
  OpenFile file;
  file.ino = ino;
  const bool write = (flags & O_ACCMODE) != O_RDONLY;
  if (write && (flags & O_TRUNC) != 0) {  // a rewrite: staged anew under the name
    UCPFS_ASSIGN_OR_RETURN(auto made, options_.passthrough->Create(caller, where->first, where->second, 0644,
                                                                   (flags | O_CREAT) & ~O_EXCL));
    options_.passthrough->Forget(made.first.st_ino, 1);  // the kernel knows the old inode, not this one
    file.passthrough = std::move(made.second);
    return file;
  }
  if (write || (flags & O_APPEND) != 0) return error;
  const std::optional<BucketFiles::File> object = RemovedCopyObject(ino);
  if (!object) return error;
  UCPFS_ASSIGN_OR_RETURN(file.source, options_.bucket->Open(*object, nullptr));
  file.n_bytes = object->identity.n_bytes;
  file.volatile_content = true;  // direct_io: the kernel's size and pages of this inode are the removed copy's
  return file;
}

std::optional<BucketFiles::File> Filesystem::RemovedCopyObject(Ino ino) const {
  const std::optional<std::pair<Ino, std::string>> where = options_.passthrough->ParentOf(ino);
  const std::optional<std::string> rel_dir = where ? BucketDirOf(where->first) : std::nullopt;
  if (!rel_dir) return std::nullopt;
  Result<std::optional<TreeEntry>> entry = options_.bucket->Find(*rel_dir, where->second);
  if (!entry.ok() || !*entry || (*entry)->kind != EntryKind::kFile) return std::nullopt;
  return BucketFiles::File{where->first, rel_dir->empty() ? where->second : *rel_dir + "/" + where->second,
                           where->second, (*entry)->identity, 0};
}

Result<OpenFile> Filesystem::OpenBucketFile(Ino ino, int flags, const Caller& caller) const {
  const std::optional<BucketFiles::File> bucket_file = options_.bucket ? options_.bucket->Get(ino) : std::nullopt;
  if (!bucket_file) return NotFoundError("no inode " + std::to_string(ino));
  OpenFile file;
  file.ino = ino;
  if (bucket_file->shadow != 0) {  // rewritten through the mount: the staged file answers
    UCPFS_ASSIGN_OR_RETURN(file.passthrough, options_.passthrough->Open(caller, bucket_file->shadow, flags));
    return file;
  }
  const bool write = (flags & O_ACCMODE) != O_RDONLY;
  if (write && (flags & O_TRUNC) != 0) {
    // A rewrite: staged as a new file of that name, uploaded over the object at close.
    UCPFS_ASSIGN_OR_RETURN(auto made, options_.passthrough->Create(caller, bucket_file->parent, bucket_file->name,
                                                                   0644, (flags | O_CREAT) & ~O_EXCL));
    if (!options_.bucket->SetShadow(ino, made.first.st_ino)) options_.passthrough->Forget(made.first.st_ino, 1);
    file.passthrough = std::move(made.second);
    return file;
  }
  if (write || (flags & (O_TRUNC | O_APPEND)) != 0) {
    LogError("open " + options_.bucket->Url(bucket_file->rel) +
             " for writing: an object in the bucket is not written in place (EPERM); rewrite it whole "
             "(O_TRUNC) or save a new file");
    return PosixError(EPERM, PathOf(ino) + " is an object in the bucket: not written in place");
  }
  UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<const LazySource> source, options_.bucket->Open(*bucket_file, nullptr));
  file.n_bytes = bucket_file->identity.n_bytes;
  file.source = std::move(source);
  return file;
}

}  // namespace ucpfs::fs
