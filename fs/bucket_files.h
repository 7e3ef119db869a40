// BucketFiles: the objects of an s3:// mount's bucket prefix shown in its read-write area beside
// the staged files (the Passthrough of the staging directory), so a checkpoint already in the
// bucket (its shards, `.metadata`, `latest`) shows as files as a local source's do. The
// Filesystem asks it only for names the staging directory lacks: a staged file wins over an
// object of the same name.
//
// Listing: a directory's objects are listed (SourceTree::List: ListObjectsV2 with delimiter '/',
// at most kMaxTreeListEntries names) on its first use and kept; Landed (the uploader put or
// deleted a key) drops the listing of the key's directory and its ancestors, so the next use
// lists again. All kept listings hold at most kMaxCachedBucketEntries entries together (past
// that every listing is dropped and listed again on use). Names that are no file name (longer
// than 255 bytes) are left out. A name unlinked through the mount (Removed) is hidden until the
// uploader's DELETE of it lands; a directory whose kept listing has nothing visible is hidden.
//
// Files: inodes kPassthroughBit | kBucketBit | id, one per (path, version) looked up, counted
// like the Passthrough's (Reference, Forget). Attributes: the object's size and Last-Modified,
// mode 0644, the mount owner's uid/gid. Open gives a LazySource reading only the ranges asked
// for (ranged GETs with If-Match on the listed ETag: an object replaced in the bucket reads as
// kDataLoss, EIO, never as other bytes). A file rewritten through the mount (open with O_TRUNC)
// is staged; the Filesystem records that staged file as the inode's shadow (SetShadow), which
// then answers for it. Nothing here writes to the bucket: Remove hands a DELETE to SetRemove's
// function.
//
// Thread-safe: one lock, never held across a listing.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/io/source_tree.h"
#include "core/status.h"
#include "fs/passthrough.h"

namespace ucpfs::fs {

// Bucket object inodes carry this bit besides kPassthroughBit (routed as source files).
inline constexpr Ino kBucketBit = Ino{1} << 61;
// The most listing entries kept for all directories together.
inline constexpr size_t kMaxCachedBucketEntries = size_t{1} << 20;
// The most names hidden at once (unlinked, DELETE not landed yet); past it the oldest shows again.
inline constexpr size_t kMaxHiddenBucketNames = size_t{1} << 16;

class BucketFiles {
 public:
  explicit BucketFiles(std::shared_ptr<const SourceTree> tree) : tree_(std::move(tree)) {}

  static bool Owns(Ino ino) { return (ino & kBucketBit) != 0 && (ino & kPassthroughBit) != 0; }
  // s3://BUCKET/PREFIX/rel, for messages.
  std::string Url(const std::string& rel) const { return tree_->PathOf(rel); }

  // The visible entries of directory `rel_dir` ("" the prefix itself), sorted by name; none
  // when the bucket has no key under it. Errors: the listing's (kIo, kResourceExhausted).
  Result<std::vector<TreeEntry>> List(const std::string& rel_dir);
  // The visible entry `name` of `rel_dir`, or nullopt. Errors: List's.
  Result<std::optional<TreeEntry>> Find(const std::string& rel_dir, const std::string& name);

  // One kernel reference to the file `rel_dir`/`name` (entry: what Find gave), looked up under
  // the passthrough directory `parent`; the same inode while the same version is referenced.
  Result<struct stat> Reference(Ino parent, const std::string& rel_dir, const TreeEntry& entry, uid_t uid, gid_t gid);
  // Gives back n references; returns the staged shadow's inode to forget (one reference) when
  // the node went and had one, else 0.
  Ino Forget(Ino ino, uint64_t n_lookups);

  struct File {
    Ino parent = 0;      // the passthrough directory it was looked up in
    std::string rel;     // path below the prefix
    std::string name;    // last component
    FileIdentity identity;
    Ino shadow = 0;      // the staged file that replaced it through the mount (0: none)
  };
  std::optional<File> Get(Ino ino) const;
  // The staged file `shadow` (one reference, kept until this node goes) now answers for `ino`.
  // Returns false (the caller forgets `shadow`) when the node is gone or has one already.
  bool SetShadow(Ino ino, Ino shadow);
  struct stat StatOf(Ino ino, const File& file, uid_t uid, gid_t gid) const;
  // The object's bytes, read on demand with ranged GETs checked against its identity.
  Result<std::shared_ptr<const LazySource>> Open(const File& file, std::shared_ptr<IoCounters> counters) const;

  // Who deletes an object (an s3:// mount: the uploader, which journals the DELETE behind the
  // uploads queued before it). Set before the mount serves.
  void SetRemove(std::function<Status(const std::string& rel)> remove) { remove_ = std::move(remove); }
  // Deletes the object `rel` (SetRemove's function). Errors: its; EROFS when none is set.
  Status Remove(const std::string& rel) const;
  // `rel` was unlinked through the mount: hidden until Landed(rel).
  void Removed(const std::string& rel);
  // Undoes Removed(rel): the unlink failed.
  void Unhide(const std::string& rel);
  // The uploader put or deleted `rel` in the bucket: shown as the bucket now has it.
  void Landed(const std::string& rel);

 private:
  struct Node {
    File file;
    uint64_t n_lookups = 0;
  };
  // Lists `rel_dir` now unless its listing is kept. Errors: the listing's.
  Status Listed(const std::string& rel_dir);
  // Whether entry `e` of `rel_dir` shows: not hidden, and not a directory whose kept listing
  // shows nothing. mu_ held.
  bool VisibleLocked(const std::string& rel_dir, const TreeEntry& e) const;

  const std::shared_ptr<const SourceTree> tree_;
  std::function<Status(const std::string&)> remove_;
  mutable std::mutex mu_;
  std::map<std::string, std::vector<TreeEntry>> listings_;  // rel_dir -> entries; mu_
  size_t n_cached_ = 0;                                      // entries in listings_; mu_
  std::set<std::string> hidden_;                             // mu_
  std::map<uint64_t, Node> nodes_;                           // id -> node; mu_
  std::map<std::pair<std::string, uint64_t>, uint64_t> by_version_;  // (rel, etag ino) -> id; mu_
  uint64_t next_id_ = 1;                                     // mu_
};

}  // namespace ucpfs::fs
