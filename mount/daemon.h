// The mount daemon: what `ucpfs mount` runs once its arguments are checked. It wires the pieces
// of a mount together: the write capture (core/io/write_capture.h, started first: its recovery
// finishes what a killed daemon left), the views of the source (views/mount_views.h) or of a run
// directory, the re-indexer that rebuilds them after saves (mount/reindexer.h), the `.ucpfs/`
// hooks (sync, the capture's stats, the mount report) and the Passthrough, then serves them
// through FUSE (fs/fuse_mount.h) until unmounted, and drains the capture before it exits.
// Not for: parsing command lines (cli/), the views themselves (views/), FUSE (fs/).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "index/snapshot.h"
#include "views/view_kind.h"

namespace ucpfs::mount {

// --readahead (the mount's kernel readahead window; empty: the source disk's, at least the
// request size of 1 MiB and at most 64 MiB, set by ServeMount) and
// --prefetch (how far ahead of a view's sequential reads its source files are read into the
// page cache; empty: 32 MiB; 0: off). Errors: kInvalidArgument for a bad text or a size out of
// range.
struct ReadAheadSizes {
  uint32_t kernel_n_bytes = 0;             // 0: the request size
  uint64_t prefetch_n_bytes = 32ull << 20;
};
Result<ReadAheadSizes> ParseReadAhead(const std::string& readahead, const std::string& prefetch);

struct DaemonOptions {
  index::SnapshotOptions snapshot;        // SRC (absolute) and its index; --rules loaded
  // The index the command opened (and checked against the source) already, an s3:// source's
  // bucket index: the first generation is built from it rather than opened and checked again.
  std::shared_ptr<const index::OpenedIndex> opened_index;
  views::ViewOptions views;               // parsed (--layout, --preset, ...)
  std::string mountpoint;                 // absolute, prepared (fs::PrepareMountPoint)
  std::vector<std::string> fuse_options;  // -o a,b,c (split on ',')
  std::string log_file;                   // the daemon's stderr, absolute; empty: discarded
  std::string cache_size = "2G";          // --cache-size: the pinned write-capture cache
  uint64_t write_stall_timeout_s = 30;    // --write-stall-timeout (WriteCaptureOptions)
  std::string readahead;                  // --readahead (ParseReadAhead)
  std::string prefetch;                   // --prefetch (ParseReadAhead)
  bool read_only = false;                 // --read-only: no writes, no capture
  // An s3:// source that is not read-only: the local staging directory (absolute; made 0700 when
  // missing) whose files are the mount's read-write area, captured as a local SRC is and
  // uploaded to the bucket in close order (core/io/bucket_uploader.h). Empty: read-only.
  std::string stage_dir;
  // How long an uploaded staged copy stays after its upload and its last close (>= 1 s; see
  // BucketUploaderOptions::keep_ms).
  uint64_t stage_keep_s = 60;
  bool foreground = false;                // serve in this process
  bool no_passthrough = false;            // --no-passthrough: the kernel's passthrough off
  std::string materialize_dir;            // --materialize (absolute, checked); empty: off
  std::string materialize_size = "8G";    // --materialize-size
};

// Builds the namespace and serves it until unmounted; reports failure through `ready_fd` as
// text when >= 0 (else on stderr), and one byte when the mount is live. Returns the exit code.
int ServeMount(const DaemonOptions& options, int ready_fd);

// Forks the daemon (its own session, no terminal, stderr to the log file, only its readiness
// pipe kept open) and returns once the mount is live (0), or once it failed (1, its message on
// stderr). In the foreground: ServeMount(options, -1).
int StartMount(const DaemonOptions& options);

}  // namespace ucpfs::mount
