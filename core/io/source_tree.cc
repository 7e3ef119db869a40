// See source_tree.h. LocalTree holds the only system calls that look at a checkpoint's source
// directory (the write side of a mount and the index directory aside).
#include "core/io/source_tree.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace ucpfs {

const char* EntryKindName(EntryKind kind) {
  switch (kind) {
    case EntryKind::kFile: return "file";
    case EntryKind::kDirectory: return "directory";
    case EntryKind::kSymlink: return "symlink";
    case EntryKind::kOther: return "other";
  }
  return "other";
}

bool SafeTreePath(std::string_view rel) {
  if (rel.empty()) return true;
  if (rel.front() == '/' || rel.find('\0') != std::string_view::npos) return false;
  size_t start = 0;
  while (start <= rel.size()) {
    size_t end = rel.find('/', start);
    if (end == std::string_view::npos) end = rel.size();
    const std::string_view part = rel.substr(start, end - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = end + 1;
  }
  return true;
}

std::string SourceTree::PathOf(std::string_view rel) const {
  if (rel.empty()) return Root();
  std::string out = Root();
  out += '/';
  out += rel;
  return out;
}

bool SourceTree::IsFile(std::string_view rel) const {
  Result<TreeEntry> e = Stat(rel);
  return e.ok() && e->kind == EntryKind::kFile;
}

bool SourceTree::IsDirectory(std::string_view rel) const {
  Result<TreeEntry> e = Stat(rel);
  return e.ok() && e->kind == EntryKind::kDirectory;
}

namespace {

Status BadPath(const std::string& root, std::string_view rel) {
  return InvalidArgumentError(root + ": '" + std::string(rel) + "' is not a path inside the checkpoint directory");
}

EntryKind KindOf(mode_t mode) {
  if (S_ISREG(mode)) return EntryKind::kFile;
  if (S_ISDIR(mode)) return EntryKind::kDirectory;
  if (S_ISLNK(mode)) return EntryKind::kSymlink;
  return EntryKind::kOther;
}

TreeEntry EntryOf(std::string name, const struct stat& st) {
  TreeEntry e;
  e.name = std::move(name);
  e.kind = KindOf(st.st_mode);
  e.identity = FileIdentity::Of(st);
  e.mode = static_cast<uint32_t>(st.st_mode & 07777);
  e.uid = static_cast<int64_t>(st.st_uid);
  e.gid = static_cast<int64_t>(st.st_gid);
  return e;
}

}  // namespace

LocalTree::LocalTree(std::string dir) : dir_(std::move(dir)) {
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
}

Result<std::vector<TreeEntry>> LocalTree::List(std::string_view rel_dir) const {
  if (!SafeTreePath(rel_dir)) return BadPath(dir_, rel_dir);
  const std::string path = PathOf(rel_dir);
  // The root is followed (the user named it); a directory below it is opened without following
  // a symlink, so a symlinked subdirectory lists as missing, never as its target.
  const int flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC | (rel_dir.empty() ? 0 : O_NOFOLLOW);
  const int fd = ::open(path.c_str(), flags);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR || err == ELOOP) return NotFoundError(path + ": no such directory");
    return IoError(path + ": opendir: " + std::strerror(err), err);
  }
  DIR* d = ::fdopendir(fd);
  if (d == nullptr) {
    const int err = errno;
    ::close(fd);
    return IoError(path + ": opendir: " + std::strerror(err), err);
  }
  std::vector<TreeEntry> out;
  errno = 0;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    if (out.size() == kMaxTreeListEntries) {
      ::closedir(d);
      return ResourceExhaustedError(path + ": more than " + std::to_string(kMaxTreeListEntries) + " names");
    }
    struct stat st;
    if (::fstatat(::dirfd(d), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;  // vanished
    out.push_back(EntryOf(name, st));
    errno = 0;
  }
  const int err = errno;
  ::closedir(d);
  if (err != 0) return IoError(path + ": readdir: " + std::strerror(err), err);
  std::sort(out.begin(), out.end(), [](const TreeEntry& a, const TreeEntry& b) { return a.name < b.name; });
  return out;
}

Result<TreeEntry> LocalTree::Stat(std::string_view rel) const {
  if (!SafeTreePath(rel)) return BadPath(dir_, rel);
  const std::string path = PathOf(rel);
  struct stat st;
  // The root: stat (followed, as the user named it); below it: lstat.
  if ((rel.empty() ? ::stat(path.c_str(), &st) : ::lstat(path.c_str(), &st)) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) return NotFoundError(path + ": no such file or directory");
    return IoError(path + ": stat: " + std::strerror(err), err);
  }
  const size_t slash = rel.rfind('/');
  return EntryOf(std::string(slash == std::string_view::npos ? rel : rel.substr(slash + 1)), st);
}

Result<OpenedFile> LocalTree::Open(std::string_view rel) const {
  if (rel.empty() || !SafeTreePath(rel)) return BadPath(dir_, rel);
  UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<FileSource> file, FileSource::Open(PathOf(rel)));
  OpenedFile out;
  out.identity = file->identity();  // fstat of the descriptor that is read
  out.bytes = std::move(file);
  return out;
}

Result<std::shared_ptr<const LazySource>> LocalTree::OpenLazy(std::string_view rel, const FileIdentity& expected,
                                                              std::shared_ptr<IoCounters> counters,
                                                              std::shared_ptr<FdCache> cache) const {
  if (rel.empty() || !SafeTreePath(rel)) return BadPath(dir_, rel);
  return std::shared_ptr<const LazySource>(
      std::make_shared<LazyFileSource>(PathOf(rel), expected, std::move(counters), std::move(cache)));
}

Result<std::shared_ptr<const SourceTree>> LocalTree::Subtree(std::string_view rel_dir) const {
  if (!SafeTreePath(rel_dir)) return BadPath(dir_, rel_dir);
  return std::shared_ptr<const SourceTree>(std::make_shared<LocalTree>(PathOf(rel_dir)));
}

}  // namespace ucpfs
