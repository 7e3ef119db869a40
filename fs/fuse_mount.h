// Serves a Tree through FUSE (libfuse3 low-level API, multi-threaded): fuse_mount.cc adapts
// kernel requests to a Filesystem (filesystem.h). This header knows no FUSE types;
// fuse_mount.cc is the only file that includes <fuse_lowlevel.h>.
//
// Behaviour: views are read-only (EROFS), opened with keep_cache and long attr/entry timeouts
// (they are immutable), mmap works (with --materialize, the open that queues a copy's build reads
// direct_io, MAP_SHARED still allowed: fuse_read.cc); the source's own files (a Passthrough) are
// read-write with 1 s timeouts, written ones opened direct_io (their bytes go to the capture,
// not the page cache). A failing source read returns EIO and logs the file and reason to
// stderr, never crashes the daemon.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "fs/bucket_files.h"
#include "fs/materialize.h"
#include "fs/mount_report.h"
#include "fs/passthrough.h"
#include "fs/tree.h"

namespace ucpfs::fs {

class Filesystem;

struct MountOptions {
  std::string mountpoint;
  std::vector<std::string> fuse_options;  // from -o, e.g. "allow_other", "max_read=1048576"
  // When >= 0: one byte is written once the mount is live (its root answers stat), and the
  // pipe is then released: the descriptor is re-pointed at /dev/null, so the reader sees EOF
  // while the number stays valid. The caller owns the descriptor throughout (ServeTree never
  // closes it): when ServeTree fails before the mount is live nothing was written, so the
  // caller can report the error through it; later writes go harmlessly to /dev/null.
  int ready_fd = -1;
  int max_threads = 16;     // FUSE worker threads
  // The mount's kernel readahead window (the bdi's read_ahead_kb, set once the mount is live;
  // 0: the request size, max_read). The kernel cuts it into max_read requests that are in
  // flight at once (up to the kernel's max_background, 12), so a window of several requests keeps the daemon's
  // source reads overlapping the transfers.
  uint32_t readahead_bytes = 0;
  // How far ahead of a view's sequential reads its source files are told to prefetch
  // (FilesystemOptions::read_ahead_bytes; 0: off).
  uint64_t source_read_ahead_bytes = 0;
  std::string fsname = "ucpfs";
  // Optional dynamic directory (both set, or dynamic_dir 0 for none): children built on first
  // lookup and evicted when the kernel forgets them. See FilesystemOptions (filesystem.h).
  Ino dynamic_dir = 0;
  SubtreeResolver resolve;
  SubtreeLister list;  // names the dynamic directory lists before they are looked up (optional)
  // The source served read-write beside the tree (FilesystemOptions::passthrough); null: the
  // mount is read-only ("ro").
  std::shared_ptr<Passthrough> passthrough;
  // An s3:// mount's bucket objects beside the staged files (FilesystemOptions::bucket).
  std::shared_ptr<BucketFiles> bucket;
  // View reads counted and errors recorded here besides the log (FilesystemOptions::report).
  std::shared_ptr<MountReport> report;
  // The kernel's fast paths (libfuse >= 3.17 and a kernel with CONFIG_FUSE_PASSTHROUGH): source
  // files not being captured are opened in passthrough mode (the kernel reads and writes the
  // source file itself; the daemon sees only open and release). false: every read and write
  // goes through the daemon, as with libfuse 3.14.
  bool kernel_passthrough = true;
  // Whether view bytes come from local files that replies can splice (false for s3:// sources:
  // then max_read keeps its default instead of shrinking to fit a splice pipe).
  bool spliceable_sources = true;
  // With passthrough: view files computed into this cache on first open and passed through to
  // the cached file (null: views are always served by the daemon).
  std::shared_ptr<Materializer> materialize;
  // Called once the Filesystem exists, before the mount serves; the pointer is valid until
  // ServeTree returns (e.g. to Swap a new generation of views in).
  std::function<void(Filesystem*)> started;
};

// Mounts and serves until the filesystem is unmounted (ucpfs umount / fusermount3 -u) or the
// process gets SIGINT/SIGTERM (then it unmounts itself). Errors: kInvalidArgument (bad
// mountpoint or option), kIo (the mount failed, with errno; or the mount never answered,
// e.g. it was unmounted or signalled before its first request was served).
Status ServeTree(std::shared_ptr<const Tree> tree, const MountOptions& options);

// The libfuse this binary is linked with and the fast paths it can reach, for `ucpfs --version`:
// e.g. "libfuse 3.18.3 (fast paths: passthrough, io_uring)".
std::string LinkedFuseText();

// Unmounts `mountpoint` (umount2, falling back to fusermount3 -u). Errors: kIo with errno.
Status Unmount(const std::string& mountpoint);

}  // namespace ucpfs::fs
