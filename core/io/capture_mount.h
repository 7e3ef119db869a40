// The capture state of one mount, and whether another mount's is dead (write capture shared by
// several mounts of one SRC, on one host or on several hosts sharing the directory).
//
// Every mount keeps its capture state in its own directory SRC/.ucpfs/capture/<mount id>/ (made
// by it, mode 0700, so every part and journal path carries the id; two mounts never share a name):
//   lock     an OFD write lock held for the mount's whole life (released by the kernel when the
//            daemon dies, even by SIGKILL)
//   lease    "host <name>\nboot <boot id>\npid <pid>\npidns <pid namespace>\n"; its mtime is renewed every
//            kLeaseRenewSeconds while the mount lives (a heartbeat for other hosts, where a lock
//            over a network filesystem proves nothing)
//   journal  the capture journal (capture_journal.h)
//   <seq>.part
// Another mount's state is touched (recovered, then removed) only when that mount is provably
// dead: its lock can be taken now, and, when its lease names another kernel (another host or a
// boot before this one), the lease is older than the lease timeout.
//
// The capture directory itself is untrusted (it lives in the checkpoint directory): every
// directory and file here is opened without following symlinks, and is used only when it is
// owned by this process's effective user, not writable by group or others (directories), and
// not hard-linked (files).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace ucpfs::io {

inline constexpr uint64_t kLeaseRenewSeconds = 10;

// Owner, type and link count checks of an opened file or directory of the capture state.
// Errors: kInvalidArgument naming `shown` and the rule broken; kIo when fstat fails.
Status CheckOwnedFile(int fd, const std::string& shown);
Status CheckOwnedDir(int fd, const std::string& shown);

// Opens (creating it, mode 0700) directory `name` in `dirfd`, never following a symlink; with
// `owned`, checks it as CheckOwnedDir does. Errors: kIo naming the path; kInvalidArgument when it
// is a symlink, not a directory, or not owned as required.
Result<int> OpenOrMakeDir(int dirfd, const char* name, const std::string& shown, bool owned);

// This mount's state directory, its lock held and its lease written.
class MountState {
 public:
  // Makes SRC/.ucpfs/capture/<new id>/ in `capture_fd`. Errors: kIo naming the path.
  static Result<MountState> Create(int capture_fd, const std::string& capture_dir);
  MountState(MountState&& other) noexcept;
  MountState& operator=(MountState&& other) = delete;
  MountState(const MountState&) = delete;
  ~MountState();

  const std::string& id() const { return id_; }
  int dir_fd() const { return dir_fd_; }
  const std::string& dir_shown() const { return shown_; }
  // Sets the lease's mtime to now. Errors: kIo.
  Status RenewLease() const;
  // A clean end with nothing left: removes the directory (and so releases the lock).
  void Remove();

 private:
  MountState() = default;
  std::string id_;
  std::string shown_;
  int capture_fd_ = -1;  // not owned
  int dir_fd_ = -1;
  int lock_fd_ = -1;
  int lease_fd_ = -1;
};

// Another mount's state, claimed for recovery (its lock is held until this goes).
struct ClaimedMount {
  int dir_fd = -1;
  int lock_fd = -1;
  std::string shown;
  ClaimedMount() = default;
  ClaimedMount(ClaimedMount&& other) noexcept;
  ClaimedMount& operator=(ClaimedMount&&) = delete;
  ~ClaimedMount();
  // Removes every file of the state, then its directory.
  void Remove(int capture_fd, const std::string& name);
};

// The state of mount `name` (an entry of the capture directory), when that mount is provably
// dead (see above); nullopt when it is alive, being recovered by another mount, or cannot be
// told dead yet (`why` says which). Errors: kInvalidArgument when the entry is not a state
// directory this process may use (a symlink, another owner, group- or world-writable).
Result<std::optional<ClaimedMount>> ClaimIfDead(int capture_fd, const std::string& name, const std::string& shown,
                                                uint64_t lease_timeout_s, std::string* why);

// Whether the daemon of mount `name` is exiting on this kernel: its lease names this boot and
// this pid namespace, and its pid is gone, a zombie, exiting, or has SIGKILL pending. A killed
// daemon's lock is released only once its last thread has exited (tens of ms after the kill,
// as long as a blocked fdatasync under load): a mount started meanwhile waits for that lock
// (kDyingLockWaitSeconds at most) rather than leave the state to the mount after it.
bool DaemonExitingHere(int capture_fd, const std::string& name);
inline constexpr uint64_t kDyingLockWaitSeconds = 10;

// The names in directory `dir_fd` (not "." or ".."), with their d_type. Errors: kIo naming `shown`.
Result<std::vector<std::pair<std::string, unsigned char>>> ListDir(int dir_fd, const std::string& shown);

// Unlinks every entry of directory `dir_fd` that is not a directory (never following anything).
void RemoveFilesIn(int dir_fd);

}  // namespace ucpfs::io
