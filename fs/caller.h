// Caller: who asked for an operation on the source, and AsCaller, which makes this thread act
// with that caller's credentials for the duration of a scope. Knows no FUSE types
// (fuse_mount.cc fills a Caller from the request).
//
// Why: the daemon usually runs as root, and with `allow_other` it serves other users. Every
// change to the source (create, mkdir, chmod, chown, truncate, utimens, rename, unlink, rmdir,
// xattrs) and every open of a source file is done by the real syscall under the caller's
// fsuid, fsgid, supplementary groups and umask, so the kernel itself decides EACCES/EPERM, the
// new file's owner and group (setgid directories), the bits it keeps, and the sticky rule —
// as mergerfs does. Changing the fsuid away from 0 also drops the filesystem capabilities
// (CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_FSETID, CAP_MKNOD...) of this thread; other
// capabilities stay, so what they would allow (security.* / trusted.* xattrs) is refused by
// the Passthrough itself.
//
// Per thread: setfsuid/setfsgid and the raw SYS_setgroups syscall change the calling thread
// only (glibc's setgroups() would change every thread). The umask lives in the thread's
// fs_struct, which the first AsCaller of a thread unshares (unshare(CLONE_FS)), so one
// request's umask never leaks into another's.
#pragma once

#include <sys/types.h>

#include <vector>

#include "core/status.h"

namespace ucpfs::fs {

struct Caller {
  // false: act as the daemon itself (unit tests, a daemon that is not root and so cannot
  // switch: then every user of the mount acts as the daemon's user, as with any FUSE mount).
  bool switch_creds = false;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary groups
  mode_t umask = 0;           // applied by the kernel to what this caller creates
  bool has_umask = false;

  // Whether the one who acts is root (the daemon, or a root caller): it keeps S_ISUID/S_ISGID
  // on write, truncate and chown, and may chown and chmod anything.
  bool Privileged() const;
  // Whether `gid` is the caller's group or one of its supplementary groups.
  bool InGroup(gid_t gid) const;
  // The credentials the daemon acts with when it acts for itself.
  static Caller Daemon();
};

// Switches this thread to `caller`'s credentials (and umask) until destroyed. A no-op when
// caller.switch_creds is false or the caller is the daemon's own user and group. ok() false
// (and nothing changed) when the switch failed: the operation must then be refused.
class AsCaller {
 public:
  explicit AsCaller(const Caller& caller);
  ~AsCaller();
  AsCaller(const AsCaller&) = delete;
  AsCaller& operator=(const AsCaller&) = delete;
  // Errors: EPERM (kIo with sys_errno) when the switch did not take.
  Status status() const { return status_; }

 private:
  bool switched_ids_ = false;
  bool switched_groups_ = false;
  bool switched_umask_ = false;
  mode_t old_umask_ = 0;
  Status status_;
};

}  // namespace ucpfs::fs
