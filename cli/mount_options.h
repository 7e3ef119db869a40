// The `-o` option list of a mount, shared by `ucpfs mount SRC MNT -o ...` and the mount(8)
// helper `mount.fuse.ucpfs SRC MNT [-sfnv] -o ...` (what `mount -t fuse.ucpfs` and fstab run).
// Not for the `--long-option` form of `ucpfs mount` (main.cc's CLI11 table sets the same
// MountArgs fields).
//
// Every option is `name` or `name=value`, comma-separated; a value holds no comma (pp_split
// writes its list with ':', e.g. pp_split=5:6:6:5). Four kinds:
//   - ucpfs's own: each `ucpfs mount --long-option` as `long_option[=value]`; `layout` repeats,
//     for the others the last one given wins (fstab's list, then the command line's).
//   - mount(8)'s generic options, as sshfs handles them: ro/rw set read_only; defaults, auto,
//     noauto, nofail, _netdev, user, users, nouser, owner, group, atime, diratime, loud, silent,
//     comment=..., x-* (x-systemd.*) are for mount(8)/systemd and dropped; dev, nodev, suid,
//     nosuid, exec, noexec, sync, async, dirsync, noatime, nodiratime, relatime, norelatime,
//     strictatime, nostrictatime go to the kernel through FUSE.
//   - FUSE options, passed on: allow_other, allow_root, auto_unmount, default_permissions,
//     max_read=N, fsname=NAME, and the SELinux context=, fscontext=, defcontext=, rootcontext=.
//   - anything else is refused (kInvalidArgument naming the option), unless `sloppy` (mount's
//     -s), which drops it with a warning.
// Values are checked here as far as they can be without the checkpoint (layout names, sizes,
// numbers, pp_split), so a typo fails before the daemon starts.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "cli/checkpoint_cmds.h"
#include "core/status.h"

namespace ucpfs::cli {

// Applies the comma-separated `list` to `args` (fields of ucpfs options set, FUSE options
// appended to args->fuse_options). `warnings` (optional) receives one line per option dropped
// by `sloppy`. Errors: kInvalidArgument naming the option: unknown (with the underscore
// spelling when a dash was used), a value given to a flag, a missing or empty value, a bad
// value (names the value and what is accepted).
Status ApplyMountOptions(std::string_view list, MountArgs* args, bool sloppy = false,
                         std::vector<std::string>* warnings = nullptr);

// True when argv[0]'s basename is `mount.fuse.ucpfs` or `mount.ucpfs`: ucpfs runs as mount(8)'s
// helper.
bool IsMountHelperName(std::string_view argv0);

// The helper's command line (after argv[0]): SRC MNT, then -s (sloppy), -f (fake: check, do not
// mount), -n (no mtab: ignored, there is none), -v (verbose), -o LIST (repeatable), in any
// order, as util-linux 2.38 passes them (`SRC MNT -s -f -n -v -o LIST`).
struct MountHelperArgs {
  MountArgs mount;
  bool fake = false;
  bool verbose = false;
  std::vector<std::string> warnings;  // options dropped under -s
};
// Errors: kInvalidArgument for a missing SRC or MNT, an extra argument, an unknown flag, -o
// without its list, and ApplyMountOptions' errors.
Result<MountHelperArgs> ParseMountHelperArgs(const std::vector<std::string>& args);

}  // namespace ucpfs::cli
