// BucketFiles: see bucket_files.h.
#include "fs/bucket_files.h"

#include <algorithm>
#include <utility>

#include "fs/errno_map.h"

namespace ucpfs::fs {
namespace {

constexpr size_t kNameMax = 255;
// st_blksize of the bucket's files: 1 MiB, where view files say a disk file's 4096
// (filesystem.cc). Every read here goes through the daemon and its read-ahead; 4096 asked for
// the same GET bytes and took the same time in s3_bench.py over RGW, so it was left.
constexpr blksize_t kStatBlockSize = 1 << 20;
constexpr int kListAttempts = 4;

std::string Join(const std::string& dir, const std::string& name) { return dir.empty() ? name : dir + "/" + name; }

std::string DirOf(const std::string& rel) {
  const size_t slash = rel.rfind('/');
  return slash == std::string::npos ? std::string() : rel.substr(0, slash);
}

}  // namespace

Status BucketFiles::Listed(const std::string& rel_dir) {
  {
    std::lock_guard lock(mu_);
    if (listings_.contains(rel_dir)) return Status::Ok();
  }
  std::vector<TreeEntry> entries;
  Result<std::vector<TreeEntry>> listed = tree_->List(rel_dir);  // no lock held: a request
  if (listed.ok()) {
    entries = std::move(*listed);
  } else if (listed.error().code() != StatusCode::kNotFound) {
    return listed.error();
  }
  std::erase_if(entries, [](const TreeEntry& e) {
    return e.name.size() > kNameMax || (e.kind != EntryKind::kFile && e.kind != EntryKind::kDirectory);
  });
  std::lock_guard lock(mu_);
  if (n_cached_ + entries.size() > kMaxCachedBucketEntries) {
    listings_.clear();
    n_cached_ = 0;
  }
  const size_t n = entries.size();
  if (listings_.emplace(rel_dir, std::move(entries)).second) n_cached_ += n;
  return Status::Ok();
}

bool BucketFiles::VisibleLocked(const std::string& rel_dir, const TreeEntry& e) const {
  const std::string rel = Join(rel_dir, e.name);
  if (hidden_.contains(rel)) return false;
  if (e.kind != EntryKind::kDirectory) return true;
  // A directory whose kept listing shows nothing (its objects unlinked through the mount).
  const auto sub = listings_.find(rel);
  if (sub == listings_.end()) return true;
  return std::any_of(sub->second.begin(), sub->second.end(),
                     [&](const TreeEntry& c) { return !hidden_.contains(Join(rel, c.name)); });
}

Result<std::vector<TreeEntry>> BucketFiles::List(const std::string& rel_dir) {
  // A listing dropped (Landed) between Listed and the lock is listed again (a few tries: each
  // drop means an upload landed just then).
  for (int attempt = 0; attempt < kListAttempts; ++attempt) {
    UCPFS_RETURN_IF_ERROR(Listed(rel_dir));
    std::lock_guard lock(mu_);
    const auto it = listings_.find(rel_dir);
    if (it == listings_.end()) continue;
    std::vector<TreeEntry> out;
    for (const TreeEntry& e : it->second) {
      if (VisibleLocked(rel_dir, e)) out.push_back(e);
    }
    return out;
  }
  return IoError(Url(rel_dir) + ": its listing changed " + std::to_string(kListAttempts) + " times while read", EAGAIN);
}

Result<std::optional<TreeEntry>> BucketFiles::Find(const std::string& rel_dir, const std::string& name) {
  for (int attempt = 0; attempt < kListAttempts; ++attempt) {
    UCPFS_RETURN_IF_ERROR(Listed(rel_dir));
    std::lock_guard lock(mu_);
    const auto dir = listings_.find(rel_dir);
    if (dir == listings_.end()) continue;
    const auto it = std::lower_bound(dir->second.begin(), dir->second.end(), name,
                                     [](const TreeEntry& e, const std::string& n) { return e.name < n; });
    if (it == dir->second.end() || it->name != name || !VisibleLocked(rel_dir, *it)) return std::optional<TreeEntry>();
    return std::optional<TreeEntry>(*it);
  }
  return IoError(Url(rel_dir) + ": its listing changed " + std::to_string(kListAttempts) + " times while read", EAGAIN);
}

Result<struct stat> BucketFiles::Reference(Ino parent, const std::string& rel_dir, const TreeEntry& entry, uid_t uid,
                                           gid_t gid) {
  if (entry.kind != EntryKind::kFile) return PosixError(EISDIR, Url(Join(rel_dir, entry.name)) + " is not a file");
  const std::string rel = Join(rel_dir, entry.name);
  std::lock_guard lock(mu_);
  const auto key = std::make_pair(rel, entry.identity.ino);
  auto it = by_version_.find(key);
  if (it == by_version_.end() || !nodes_.contains(it->second)) {
    Node node;
    node.file = File{parent, rel, entry.name, entry.identity, 0};
    nodes_.emplace(next_id_, std::move(node));
    it = by_version_.insert_or_assign(key, next_id_++).first;
  }
  Node& node = nodes_.at(it->second);
  ++node.n_lookups;
  node.file.parent = parent;
  return StatOf(kPassthroughBit | kBucketBit | it->second, node.file, uid, gid);
}

Ino BucketFiles::Forget(Ino ino, uint64_t n_lookups) {
  std::lock_guard lock(mu_);
  const auto it = nodes_.find(ino & ~(kPassthroughBit | kBucketBit));
  if (it == nodes_.end()) return 0;
  Node& node = it->second;
  node.n_lookups -= std::min(node.n_lookups, n_lookups);
  if (node.n_lookups > 0) return 0;
  const Ino shadow = node.file.shadow;
  by_version_.erase({node.file.rel, node.file.identity.ino});
  nodes_.erase(it);
  return shadow;
}

std::optional<BucketFiles::File> BucketFiles::Get(Ino ino) const {
  std::lock_guard lock(mu_);
  const auto it = nodes_.find(ino & ~(kPassthroughBit | kBucketBit));
  if (it == nodes_.end()) return std::nullopt;
  return it->second.file;
}

bool BucketFiles::SetShadow(Ino ino, Ino shadow) {
  std::lock_guard lock(mu_);
  const auto it = nodes_.find(ino & ~(kPassthroughBit | kBucketBit));
  if (it == nodes_.end() || it->second.file.shadow != 0) return false;
  it->second.file.shadow = shadow;
  return true;
}

struct stat BucketFiles::StatOf(Ino ino, const File& file, uid_t uid, gid_t gid) const {
  struct stat st = {};
  st.st_ino = ino;
  st.st_mode = S_IFREG | 0644;
  st.st_nlink = 1;
  st.st_uid = uid;
  st.st_gid = gid;
  st.st_size = static_cast<off_t>(file.identity.n_bytes);
  st.st_blksize = kStatBlockSize;
  st.st_blocks = static_cast<blkcnt_t>((file.identity.n_bytes + 511) / 512);
  st.st_mtim.tv_sec = file.identity.mtime_ns / 1000000000;
  st.st_mtim.tv_nsec = file.identity.mtime_ns % 1000000000;
  st.st_ctim = st.st_mtim;
  st.st_atim = st.st_mtim;
  return st;
}

Result<std::shared_ptr<const LazySource>> BucketFiles::Open(const File& file,
                                                           std::shared_ptr<IoCounters> counters) const {
  return tree_->OpenLazy(file.rel, file.identity, std::move(counters), nullptr);
}

Status BucketFiles::Remove(const std::string& rel) const {
  if (!remove_) return PosixError(EROFS, Url(rel) + ": this mount deletes no object");
  return remove_(rel);
}

void BucketFiles::Removed(const std::string& rel) {
  std::lock_guard lock(mu_);
  if (hidden_.size() >= kMaxHiddenBucketNames) hidden_.erase(hidden_.begin());
  hidden_.insert(rel);
}

void BucketFiles::Unhide(const std::string& rel) {
  std::lock_guard lock(mu_);
  hidden_.erase(rel);
}

void BucketFiles::Landed(const std::string& rel) {
  std::lock_guard lock(mu_);
  hidden_.erase(rel);
  // The key's directory and its ancestors (a new key may make a new directory) are listed again.
  std::string dir = rel;
  do {
    dir = DirOf(dir);
    if (const auto it = listings_.find(dir); it != listings_.end()) {
      n_cached_ -= it->second.size();
      listings_.erase(it);
    }
  } while (!dir.empty());
}

}  // namespace ucpfs::fs
