// SourceTree: the directory a checkpoint source is read from, as the one seam between the
// scanners, the index and the views on one side and the store that holds the files on the
// other. Everything that lists, stats or opens a file of the SOURCE goes through it; LocalTree
// is a local (or POSIX-shared) directory, and an object store (a bucket prefix, whose
// "directories" are common prefixes) implements the same calls. No file descriptors cross it.
//
// Not for: the write side of a mount (write capture, the passthrough's read-write area) and
// the index directory `.ucpfs/`: those write to the local directory and stay local.
//
// Paths given to a tree are relative to its root: "" is the root itself, else components
// separated by single '/', none empty, "." or "..", not absolute, no NUL (SafeTreePath). A path
// that is not is refused with kInvalidArgument naming it. Symlinks are never followed below the
// root: they are listed and stat'ed as kSymlink, and never opened.
// Thread-safe (every call may come from any FUSE worker thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/byte_source.h"
#include "core/io/file_source.h"
#include "core/io/lazy_file_source.h"
#include "core/status.h"

namespace ucpfs {

// What a name of the tree is. An object store's "directory" is a common prefix (kDirectory);
// it has no symlinks or special files.
enum class EntryKind : uint8_t { kFile, kDirectory, kSymlink, kOther };

// "file", "directory", "symlink", "other" (for messages).
const char* EntryKindName(EntryKind kind);

// One name of the tree, as List and Stat report it.
struct TreeEntry {
  std::string name;  // the last component ("" for the root)
  EntryKind kind = EntryKind::kOther;
  // Size, mtime and, where the store has them, device, inode and ctime (lstat's). An object
  // store puts a hash of the object's ETag in `ino`, so a replaced object is a new version.
  // Meaningful for files; a directory's is what the store reports (a prefix: zeros).
  FileIdentity identity;
  // Permission bits and owner, which the views copy (-1: none; the mount's own). A store without
  // them reports 0444 and -1.
  uint32_t mode = 0444;
  int64_t uid = -1;
  int64_t gid = -1;
};

// A file opened now (SourceTree::Open): its bytes and the identity of the version opened.
struct OpenedFile {
  std::shared_ptr<const ByteSource> bytes;
  FileIdentity identity;
};

// The most names one List returns: a checkpoint directory is untrusted, and a listing's memory
// must stay bounded (a million names is far past any real checkpoint's).
inline constexpr size_t kMaxTreeListEntries = size_t{1} << 20;

// Whether `rel` may be asked of a tree (see above): "" or a clean relative path.
bool SafeTreePath(std::string_view rel);

class SourceTree {
 public:
  virtual ~SourceTree() = default;

  // Where the tree is, for messages: a local path (no trailing '/'), later `s3://bucket/prefix`.
  virtual const std::string& Root() const = 0;

  // Root() + "/" + rel (Root() for ""), for messages and as the name of the files opened.
  std::string PathOf(std::string_view rel) const;

  // The names directly under `rel_dir`, sorted by name, without "." and "..", never following a
  // symlink (a symlink is listed as kSymlink). A name that vanishes while listing is left out.
  // Errors: kInvalidArgument (a bad path); kNotFound when `rel_dir` is missing or not a
  // directory (a symlink to one included); kResourceExhausted past kMaxTreeListEntries names;
  // kIo (sys_errno set). Messages name the directory.
  virtual Result<std::vector<TreeEntry>> List(std::string_view rel_dir) const = 0;

  // lstat of `rel` ("" is the root). Errors: kInvalidArgument (a bad path); kNotFound; kIo.
  virtual Result<TreeEntry> Stat(std::string_view rel) const = 0;

  // The regular file `rel`, opened now: its bytes can be read at once and its identity is the
  // version opened. Never follows a symlink and never opens a FIFO, socket or device (which
  // could block or have side effects). Errors: kInvalidArgument naming the file for a bad path,
  // a symlink, a special file or a directory; kNotFound; kIo.
  virtual Result<OpenedFile> Open(std::string_view rel) const = 0;

  // The file `rel` as the mount serves it: opened on first read (or LazySource::Open), checked
  // against `expected` then and after every read (kDataLoss naming the file when it is another
  // version). `counters` (may be null) count its reads; `cache` (may be null: the source keeps
  // its own handle) bounds the open files of the mount; a store without descriptors may ignore
  // it. Errors: kInvalidArgument for a bad path (nothing is opened here).
  virtual Result<std::shared_ptr<const LazySource>> OpenLazy(std::string_view rel, const FileIdentity& expected,
                                                             std::shared_ptr<IoCounters> counters,
                                                             std::shared_ptr<FdCache> cache) const = 0;

  // The tree rooted at `rel_dir` of this one (a DeepSpeed tag, a checkpoint of a run folder).
  // Nothing is checked but the path: a missing directory fails on first use.
  // Errors: kInvalidArgument for a bad path.
  virtual Result<std::shared_ptr<const SourceTree>> Subtree(std::string_view rel_dir) const = 0;

  // Stat(rel) is a regular file / a directory (false on any error).
  bool IsFile(std::string_view rel) const;
  bool IsDirectory(std::string_view rel) const;
};

// A local directory: lstat, opendir and FileSource (O_NOFOLLOW, non-blocking, regular files
// only), lazy files through LazyFileSource and the mount's FdCache. The root itself is
// followed if it is a symlink (the user named it); nothing below it is.
class LocalTree final : public SourceTree {
 public:
  explicit LocalTree(std::string dir);  // trailing '/' dropped; nothing is checked yet
  static std::shared_ptr<const LocalTree> Make(std::string dir) { return std::make_shared<const LocalTree>(std::move(dir)); }

  const std::string& Root() const override { return dir_; }
  Result<std::vector<TreeEntry>> List(std::string_view rel_dir) const override;
  Result<TreeEntry> Stat(std::string_view rel) const override;
  Result<OpenedFile> Open(std::string_view rel) const override;
  Result<std::shared_ptr<const LazySource>> OpenLazy(std::string_view rel, const FileIdentity& expected,
                                                     std::shared_ptr<IoCounters> counters,
                                                     std::shared_ptr<FdCache> cache) const override;
  Result<std::shared_ptr<const SourceTree>> Subtree(std::string_view rel_dir) const override;

 private:
  std::string dir_;
};

}  // namespace ucpfs
