// Tree: the immutable namespace a mount serves (directories and read-only files), built once
// before the mount goes live. Knows no FUSE types. Inode numbers are assigned in build order
// (root = 1), so the same index always yields the same numbers.
//
// File content comes from an opener called at open(2) time (lazily: `ls`, `stat`, `du` and
// `find` never call it); sizes are fixed at build time and must equal the opened source's
// Size(). Identical virtual files may share one inode (AddLink) so the page cache holds them once.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <ctime>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/byte_source.h"
#include "core/status.h"

namespace ucpfs::fs {

using Ino = uint64_t;
inline constexpr Ino kRootIno = 1;

using Opener = std::function<Result<std::shared_ptr<const ByteSource>>()>;

struct TreeNode {
  Ino ino = 0;
  bool is_dir = false;
  uint32_t mode = 0;         // permission bits only (0555 dirs, 0444 files, or SetAccess's)
  int64_t uid = -1;          // owner; -1: the mounting user
  int64_t gid = -1;          // group; -1: the mounting user's group
  uint64_t size = 0;         // files: exact byte size
  struct timespec mtime = {};
  uint32_t nlink = 1;
  Opener open;               // files
  // Files whose content is produced at open time (counters): served with direct_io, never
  // cached by the kernel. Their size is fixed at build time like any other file's.
  bool volatile_content = false;
  std::map<std::string, Ino> children;  // dirs: name -> inode, sorted
  Ino parent = kRootIno;     // the directory holding `name` (root: itself)
  std::string name;          // first name under `parent` ("" for the root); for messages
};

// Builds the Tree of one directory whose content is only known when it is first looked up
// (see MountOptions::resolve): its root becomes the directory `name`.
class Tree;
using SubtreeResolver =
    std::function<Result<std::shared_ptr<const Tree>>(const std::string& name)>;
// Names a dynamic directory lists before they are looked up (see FilesystemOptions::list).
using SubtreeLister = std::function<std::vector<std::string>()>;

class Tree {
 public:
  explicit Tree(struct timespec root_mtime = {});  // creates the root directory (ino 1)
  // A tree whose root (ino 1) is one read-only file, served as a dynamic directory's child that
  // is a file (e.g. target/<layout>.error): its own name comes from the resolver.
  static Tree OneFile(uint64_t size, struct timespec mtime, Opener open);

  // Adds a directory / file under `parent`. Errors: kInvalidArgument (parent not a
  // directory, empty name or one with '/'), kAlreadyExists-like kInvalidArgument on a clash.
  // Names must also not be "." or "..", contain NUL or exceed 255 bytes (NAME_MAX).
  // Directories get nlink 2 + their number of subdirectories (the POSIX convention).
  Result<Ino> AddDir(Ino parent, const std::string& name, struct timespec mtime);
  Result<Ino> AddFile(Ino parent, const std::string& name, uint64_t size, struct timespec mtime,
                      Opener open);
  // Marks a file as volatile (see TreeNode::volatile_content). Errors: kInvalidArgument.
  Status MarkVolatile(Ino ino);
  // Sets a node's permission bits (write bits are always cleared: the tree is read-only) and
  // owner (-1: the mounting user's). Errors: kInvalidArgument for an unknown inode.
  Status SetAccess(Ino ino, uint32_t mode, int64_t uid, int64_t gid);
  // Another name for an existing file inode (hard link; nlink is incremented).
  Status AddLink(Ino parent, const std::string& name, Ino target);
  // Creates missing directories along `rel_path` ("a/b/c") under `parent`; returns the last.
  // Empty components ("a//b", leading or trailing '/') are skipped; "" returns `parent`.
  // Errors: kInvalidArgument when a component is a file or an invalid name.
  Result<Ino> MakeDirs(Ino parent, const std::string& rel_path, struct timespec mtime);

  // nullptr when absent. Pointers stay valid until the next Add*/MakeDirs call (a served
  // tree is never changed again, so FUSE workers may hold them freely).
  const TreeNode* Get(Ino ino) const;
  const TreeNode* Lookup(Ino parent, const std::string& name) const;
  size_t size() const { return nodes_.size(); }
  // Sum of file sizes, each inode once (hard links do not count twice, as in du).
  uint64_t TotalFileBytes() const;
  // "/a/b/c" built from parent links and first names ("/" for the root, "<ino N>" when unknown).
  std::string PathOf(Ino ino) const;

 private:
  std::vector<TreeNode> nodes_;  // nodes_[ino - 1]
};

}  // namespace ucpfs::fs
