// Passthrough: the source directory served read-write, as libfuse's passthrough_hp serves a
// directory, with new files captured by io::WriteCapture. Knows no FUSE types; the Filesystem
// routes every inode with kPassthroughBit here.
//
// Inodes: one Node per (st_dev, st_ino) of a real file or directory beneath SRC, holding an
// O_PATH descriptor (so it follows the file through renames), a kernel lookup count, and the
// (parent, name) it was last seen under. A node is erased when its count falls to zero,
// re-checked under the map lock. The source root is pinned; the mount's root (kRootIno, the
// view tree's root) stands for it, so callers pass kRootIno as the parent of top-level names.
//
// Captured files: create(2), and open(2) with O_TRUNC of an existing file, start a captured
// file (io::WriteCapture) whose backing part lives in SRC/.ucpfs/capture until it is complete
// and durable; until then its name is an overlay entry of its directory (lookup, listing,
// unlink and rename see it) and its attributes come from the capture (the size written so far).
// Without a WriteCapture, writes go straight to the source files.
//
// Trust: nothing is ever resolved through a symlink by the daemon: every name is one component
// looked up with *at() calls on an O_PATH directory descriptor and AT_SYMLINK_NOFOLLOW /
// O_NOFOLLOW. Symlinks are shown as symlinks (readlink; the caller's kernel follows them, in the
// caller's own name) and may be created; FIFOs, sockets and devices in the source are not shown
// (lookup: ENOENT) and cannot be created (EPERM); hard links cannot be made (EPERM).
//
// Credentials: every method that changes the source or opens one of its files takes the
// Caller and does its syscalls under the caller's credentials (fs/caller.h), so the kernel
// decides permissions, owners and bits. A captured file is written by the daemon into its part
// and renamed into place at commit; the owner, group and mode it must end with are what the
// kernel gives the caller's own create: learned at create time from a real O_EXCL create, by
// the caller, of a hidden placeholder `.ucpfs-create.<pid>.<n>` in the same directory (removed
// at once), so write permission, setgid directories, the umask and S_ISGID stripping are the
// kernel's. For a rewrite (open with O_TRUNC) of an existing file the caller must be able to
// open it for writing (checked by a real open as the caller); it keeps that file's owner, group
// and mode, less S_ISUID/S_ISGID for an unprivileged writer (what truncation does). Until
// placed, a pending file's chmod/chown/unlink follow the kernel's rules (owner or root; chgrp to
// one's own groups; S_ISGID cleared for a non-member; S_ISUID/S_ISGID cleared on chown and on an
// unprivileged write; the sticky rule), applied here because no inode of the caller's exists yet.
// xattrs: only `user.*` names are passed through (to real files, as the caller); others are
// ENOTSUP, since the daemon keeps capabilities (CAP_SETFCAP, CAP_SYS_ADMIN) a switched fsuid
// does not drop. Setting one on a file being saved places it first (as fsync does), so the
// xattr lands on the real file.
//
// Removed files: a node whose file has no name left (unlinked or renamed over, through the
// mount or from outside) and that no open file uses is released at once: its descriptors (the
// O_PATH one, and the capture's of a file saved through the mount) are closed and its
// (st_dev, st_ino) forgotten, so the daemon keeps no blocks of a deleted file even while the
// kernel still knows the inode (it forgets a file removed from outside only when its name is
// looked up again). Later requests for that inode are ENOENT, as for the name on a plain disk;
// an open file keeps working, and its node is released at its last close. Noticed: at an
// unlink or rename through the mount, at the last close, at an open (a stale name), at a
// getattr, and by a sweep of every node (ReleaseRemoved: the bucket uploader after it removes
// staged copies, and at most once a second on a statfs, a listing or a lookup of a missing name).
// Directories are not released (their descriptors are every lookup's): a removed one's node
// keeps its O_PATH descriptor, which holds no data, until the kernel forgets it.
//
// Thread-safety: every method may be called from any thread at once. Lock order: mu_ (the node
// map and overlay), then a file's capture locks (inside WriteCapture); no lock is held across a
// blocking capture call. A node's fd_mu is a leaf (nothing else is taken while it is held): held
// shared while its descriptor is used, exclusive while it is closed or replaced.
#pragma once

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/io/write_capture.h"
#include "core/status.h"
#include "fs/caller.h"
#include "fs/tree.h"

namespace ucpfs::fs {

// Passthrough inode numbers carry this bit (tree inodes and subtree slots stay below it).
inline constexpr Ino kPassthroughBit = Ino{1} << 62;

// One open(2) of a passthrough file.
struct PassthroughHandle {
  Ino ino = 0;
  int fd = -1;  // a real descriptor (plain files); -1 for captured files
  std::shared_ptr<io::CapturedFile> captured;
  bool writable = false;
  // Who opened it; the first write by an unprivileged writer clears S_ISUID/S_ISGID, as the
  // kernel does (kill_privs: the file had such a bit at open).
  Caller caller;
  std::atomic<bool> kill_privs{false};
  std::atomic<bool> closing{false};  // flushed (a close(2)) and not written since
  ~PassthroughHandle();
};

class Passthrough {
 public:
  // `capture` null: no write capture (writes go to the files directly). Errors: kIo naming SRC.
  static Result<std::unique_ptr<Passthrough>> Make(const std::string& source_dir,
                                                   std::shared_ptr<io::WriteCapture> capture);
  ~Passthrough();

  static bool Owns(Ino ino) { return (ino & kPassthroughBit) != 0; }
  int source_fd() const { return root_fd_; }

  // A name in directory `parent` (kRootIno: the source root). ino 0: no such name. Takes one
  // kernel reference. Errors: kIo with sys_errno (ENOTDIR, EACCES, ...).
  Result<struct stat> Lookup(Ino parent, std::string_view name);
  void Forget(Ino ino, uint64_t n_lookups);
  Result<struct stat> GetAttr(Ino ino);
  // `to_set`: FUSE_SET_ATTR_* style bits of kSetMode, kSetUid, kSetGid, kSetSize, kSetAtime,
  // kSetMtime (with kSetAtimeNow/kSetMtimeNow). `handle` may be null.
  enum : int { kSetMode = 1, kSetUid = 2, kSetGid = 4, kSetSize = 8, kSetAtime = 16, kSetMtime = 32,
               kSetAtimeNow = 128, kSetMtimeNow = 256 };
  Result<struct stat> SetAttr(const Caller& caller, Ino ino, const struct stat& attr, int to_set,
                              PassthroughHandle* handle);

  // Errors: EEXIST, EISDIR, ENOENT, EACCES... as the source gives them (kIo with sys_errno).
  Result<std::unique_ptr<PassthroughHandle>> Open(const Caller& caller, Ino ino, int flags);
  // Creates and opens; the returned stat's ino is the new node's (one reference taken).
  Result<std::pair<struct stat, std::unique_ptr<PassthroughHandle>>> Create(const Caller& caller, Ino parent,
                                                                            std::string_view name, mode_t mode,
                                                                            int flags);
  Result<size_t> Read(PassthroughHandle& h, uint64_t byte_offset, std::span<std::byte> out);
  Result<size_t> Write(PassthroughHandle& h, uint64_t byte_offset, std::span<const std::byte> data);
  Status Fsync(PassthroughHandle& h, bool datasync);
  // close(2) of a handle (every close, not only the last): a flush error the file met so far. A
  // handle that captures writes is noted as closing until its Release or its next write
  // (WaitClosesReleased).
  Status Flush(PassthroughHandle& h);
  // The handle is closed: a captured file whose last writer this was is queued for commit.
  Status Release(PassthroughHandle& h);
  // close(2) returns before the kernel's RELEASE reaches the daemon, and the commit of a saved
  // file is queued only at its RELEASE: waits, at most `max`, until every handle that captures
  // writes and was closed (Flush) before this call is released. Returns the paths of those that
  // were not (still open through another descriptor of the same open file: a dup, a fork), which
  // later calls do not wait for again (until closed again).
  std::vector<std::string> WaitClosesReleased(std::chrono::milliseconds max);

  Result<struct stat> Mkdir(const Caller& caller, Ino parent, std::string_view name, mode_t mode);
  // A regular file (empty, created directly); any other type is EPERM.
  Result<struct stat> Mknod(const Caller& caller, Ino parent, std::string_view name, mode_t mode);
  Result<struct stat> Symlink(const Caller& caller, Ino parent, std::string_view name, const std::string& target);
  Result<std::string> Readlink(Ino ino);
  Status Unlink(const Caller& caller, Ino parent, std::string_view name);
  Status Rmdir(const Caller& caller, Ino parent, std::string_view name);
  Status Rename(const Caller& caller, Ino parent, std::string_view name, Ino new_parent, std::string_view new_name,
                unsigned flags);
  // `user.*` xattrs of real files, as the caller. Get/List with size 0 return the size needed.
  // Errors: ENOTSUP (other namespaces; pending files on set), ENODATA, ERANGE, EACCES...
  Status SetXattr(const Caller& caller, Ino ino, const std::string& name, std::span<const std::byte> value,
                  int flags);
  Result<std::vector<std::byte>> GetXattr(const Caller& caller, Ino ino, const std::string& name, size_t size);
  Result<std::vector<std::byte>> ListXattr(const Caller& caller, Ino ino, size_t size);
  Status RemoveXattr(const Caller& caller, Ino ino, const std::string& name);

  struct DirItem {
    std::string name;
    Ino ino = 0;  // the node's number when it has one, else 0 (listed without attributes)
    mode_t type = 0;
  };
  // The directory's entries (files and directories only), sorted by name.
  Result<std::vector<DirItem>> List(Ino dir);
  struct statvfs StatFs();
  // Called after a rename (for the new name, then the old one), unlink or rmdir changed the source
  // (relative path of the name).
  void SetChanged(std::function<void(const std::string&)> changed) { changed_ = std::move(changed); }
  // "/a/b" of a node, for messages.
  std::string PathOf(Ino ino) const;
  // The directory (kRootIno for the root) and name a node was last seen under; nullopt when the
  // node is gone or is the root.
  std::optional<std::pair<Ino, std::string>> ParentOf(Ino ino) const;
  // The relative paths ("a/b") of the files open through the mount now (an open not yet
  // released) or last released less than `recent_ms` ago (at most an hour), for the bucket uploader: it removes no
  // staged copy in use (DCP renames `.metadata.tmp` right after closing it).
  std::vector<std::string> InUsePaths(uint64_t recent_ms);
  // Whether the kernel holds the directory (dev, ino) (a node with a lookup count) or a file is
  // being saved in it, for the bucket uploader: it removes no such empty staging directory, since
  // a create in it through a name or a descriptor the kernel still has would fail (ENOENT).
  bool KnowsDirectory(dev_t dev, ino_t ino);
  // Releases every node whose file was removed and that nothing has open (see the file comment);
  // how many. One fstat per file node.
  size_t ReleaseRemoved();

 private:
  struct Node {
    uint64_t id = 0;
    dev_t dev = 0;
    ino_t ino = 0;
    int fd = -1;  // O_PATH; -1 once released (gone)
    mutable std::shared_mutex fd_mu;  // shared while fd is used, exclusive to close or replace it
    std::atomic<bool> gone{false};    // its file was removed and the node released: ENOENT
    bool is_dir = false;
    bool is_symlink = false;
    std::atomic<uint64_t> n_lookups{0};
    uint64_t parent_id = 0;
    std::string name;
    // Pending or still written through the mount (kept after, until the node goes or is released).
    std::atomic<std::shared_ptr<io::CapturedFile>> captured;
    int open_writers = 0;                        // captured: handles open for writing
  };
  Passthrough(int root_fd, std::string source_dir, std::shared_ptr<io::WriteCapture> capture);
  // Open and Create, not counted in n_open_ (Open and Create count what these return).
  Result<std::unique_ptr<PassthroughHandle>> OpenUncounted(const Caller& caller, Ino ino, int flags);
  Result<std::pair<struct stat, std::unique_ptr<PassthroughHandle>>> CreateUncounted(const Caller& caller, Ino parent,
                                                                                    std::string_view name,
                                                                                    mode_t mode, int flags);
  void CountOpen(Ino ino, int delta);  // +1 an open, -1 its release

  std::shared_ptr<Node> Find(Ino ino) const;
  std::shared_ptr<Node> DirNode(Ino ino) const;  // kRootIno -> the root node
  // The node for a real entry `name` of `dir`, made when new, with one reference taken.
  Result<std::shared_ptr<Node>> NodeFor(const std::shared_ptr<Node>& dir, const std::string& name, bool take_ref,
                                        struct stat* st);
  Result<struct stat> StatNode(const Node& node) const;
  Ino InoOf(const Node& node) const { return node.id == 1 ? kRootIno : (kPassthroughBit | node.id); }
  // The overlay entry (a pending captured file) of `name` in `dir`, or null; one whose file has
  // been placed is dropped first (the real entry now has its name).
  std::shared_ptr<Node> Pending(uint64_t dir_id, const std::string& name);
  // `exclusive`: placed only where no name is then (io::WriteCapture::Create).
  Result<std::unique_ptr<PassthroughHandle>> StartCapture(const std::shared_ptr<Node>& dir, const std::string& name,
                                                          const struct stat& attr, std::shared_ptr<Node>* made,
                                                          bool exclusive = false);
  // The owner, group and mode (st_uid, st_gid, st_mode) the kernel gives `caller`'s new file in
  // `dir`, from a real O_EXCL create of a placeholder there (see the file comment).
  Result<struct stat> ProbeCreate(const Caller& caller, const Node& dir, mode_t mode);
  // Whether `caller` may remove or replace a pending file owned by `owner` in `dir`: write and
  // search permission on it (asked of the kernel as the caller), and the sticky rule.
  Status MayDelete(const Caller& caller, const Node& dir, uid_t owner);
  // Captured and not settled: its attributes are the capture's.
  bool CapturedNow(const Node& node) const;
  bool CapturedNow(const std::shared_ptr<io::CapturedFile>& captured) const;
  // Releases `node` (see the file comment) when its file has no name left and nothing has it
  // open (but `own_opens` counted opens: the caller's); whether it did (or it was already).
  bool ReleaseIfRemoved(const std::shared_ptr<Node>& node, int own_opens = 0);
  // Whether `node` is a pending file's overlay entry (mu_ held); entries of files placed since
  // are dropped.
  bool PendingLocked(const Node& node);
  // The node of (st_dev, st_ino), or null.
  std::shared_ptr<Node> NodeOfFile(dev_t dev, ino_t ino) const;
  // ReleaseRemoved, at most once a second (what a statfs, listing or missed lookup calls).
  void SweepSoon();
  // ENOENT for a released node.
  static Status Gone(const Node& node);
  // Captured and not yet under its name at all (no inode of its own there: no xattrs).
  bool Unplaced(const Node& node) const;
  // mkdir/mknod/symlink: `make(dirfd, name)` (0 or -1 with errno) run as the caller, then the
  // new entry's node (one reference taken).
  Result<struct stat> MakeEntry(const Caller& caller, Ino parent, std::string_view name, const char* what,
                                const std::function<int(int, const char*)>& make);

  const int root_fd_;
  const std::string source_dir_;
  const std::shared_ptr<io::WriteCapture> capture_;
  std::function<void(const std::string&)> changed_;
  std::atomic<int64_t> last_sweep_ns_{0};  // SweepSoon's last sweep (steady clock)
  // Handles that capture writes, closed (flushed) and not yet released: (its close's number, its
  // inode). Keys are never dereferenced. Guarded by mu_.
  std::map<const PassthroughHandle*, std::pair<uint64_t, Ino>> closing_;
  uint64_t n_closes_ = 0;                // guarded by mu_
  std::condition_variable closing_cv_;  // closing_ lost an entry
  mutable std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<Node>> nodes_;                      // id -> node; guarded by mu_
  struct OpenCount {
    int n = 0;  // handles not released
    std::chrono::steady_clock::time_point released;
  };
  std::map<Ino, OpenCount> opens_;  // inodes opened (InUsePaths); guarded by mu_
  std::map<std::pair<dev_t, ino_t>, uint64_t> by_file_;                  // guarded by mu_
  std::map<std::pair<uint64_t, std::string>, uint64_t> overlay_;         // (dir id, name) -> id; mu_
  uint64_t next_id_ = 2;                                                 // guarded by mu_
};

}  // namespace ucpfs::fs
