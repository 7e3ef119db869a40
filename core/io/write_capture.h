// WriteCapture: files saved into a mount, captured in the pinned host cache and made durable in
// the background, crash-safely.
//
// A captured file lives in two places until it is durable:
//   - its bytes, chunk by chunk, in the PinnedCache (write() returns once they are there; a full
//     cache blocks the writer until flushers free chunks: back-pressure, an error only when the
//     flushers cannot write at all, see below);
//   - its backing file `SRC/.ucpfs/capture/<mount id>/<seq>.part` (each mount has its own state
//     directory: capture_mount.h), which flushers fill with O_DIRECT writes of the 4 KiB
//     pages of each chunk changed since its last flush (several in flight through an IoEngine,
//     fixed buffers, out of order), a chunk being written as soon as it is full so files
//     larger than the cache stream through.
// It appears under its final name only once complete and durable: the committer truncates the
// part to its exact size, gives it its owner, mode and times (SetOwner/SetMode/SetTimes: until
// then the part is 0600 and the daemon's), fdatasyncs it, renames it over the final name
// (resolved beneath SRC, never through a symlink) and fsyncs that directory. Commits happen strictly in the order of
// Close/Fsync calls (close order), so a pointer file written last (`latest`, `.metadata`) is
// never durable before the shards closed before it.
//
// Crash safety: a journal (`SRC/.ucpfs/capture/<mount id>/journal`) records each chunk written
// (offset, length, xxHash64 of its bytes) and each commit (size, mode, owner, times, final path,
// as they were at close; a recovered file never gets S_ISUID/S_ISGID from it) in close
// order. Start() reads back the journal of each dead mount (capture_mount.h says which), on its
// own: in close order, a closed file whose part holds every chunk with its recorded hash is
// finished (renamed into place, one log line); the first one that is not is discarded, and every
// later one is set aside whole in SRC/.ucpfs/capture/recovered/<state>/<path> (or discarded when
// it is not whole itself), so nothing is ever visible under a final name torn or ahead of what
// was closed before it, and nothing whole is destroyed; parts never closed are discarded. A whole
// file whose place cannot take it (its directory is gone, the disk is full) is kept, with every
// later one, for the next mount. Namespace changes go through options.names (NameOps) and are
// fsync'd in an order that keeps all this true across a power cut, during recovery too. The journal is untrusted input (it lives in the checkpoint
// directory): it is bounded, every record is checksummed and every path checked before use.
//
// A full cache whose flushers cannot write (a dead disk, a full one) fails a writer waiting for
// a free chunk with the flushers' error after write_stall_timeout_ms (30 s unless set); the
// flushers retry every second meanwhile, so a disk that comes back lets it go on.
// Errors while flushing or placing (EIO, ENOSPC, the directory removed or moved out of SRC from
// outside, an O_EXCL name taken): the chunks stay in the cache, the file stays pending, and the
// error is returned by Fsync/Sync (and Close, if it happened before); later commits wait behind
// it (order is never broken), and what is written of each is made durable in its part. The
// committer tries the failed file again by itself (after 1 s, backing off to 8 s; at once when
// Sync is called or a pending file is unlinked, which frees its part's space at once), so the
// files behind it place as soon as it does. Stats().unplaced lists them meanwhile; an unmount
// leaves those durable in their parts for the next mount and logs each (and any whose bytes
// were only in memory). Writes past the source filesystem's file size limit fail with EFBIG.
//
// Thread-safety: every method may be called from any thread at once. Lock order: a file's mutex
// before the engine's mutex (mu_); no lock is held while blocked on the cache.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/io/io_engine.h"
#include "core/io/name_ops.h"
#include "core/io/pinned_cache.h"
#include "core/status.h"

namespace ucpfs::io {

// A change to a captured file's part (WriteCaptureOptions::on_part_change).
struct PartChange {
  enum class Kind {
    kFlushed,    // a write of [byte_offset, byte_offset + n_bytes) (one chunk) into the part completed
    kCut,        // the part was cut to byte_offset bytes (a truncate)
    kDiscarded,  // the file was unlinked before it was placed: it is never committed
  };
  Kind kind = Kind::kFlushed;
  uint64_t seq = 0;       // the captured file (unique in this mount's life)
  uint64_t ino = 0;       // the part's inode: the file's under its final name once placed
  int part_fd = -1;       // the part, open for reading (only during the call: dup it to keep it)
  std::string rel_path;   // where it goes, relative to SRC ("" when that cannot be told)
  uint64_t byte_offset = 0;
  uint64_t n_bytes = 0;
  // kFlushed: the part now holds every byte of the chunk (it was written full and has not changed
  // since); false: only some of it (a partial chunk, or one changed again while in flight).
  bool whole = false;
};

struct WriteCaptureOptions {
  // SRC, opened O_DIRECTORY by the caller; must outlive the WriteCapture. Final paths are
  // relative to it.
  int source_dirfd = -1;
  std::string source_dir;  // for messages
  // The cache; null: one is made from cache_options when the first file is captured (a mount
  // that is only read holds no pinned memory).
  std::shared_ptr<PinnedCache> cache;
  PinnedCacheOptions cache_options;
  unsigned n_flushers = 2;
  unsigned queue_depth = 8;  // ops in flight per flusher
  // One engine per flusher thread (and one for the committer); default MakeDefaultEngine.
  std::function<std::unique_ptr<IoEngine>()> make_engine;
  // The namespace changes (parts created, renamed into place, unlinked) and directory fsyncs;
  // default RealNameOps(). A test's MakeFaultNameOps sees them for its power cuts.
  std::shared_ptr<NameOps> names;
  // One line per event worth a log (recovery, flush errors).
  std::function<void(const std::string&)> log;
  // Called on the committer thread after a file is durable under its final name.
  std::function<void(const std::string& rel_path)> on_durable;
  // Called on the committer thread just before a file is renamed over `rel_path` (whatever is
  // there is replaced): what still reads the old file can open it now.
  std::function<void(const std::string& rel_path)> before_replace;
  // Called on the committer thread for each commit (a close, or an fsync of a file still open),
  // with its path and its inode's stat (size, owner, mode, times as placed): for a file not yet
  // under its final name once its bytes are durable and just before the rename (so what this
  // records durably comes first: the file is never visible under its name unrecorded), for one
  // placed already (an earlier fsync) just before the fdatasync of its new bytes. Recovery calls
  // it too, before it places a closed file a killed daemon left. An error fails that commit (the
  // file is kept and tried again, as after any commit error; recovery keeps it for the next
  // mount). The bucket uploader (bucket_uploader.h) queues the file here.
  std::function<Status(const std::string& rel_path, const struct stat& st)> before_settled;
  // Called whenever a file's part changed: what a streamed upload of its bytes needs (the bucket
  // uploader, bucket_uploader.h, sends its full parts while the file is still being written).
  // A write's report comes on a flusher's thread before the commit that waits for that write
  // goes on (so before_settled never runs ahead of it), with the file's lock held: it must not
  // block or call back into the capture. A cut comes on the truncating thread, also with the
  // file's lock held; a discard on the unlinking one, with no lock held.
  std::function<void(const PartChange& change)> on_part_change;
  // Another host's mount whose lease was not renewed for this long is dead (capture_mount.h).
  uint64_t lease_timeout_s = 60;
  // A writer that needs a free chunk of a full cache while the flushers cannot write (their
  // last write failed: EIO, ENOSPC) gets that error after waiting this long, instead of waiting
  // for ever; a cache full because the disk is merely slow still only makes it wait.
  uint64_t write_stall_timeout_ms = 30000;
};

// A file whose save was accepted (close or fsync) but that is not under its final name.
struct UnplacedFile {
  std::string path;     // relative to SRC
  std::string reason;   // why not (yet)
  std::string kept_in;  // the directory holding its bytes durably (a state directory, or
                        // recovered/<state>: set aside, never placed); "" while in memory only
};

// One file being captured. Opaque; shared by every open handle of the file.
class CapturedFile;

struct CaptureStats {
  uint64_t cache_capacity_bytes = 0;
  uint64_t cache_used_bytes = 0;
  uint64_t dirty_bytes = 0;        // captured and not yet written to a part
  uint64_t bytes_captured = 0;     // by write()
  uint64_t bytes_flushed = 0;      // written to parts: whole pages, a file's last one with its padding
  uint64_t flush_busy_ns = 0;      // time with at least one flush write in flight
  uint64_t writers_blocked_ns = 0; // time writers waited for a free chunk
  uint64_t files_pending = 0;      // created and not yet durable
  uint64_t files_committed = 0;
  uint64_t flush_errors = 0;
  uint64_t chunks_coalesced = 0;   // chunks written as part of a larger write with their neighbour
  std::string memory_kind;         // PinnedMemoryKindName
  std::string engine;              // the flushers' IoEngine::Name() ("not started yet" before the first save)
  std::string state_dir;           // this mount's state directory (capture_mount.h)
  std::vector<UnplacedFile> unplaced;
};

// Merges write ops that continue each other both in their file and in memory into one op (not
// from a fixed buffer: it spans several), sorted by (fd, offset). members[k] lists the
// user_data of the ops that the k-th returned op (whose user_data is k) carries. Exposed for
// its unit test.
std::vector<IoOp> CoalesceWrites(std::vector<IoOp> ops, std::vector<std::vector<uint64_t>>* members);

class WriteCapture {
 public:
  // Opens (creating it) SRC/.ucpfs/capture without following symlinks, recovers what an earlier
  // daemon left there (see above), then starts the flushers and the committer. Errors: kIo naming
  // the path; kInvalidArgument for missing options; kCorrupt never (a bad journal is logged and
  // its files discarded).
  static Result<std::unique_ptr<WriteCapture>> Start(WriteCaptureOptions options);
  // Drains (as Drain) and stops the threads.
  ~WriteCapture();
  WriteCapture(const WriteCapture&) = delete;
  WriteCapture& operator=(const WriteCapture&) = delete;

  // A new, empty file to be placed, when closed, at `name` in the directory `parent_dirfd` (an
  // O_PATH or O_RDONLY directory descriptor beneath SRC; it is dup'ed, so it follows the
  // directory through renames), with permission bits `mode`; whatever has that name then is
  // replaced. Errors: kIo (creating the part); PinnedCache::Make's for the first file when the
  // cache is made then.
  // `exclusive` (an O_EXCL create): a name made there from outside meanwhile is not replaced (the
  // commit fails with EEXIST and the file is kept, listed as unplaced).
  Result<std::shared_ptr<CapturedFile>> Create(int parent_dirfd, const std::string& name, mode_t mode,
                                               bool exclusive = false);

  // The part's descriptor-level identity (st_dev, st_ino: the final file's after the rename) and
  // the file's logical size and times.
  struct stat Stat(const CapturedFile& file) const;
  // Copies `data` into the cache at byte_offset (blocking while the cache is full). Errors:
  // kIo when an earlier flush of this file failed and the chunk must be read back and cannot;
  // kInvalidArgument after Close; the flushers' last error (kIo with EIO, kNoSpace with ENOSPC)
  // when the cache stayed full for write_stall_timeout_ms while every flush failed (the bytes
  // of this call before the chunk it waited for are kept; what was accepted before stays).
  Status Write(CapturedFile& file, uint64_t byte_offset, std::span<const std::byte> data);
  // What a reader sees: the bytes written so far (zeros in holes). Returns how many were read
  // (fewer at the end of the file).
  Result<size_t> Read(CapturedFile& file, uint64_t byte_offset, std::span<std::byte> out);
  // Sets the logical size (shrinking drops bytes past it, growing reads as zeros).
  Status Truncate(CapturedFile& file, uint64_t n_bytes);
  // The last handle is gone: queues the file for commit in close order and returns at once.
  // Returns an error this file's flushing already met, if any (the data is kept).
  Status Close(CapturedFile& file);
  // Returns once this file's bytes so far are durable under its final name, together with every
  // file queued for commit before it. The file stays open for writing. Errors: the first flush or
  // commit error of those files (kIo, kNoSpace with sys_errno).
  Status Fsync(CapturedFile& file);
  // Returns once every file closed (or fsync'd) before the call is durable. Retries files whose
  // flush failed. Errors: as Fsync; kIo (EIO) naming each file a recovery kept unplaced or set
  // aside in recovered/ (listed in Stats().unplaced), while there is any.
  Status Sync();
  // The pending file was unlinked: it is never placed, and its part is removed. Returns false
  // when it was placed already (then the caller removes it from its directory).
  bool Discard(CapturedFile& file);
  // The file's first flush error not yet retried (OK if none): what close(2) reports.
  Status Error(const CapturedFile& file) const;
  // A placed file was renamed (from outside the capture: the passthrough's rename) to `new_name`
  // in the directory `new_parent_dirfd` (dup'ed): its later commits, and what they report
  // (on_durable, before_settled), use that name. Errors: kInvalidArgument when not placed yet;
  // kIo (dup).
  Status Moved(CapturedFile& file, int new_parent_dirfd, const std::string& new_name);
  // Whether the file has been placed under its final name at least once.
  bool Placed(const CapturedFile& file) const;
  // Whether it is closed and everything written is durable under its final name: the real file
  // then tells its attributes.
  bool Settled(const CapturedFile& file) const;
  // A new O_PATH descriptor of the file's inode (the part, later the placed file), owned by the
  // caller. Errors: kIo.
  Result<int> OpenPath(const CapturedFile& file) const;
  // chmod, chown and utimens of a file not yet settled: kept and applied to the part just before
  // it is placed (chown first, which clears S_ISUID/S_ISGID, then the mode, then the times), and
  // at once to a file placed already. The part itself stays 0600 and the daemon's until then.
  // SetOwner: -1 leaves that id. SetTimes: as utimensat takes them (UTIME_NOW, UTIME_OMIT); a
  // later write or truncate sets mtime to now again, as the kernel does. A file's mtime is
  // otherwise its last write's. Errors: kIo from a placed file's fchmod/fchown/futimens.
  Status SetMode(CapturedFile& file, mode_t mode);
  Status SetOwner(CapturedFile& file, uid_t uid, gid_t gid);
  Status SetTimes(CapturedFile& file, const struct timespec times[2]);

  CaptureStats Stats() const;

 private:
  struct Impl;
  explicit WriteCapture(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ucpfs::io
