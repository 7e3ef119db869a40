// `ucpfs sync`, `ucpfs status`, `ucpfs umount`: commands on a live mount, through its `.ucpfs/`.
#pragma once

#include <string>

namespace ucpfs::cli {

// Makes everything captured durable first (as `ucpfs sync`), then unmounts.
int RunUmount(const std::string& mountpoint);
// Returns once everything saved into the mount before the call is durable; non-zero with the
// reason when a flush failed (the data stays in the daemon's cache).
// Progress (bytes flushed, still dirty, from MNT/.ucpfs/stats.json) on stderr while it waits.
struct SyncArgs {
  std::string mountpoint;
  bool json = false;   // --json: {"mount", "bytes_flushed", "dirty_bytes", "seconds"} on stdout
  bool quiet = false;  // -q, --quiet: no progress
};
int RunSync(const SyncArgs& args);
// Prints what the mount serves (status.json) and its counters (stats.json).
int RunStatus(const std::string& mountpoint, bool json);

}  // namespace ucpfs::cli
