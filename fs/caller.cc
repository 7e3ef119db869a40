// See caller.h. Not for: permission decisions of our own (the kernel makes them, under the
// credentials set here) or FUSE types.
#include "fs/caller.h"

#include <sched.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>

#include "fs/errno_map.h"

namespace ucpfs::fs {
namespace {

// The daemon's own credentials, read once before any thread switches away from them.
struct DaemonCreds {
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;
};

const DaemonCreds& Daemon() {
  static const DaemonCreds creds = [] {
    DaemonCreds c;
    c.uid = geteuid();
    c.gid = getegid();
    const int n = getgroups(0, nullptr);
    if (n > 0) {
      c.groups.resize(static_cast<size_t>(n));
      const int got = getgroups(n, c.groups.data());
      c.groups.resize(got > 0 ? static_cast<size_t>(got) : 0);
    }
    return c;
  }();
  return creds;
}

// The raw syscall: per thread. glibc's setgroups() signals every thread to change (POSIX
// process-wide semantics), which would hand one request's groups to all the others.
int SetThreadGroups(const std::vector<gid_t>& groups) {
  return static_cast<int>(syscall(SYS_setgroups, groups.size(), groups.empty() ? nullptr : groups.data()));
}

// This thread's umask as AsCaller last set it (-1: not known yet). Nothing else in the daemon
// changes a thread's umask.
int& ThreadUmask() {
  thread_local int mask = -1;
  return mask;
}

}  // namespace

bool Caller::Privileged() const { return (switch_creds ? uid : Daemon().uid) == 0; }

bool Caller::InGroup(gid_t g) const {
  if (!switch_creds) return g == Daemon().gid || std::find(Daemon().groups.begin(), Daemon().groups.end(), g) != Daemon().groups.end();
  return g == gid || std::find(groups.begin(), groups.end(), g) != groups.end();
}

Caller Caller::Daemon() {
  Caller c;
  c.uid = fs::Daemon().uid;
  c.gid = fs::Daemon().gid;
  c.groups = fs::Daemon().groups;
  return c;
}

AsCaller::AsCaller(const Caller& caller) {
  const DaemonCreds& d = Daemon();
  if (caller.has_umask) {
    // umask is per fs_struct, which threads share until one unshares it.
    thread_local bool own_fs_struct = false;
    if (!own_fs_struct) {
      if (unshare(CLONE_FS) != 0) {
        status_ = PosixError(errno, "cannot give this thread its own umask");
        return;
      }
      own_fs_struct = true;
    }
    // Most callers' umask is the one this thread has already: then the two umask calls (set,
    // restore) of every create are skipped.
    const auto want = static_cast<mode_t>(caller.umask & 0777);
    if (ThreadUmask() != static_cast<int>(want)) {
      old_umask_ = umask(want);
      ThreadUmask() = static_cast<int>(want);
      switched_umask_ = true;
    }
  }
  if (!caller.switch_creds || (caller.uid == d.uid && caller.gid == d.gid && caller.groups == d.groups)) return;
  if (SetThreadGroups(caller.groups) != 0) {
    status_ = PosixError(errno, "cannot take the caller's groups");
    return;
  }
  switched_groups_ = true;
  setfsgid(caller.gid);
  setfsuid(caller.uid);
  switched_ids_ = true;
  // setfsuid/setfsgid report no error; an invalid id (-1) returns the current one.
  if (static_cast<uid_t>(setfsuid(static_cast<uid_t>(-1))) != caller.uid ||
      static_cast<gid_t>(setfsgid(static_cast<gid_t>(-1))) != caller.gid) {
    status_ = PosixError(EPERM, "cannot act as uid " + std::to_string(caller.uid) + " gid " + std::to_string(caller.gid));
  }
}

AsCaller::~AsCaller() {
  const DaemonCreds& d = Daemon();
  if (switched_ids_) {
    setfsuid(d.uid);
    setfsgid(d.gid);
  }
  if (switched_groups_) (void)SetThreadGroups(d.groups);
  if (switched_umask_) {
    umask(old_umask_);
    ThreadUmask() = static_cast<int>(old_umask_);
  }
}

}  // namespace ucpfs::fs
