// ucpfs as mount(8)'s helper: `mount -t fuse.ucpfs SRC MNT -o ...` and fstab lines of type
// fuse.ucpfs run `mount.fuse.ucpfs SRC MNT [-sfnv] -o LIST`, a symlink to the ucpfs binary
// (installed by `cmake --install`). The option list is cli/mount_options.h's.
#pragma once

namespace ucpfs::cli {

// main() for the helper: parses (ParseMountHelperArgs), mounts (RunMount: returns once the
// mount is ready, the daemon serving in the background) and returns mount(8)'s exit status:
// 0; 1 with the reason on stderr; 2 for a usage error.
int RunMountHelper(int argc, char** argv);

}  // namespace ucpfs::cli
