#include "cli/mount_helper.h"

#include <iostream>
#include <string>
#include <vector>

#include "cli/checkpoint_cmds.h"
#include "cli/mount_options.h"

namespace ucpfs::cli {

int RunMountHelper(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  auto parsed = ParseMountHelperArgs(args);
  if (!parsed.ok()) {
    std::cerr << "mount.fuse.ucpfs: " << parsed.error().message() << '\n';
    return 2;
  }
  for (const std::string& w : parsed->warnings) std::cerr << "mount.fuse.ucpfs: warning: " << w << '\n';
  const MountArgs& m = parsed->mount;
  if (parsed->verbose) {
    std::string fuse;
    for (const std::string& o : m.fuse_options) fuse += (fuse.empty() ? "" : ",") + o;
    std::string layouts;
    for (const std::string& l : m.layouts) layouts += (layouts.empty() ? "" : ",") + l;
    std::cerr << "mount.fuse.ucpfs: " << (parsed->fake ? "would mount " : "mounting ") << m.source.src << " at "
              << m.mountpoint << (m.read_only ? " read-only" : "") << ", cache " << m.cache_size << ", layouts ["
              << layouts << "], FUSE options [" << fuse << "]\n";
  }
  if (parsed->fake) return 0;
  return RunMount(m);
}

}  // namespace ucpfs::cli
