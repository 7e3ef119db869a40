// Tree: the immutable namespace a mount serves. See tree.h.
//
// Invariants: nodes_[ino - 1].ino == ino; the root (ino 1) is a directory (or, in a OneFile
// tree, the only node: a file) and its own parent;
// every child name is a valid single path component; a directory's nlink is 2 + its
// subdirectories; a file's nlink is the number of names it has.
#include "fs/tree.h"

#include <string_view>
#include <utility>

namespace ucpfs::fs {
namespace {

constexpr size_t kNameMax = 255;  // NAME_MAX: the kernel rejects longer names anyway

Status ValidateName(const std::string& name) {
  if (name.empty()) return InvalidArgumentError("empty file name");
  if (name == "." || name == "..") return InvalidArgumentError("reserved file name '" + name + "'");
  if (name.size() > kNameMax) {
    return InvalidArgumentError("file name longer than 255 bytes: '" + name.substr(0, 40) + "...'");
  }
  if (name.find('/') != std::string::npos) {
    return InvalidArgumentError("file name contains '/': '" + name + "'");
  }
  if (name.find('\0') != std::string::npos) {
    return InvalidArgumentError("file name contains a NUL byte");
  }
  return Status::Ok();
}

}  // namespace

Tree::Tree(struct timespec root_mtime) {
  TreeNode root;
  root.mtime = root_mtime;
  root.ino = kRootIno;
  root.is_dir = true;
  root.mode = 0555;
  root.nlink = 2;
  root.parent = kRootIno;
  nodes_.push_back(std::move(root));
}

Tree Tree::OneFile(uint64_t size, struct timespec mtime, Opener open) {
  Tree tree(mtime);
  TreeNode& root = tree.nodes_[0];
  root.is_dir = false;
  root.mode = 0444;
  root.nlink = 1;
  root.size = size;
  root.open = std::move(open);
  return tree;
}

const TreeNode* Tree::Get(Ino ino) const {
  if (ino == 0 || ino > nodes_.size()) return nullptr;
  return &nodes_[ino - 1];
}

const TreeNode* Tree::Lookup(Ino parent, const std::string& name) const {
  const TreeNode* dir = Get(parent);
  if (dir == nullptr || !dir->is_dir) return nullptr;
  auto it = dir->children.find(name);
  return it == dir->children.end() ? nullptr : Get(it->second);
}

std::string Tree::PathOf(Ino ino) const {
  if (Get(ino) == nullptr) return "<ino " + std::to_string(ino) + ">";
  if (ino == kRootIno) return "/";
  std::string path;
  // Parent links always point to an earlier inode, so this ends at the root.
  for (Ino cur = ino; cur != kRootIno;) {
    const TreeNode& node = nodes_[cur - 1];
    path.insert(0, "/" + node.name);
    cur = node.parent;
  }
  return path;
}

uint64_t Tree::TotalFileBytes() const {
  uint64_t total = 0;
  for (const TreeNode& node : nodes_) {
    if (!node.is_dir) total += node.size;
  }
  return total;
}

Result<Ino> Tree::AddDir(Ino parent, const std::string& name, struct timespec mtime) {
  Result<Ino> ino = AddFile(parent, name, 0, mtime, Opener());
  if (!ino.ok()) return ino;
  TreeNode& node = nodes_[*ino - 1];
  node.is_dir = true;
  node.mode = 0555;
  node.nlink = 2;
  nodes_[parent - 1].nlink++;  // the new directory's ".." names its parent
  return ino;
}

Result<Ino> Tree::AddFile(Ino parent, const std::string& name, uint64_t size,
                          struct timespec mtime, Opener open) {
  UCPFS_RETURN_IF_ERROR(ValidateName(name).WithContext(PathOf(parent)));
  const TreeNode* dir = Get(parent);
  if (dir == nullptr) return InvalidArgumentError("no parent inode " + std::to_string(parent));
  if (!dir->is_dir) return InvalidArgumentError(PathOf(parent) + ": not a directory");
  if (dir->children.contains(name)) {
    return InvalidArgumentError(PathOf(parent) + ": '" + name + "' already exists");
  }
  TreeNode node;
  node.ino = nodes_.size() + 1;
  node.is_dir = false;
  node.mode = 0444;
  node.size = size;
  node.mtime = mtime;
  node.nlink = 1;
  node.open = std::move(open);
  node.parent = parent;
  node.name = name;
  const Ino ino = node.ino;
  nodes_[parent - 1].children.emplace(name, ino);
  nodes_.push_back(std::move(node));
  return ino;
}

Status Tree::AddLink(Ino parent, const std::string& name, Ino target) {
  const TreeNode* file = Get(target);
  if (file == nullptr) return InvalidArgumentError("link target: no inode " + std::to_string(target));
  if (file->is_dir) return InvalidArgumentError(PathOf(target) + ": cannot hard-link a directory");
  UCPFS_RETURN_IF_ERROR(ValidateName(name).WithContext(PathOf(parent)));
  const TreeNode* dir = Get(parent);
  if (dir == nullptr) return InvalidArgumentError("no parent inode " + std::to_string(parent));
  if (!dir->is_dir) return InvalidArgumentError(PathOf(parent) + ": not a directory");
  if (dir->children.contains(name)) {
    return InvalidArgumentError(PathOf(parent) + ": '" + name + "' already exists");
  }
  nodes_[parent - 1].children.emplace(name, target);
  nodes_[target - 1].nlink++;
  return Status::Ok();
}

Result<Ino> Tree::MakeDirs(Ino parent, const std::string& rel_path, struct timespec mtime) {
  const TreeNode* start = Get(parent);
  if (start == nullptr) return InvalidArgumentError("no parent inode " + std::to_string(parent));
  if (!start->is_dir) return InvalidArgumentError(PathOf(parent) + ": not a directory");
  Ino cur = parent;
  std::string_view rest = rel_path;
  while (!rest.empty()) {
    const size_t slash = rest.find('/');
    const std::string part(rest.substr(0, slash));
    rest = slash == std::string_view::npos ? std::string_view() : rest.substr(slash + 1);
    if (part.empty()) continue;  // "a//b", leading or trailing '/'
    if (const TreeNode* existing = Lookup(cur, part)) {
      if (!existing->is_dir) {
        return InvalidArgumentError(PathOf(existing->ino) + ": exists and is not a directory");
      }
      cur = existing->ino;
      continue;
    }
    UCPFS_ASSIGN_OR_RETURN(cur, AddDir(cur, part, mtime));
  }
  return cur;
}

Status Tree::MarkVolatile(Ino ino) {
  if (ino == 0 || ino > nodes_.size() || nodes_[ino - 1].is_dir) {
    return InvalidArgumentError("inode " + std::to_string(ino) + " is not a file");
  }
  nodes_[ino - 1].volatile_content = true;
  return Status::Ok();
}

Status Tree::SetAccess(Ino ino, uint32_t mode, int64_t uid, int64_t gid) {
  if (ino == 0 || ino > nodes_.size()) return InvalidArgumentError("inode " + std::to_string(ino) + " does not exist");
  TreeNode& n = nodes_[ino - 1];
  n.mode = mode & 0555u;  // no write bits, no setuid/setgid/sticky
  n.uid = uid;
  n.gid = gid;
  return Status::Ok();
}

}  // namespace ucpfs::fs
