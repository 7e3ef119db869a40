// Filesystem: what a mount answers, without FUSE. fuse_mount.cc unpacks each kernel request,
// calls one method here, maps an error to errno (errno_map.h) and replies; tests call the same
// methods with no kernel at all.
//
// What it serves: an immutable Tree, plus an optional dynamic directory whose children are
// built on first lookup (Options::resolve) as Trees of their own ("subtrees").
//
// Inode numbers: the main tree's inode i is served as i; subtree slot s (1, 2, ... in the order
// subtrees are built, never reused) serves its local inode i as s << 32 | i.
//
// Inode lifetime (as the kernel sees it): every Entry handed out by Lookup or Reference is one
// kernel reference; Forget(ino, n) gives n back. The main tree is pinned for the session. A
// subtree whose references all come back is evicted: its slot is removed and its Tree
// released (and with it what it held, e.g. a memory reservation of the resolver's), so layouts
// built on lookup cost memory only while the kernel knows them. A later lookup of the same
// name builds it afresh under a new slot, so stale inode numbers never alias.
//
// Thread-safety: every method may be called from any thread at once. The subtree map has one
// lock (mu_), taken shared to find a subtree and exclusive to add or erase one; a subtree is
// erased only when its reference count, re-checked under the exclusive lock, is zero. No lock
// is held while a subtree is built or a file is read. Directory listings are snapshots taken
// at OpenDir.
#pragma once

#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/byte_source.h"
#include "core/status.h"
#include "fs/bucket_files.h"
#include "fs/caller.h"
#include "fs/mount_report.h"
#include "fs/passthrough.h"
#include "fs/tree.h"

namespace ucpfs::fs {

// The smallest step in which a view's read-ahead is topped up (FilesystemOptions::read_ahead_bytes).
inline constexpr uint64_t kReadAheadMinStepBytes = uint64_t{4} << 20;
// The tail of a view announced ahead of the window when a reader starts at its front
// (Filesystem::ReadAhead).
inline constexpr uint64_t kReadAheadTailBytes = uint64_t{64} << 10;

struct FilesystemOptions {
  uid_t uid = 0;  // owner of nodes that have none of their own (TreeNode::uid == -1)
  gid_t gid = 0;
  // Optional dynamic directory (both set, or dynamic_dir 0 for none): a lookup in directory
  // `dynamic_dir` of a name the tree lacks calls resolve(name) (outside any lock, possibly on
  // several threads at once; the first result registered wins a race). Its Tree's root then
  // serves as that child until the kernel forgets it. A resolve error is ENOENT plus a log line
  // "ucpfs: <dir>/<name>: <reason>", not remembered (the next lookup tries again). A listing
  // of `dynamic_dir` shows the names resolved and not evicted; its nlink is 1 (unknown).
  Ino dynamic_dir = 0;
  SubtreeResolver resolve;
  // Optional: names a listing of `dynamic_dir` shows besides the resolved ones (listed as
  // files; readdirplus looks them up by name, through `resolve`).
  SubtreeLister list;
  // The source served read-write beside the views (null: the tree alone, read-only). Names of
  // the tree's root shadow the source's; every other name at the root and below is the
  // source's (inodes with kPassthroughBit).
  std::shared_ptr<Passthrough> passthrough;
  // An s3:// mount's bucket objects, shown in the read-write area where the passthrough (the
  // staging directory) lacks a name (fs/bucket_files.h); null: none. Needs `passthrough`.
  std::shared_ptr<BucketFiles> bucket;
  // Read-ahead of views: after a read of a view file that continues the reads before it, the
  // next `read_ahead_bytes` of the file are announced to its source (ByteSource::Prefetch: the
  // source files' pages are read into the page cache in the background, so the next requests
  // find them there). 0: off. The announced part is topped up in steps of an eighth of it
  // (kReadAheadMinStepBytes at least, half at most). The first announcement, when the read
  // was at the front (within a step of offset 0), also names the file's last
  // kReadAheadTailBytes, before the window (where zip readers look next).
  uint64_t read_ahead_bytes = 0;
  // Where view reads are counted and errors recorded besides the log (null: the log only).
  std::shared_ptr<MountReport> report;
};

// A looked-up node: its inode number and attributes. ino 0 is a negative entry (no such name).
struct Entry {
  Ino ino = 0;
  struct stat attr = {};
};

// One open(2) of a file.
struct OpenFile {
  std::shared_ptr<const ByteSource> source;
  Ino ino = 0;
  uint64_t n_bytes = 0;
  bool volatile_content = false;  // produced at open: never cache its pages
  // A source file (read and written through the passthrough; n_bytes unused): its content may
  // change, and write opens bypass the page cache (the capture holds the bytes).
  std::shared_ptr<PassthroughHandle> passthrough;
  // Read-ahead state of a view file (FilesystemOptions::read_ahead_bytes): how far the source
  // was told to prefetch; null when read-ahead is off.
  std::shared_ptr<std::atomic<uint64_t>> prefetched_until;
  // A view file's identity: its node, owned by the tree (generation) it belongs to; a later
  // generation's file is another node (fs/materialize.h keys its cache by it). Weak: an open
  // file keeps its source, not its tree. Empty for source files.
  std::weak_ptr<const void> node;
};

// One opendir(2): the listing as it was then. ".", "..", then the children in name order.
struct DirListing {
  struct Item {
    std::string name;
    Ino ino = 0;             // 0 for a source entry the kernel has not looked up yet
    bool by_name = false;    // a source entry: readdirplus looks it up by name
    mode_t type = 0;         // S_IFDIR / S_IFREG of a source entry
  };
  std::vector<Item> items;
  bool cacheable = true;  // false for the dynamic directory, whose listing grows
};

class Filesystem {
 public:
  // Errors: kInvalidArgument when dynamic_dir is not a directory of `tree`, has no resolver,
  // or the tree has 2^32 nodes or more.
  static Result<std::unique_ptr<Filesystem>> Make(std::shared_ptr<const Tree> tree,
                                                  FilesystemOptions options);

  // `name` in directory `parent` ("." and ".." too). On success with entry.ino != 0 the caller
  // holds one kernel reference (give it back with Forget when the reply does not reach the
  // kernel). Errors: kNotFound (no such parent; or the dynamic child could not be built: that
  // is logged), ENOTDIR, ENOSPC (too many subtrees), carried in Status::sys_errno.
  Result<Entry> Lookup(Ino parent, std::string_view name);
  // The entry of a listed inode for readdirplus, taking one kernel reference; nullopt when it
  // is gone (an evicted subtree's root listed before it went).
  std::optional<Entry> Reference(Ino ino);
  // The kernel dropped `n_lookups` references to `ino`.
  void Forget(Ino ino, uint64_t n_lookups);

  // Errors: kNotFound.
  Result<struct stat> GetAttr(Ino ino) const;
  // Read-only opens only. Errors: kNotFound, EISDIR, EROFS (write or truncate access), kIo
  // when the node's opener fails (logged with the path), EIO when its source has another size.
  // A source file is opened as `caller` (fs/caller.h; the default acts as the daemon).
  Result<OpenFile> Open(Ino ino, int flags, const Caller& caller = {}) const;
  // Up to buffer.size() bytes at byte_offset (fewer at the end of the file); returns how many.
  // A failing source read is logged with the path and offset (a data-loss message once per
  // distinct message, so a changed source file does not flood the log) and returned.
  Result<size_t> Read(const OpenFile& file, uint64_t byte_offset, std::span<std::byte> buffer);
  // After a read of [byte_offset, +n_bytes) was answered: the read-ahead of view files
  // (FilesystemOptions::read_ahead_bytes). Returns at once; never fails. `file` must stay alive
  // meanwhile: once a read is answered its handle may be released, so pass a copy.
  void ReadAhead(const OpenFile& file, uint64_t byte_offset, uint64_t n_bytes) const;
  // Errors: kNotFound, ENOTDIR.
  Result<DirListing> OpenDir(Ino ino) const;
  // The attributes of a listed inode for readdir (no reference taken); nullopt when gone.
  std::optional<struct stat> StatOf(Ino ino) const;
  struct statvfs StatFs() const;
  // Errors: kNotFound; EROFS when W_OK is asked of a view.
  Status Access(Ino ino, int mask) const;

  // ---- the source, read-write (EROFS for views and the tree's names) ----
  // Each returns what the source gives (errno in Status::sys_errno), acting as `caller`
  // (fs/caller.h; the default acts as the daemon itself).
  Result<struct stat> SetAttr(Ino ino, const struct stat& attr, int to_set, OpenFile* file, const Caller& caller = {});
  // Creates and opens; the Entry holds one kernel reference.
  Result<std::pair<Entry, OpenFile>> Create(Ino parent, std::string_view name, mode_t mode, int flags,
                                            const Caller& caller = {});
  Result<size_t> Write(OpenFile& file, uint64_t byte_offset, std::span<const std::byte> data);
  Status Fsync(OpenFile& file, bool datasync);
  // close(2) of an open file (each close of each descriptor): the error a save into it met.
  Status Flush(OpenFile& file);
  // The last close of an open file (every open gets exactly one).
  Status Release(OpenFile& file);
  Result<Entry> Mkdir(Ino parent, std::string_view name, mode_t mode, const Caller& caller = {});
  // Regular files only (EPERM for FIFOs, sockets and devices).
  Result<Entry> Mknod(Ino parent, std::string_view name, mode_t mode, const Caller& caller = {});
  Result<Entry> Symlink(Ino parent, std::string_view name, const std::string& target, const Caller& caller = {});
  // Errors: EINVAL for anything but a source symlink.
  Result<std::string> Readlink(Ino ino) const;
  Status Unlink(Ino parent, std::string_view name, const Caller& caller = {});
  Status Rmdir(Ino parent, std::string_view name, const Caller& caller = {});
  Status Rename(Ino parent, std::string_view name, Ino new_parent, std::string_view new_name, unsigned flags,
                const Caller& caller = {});
  // xattrs: `user.*` of source files (Passthrough); views have none (get: ENODATA, set: ENOTSUP).
  // size 0: only the size is asked (a vector of that length is returned).
  Status SetXattr(Ino ino, const std::string& name, std::span<const std::byte> value, int flags,
                  const Caller& caller = {});
  Result<std::vector<std::byte>> GetXattr(Ino ino, const std::string& name, size_t size, const Caller& caller = {});
  Result<std::vector<std::byte>> ListXattr(Ino ino, size_t size, const Caller& caller = {});
  Status RemoveXattr(Ino ino, const std::string& name, const Caller& caller = {});
  bool HasPassthrough() const { return options_.passthrough != nullptr; }

  // A new generation of the views (a Snapshot built after a save): from now on the root's view
  // names are `tree`'s, with `dynamic_dir`/`resolve` its dynamic directory (0/empty: none).
  // Inodes of earlier generations stay valid while the kernel holds them (readers keep their
  // snapshot); a replaced generation is released once the kernel has forgotten all of them
  // (the first generation, uncounted, stays for the mount's life). Errors: kInvalidArgument as
  // Make; ENOSPC when the slots are used up.
  Status Swap(std::shared_ptr<const Tree> tree, Ino dynamic_dir, SubtreeResolver resolve,
              SubtreeLister list = nullptr);
  // Generations built so far (1 + swaps).
  uint64_t Generation() const;

  // "/a/b/c" of an inode, through subtrees too, for messages.
  std::string PathOf(Ino ino) const;
  // Subtrees currently built (not evicted).
  size_t NumSubtrees() const;

 private:
  // Logs "ucpfs: <message>" and records it in options_.report.
  void LogError(const std::string& message) const;

  // A tree served in a slot: a generation of the views (after a Swap) or a child of a dynamic
  // directory (built on lookup).
  struct Subtree {
    std::shared_ptr<const Tree> tree;
    std::string name;                    // dynamic child: its name; generation: ""
    uint64_t generation_slot = 0;        // dynamic child: its generation's slot (0: the first)
    bool is_generation = false;
    bool current = false;                // the generation served at the root: never evicted
    Ino dynamic_dir = 0;                 // generation: local inode of its dynamic directory
    SubtreeResolver resolve;             // generation: its resolver
    SubtreeLister list;                  // generation: its lister (may be empty)
    std::atomic<uint64_t> n_lookups{0};  // kernel references to its inodes
  };
  // A node found by its (global) inode number; `tree` keeps a subtree alive while in use.
  struct Found {
    std::shared_ptr<const Tree> tree;
    const TreeNode* node = nullptr;  // nullptr: no such inode
    Ino base = 0;                    // slot << 32 in a subtree; 0 in the first generation
    bool is_root = false;            // the mount's root (kRootIno), whatever generation serves it
  };
  // The generation served at the root.
  struct Current {
    std::shared_ptr<const Tree> tree;
    Ino base = 0;
  };

  Filesystem(std::shared_ptr<const Tree> tree, FilesystemOptions options);
  // With take_reference, a subtree node found also gets one kernel reference, atomically with
  // respect to eviction.
  Found Find(Ino ino, bool take_reference = false) const;
  Found ChildOf(const Found& dir, const TreeNode* local) const;
  Ino GlobalParent(const Found& found) const;
  struct stat Stat(const Found& found) const;
  Entry EntryOf(const Found& found) const;
  // The dynamic child `name` of generation `generation_slot`: found or built now, with one
  // kernel reference taken.
  Result<Found> ResolveChild(uint64_t generation_slot, const std::string& name);
  Current CurrentGeneration() const;
  // The dynamic directory of the generation holding `dir` (local inode, resolver), if `dir` is it.
  bool IsDynamicDir(const Found& dir, SubtreeResolver* resolve, SubtreeLister* list = nullptr) const;
  void Evict(uint64_t slot);  // mu_ held exclusively by the caller via the lock passed
  Ino DynamicDirOf(uint64_t generation_slot) const;  // global inode of a generation's dynamic dir
  // Whether `parent`/`name` goes to the passthrough (true) or is a view's (false; EROFS for
  // changes). Errors: kNotFound for an unknown parent.
  Result<bool> ToSource(Ino parent, std::string_view name) const;
  static Entry PtEntry(const struct stat& st);
  // ---- bucket objects (options_.bucket) ----
  // The bucket directory below the prefix that passthrough directory `dir` stands for.
  std::optional<std::string> BucketDirOf(Ino dir) const;
  // `name` in `parent` where the staging directory has none: a bucket object (its inode), a
  // bucket directory (made in the staging directory, so saves can go into it) or none.
  Result<Entry> BucketLookup(Ino parent, std::string_view name);
  // Adds the bucket's names of passthrough directory `dir` that the listing lacks, in name order.
  Status AddBucketNames(Ino dir, DirListing& listing) const;
  Result<OpenFile> OpenBucketFile(Ino ino, int flags, const Caller& caller) const;
  // A passthrough open refused with ENOENT (`error`): a staged copy removed since its lookup.
  // The bucket's object answers (read-only opens; an O_TRUNC rewrite is staged anew), else `error`.
  Result<OpenFile> OpenRemovedCopy(Ino ino, int flags, const Caller& caller, const Status& error) const;
  // The bucket object now under the name of passthrough file `ino` (a removed staged copy's).
  std::optional<BucketFiles::File> RemovedCopyObject(Ino ino) const;

  const std::shared_ptr<const Tree> tree_;
  const FilesystemOptions options_;
  mutable std::shared_mutex mu_;
  std::map<uint64_t, std::unique_ptr<Subtree>> subtrees_;  // slot -> subtree; guarded by mu_
  std::map<std::pair<uint64_t, std::string>, uint64_t> slot_of_;  // (generation slot, name) -> slot; mu_
  uint64_t next_slot_ = 1;                                  // guarded by mu_
  uint64_t current_slot_ = 0;                               // the served generation; guarded by mu_
  uint64_t n_generations_ = 1;                              // guarded by mu_
  // Source data-loss errors already logged, bounded so a storm of distinct ones cannot grow it.
  std::mutex logged_mu_;
  std::set<std::string> logged_data_loss_;  // guarded by logged_mu_
};

}  // namespace ucpfs::fs
