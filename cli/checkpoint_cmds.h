// `ucpfs index`, `ucpfs inspect DIR`, `ucpfs mount`: the checkpoint commands (sync, status and
// umount of a live mount: mount_control.h). `ucpfs mount` checks its arguments here and starts
// the daemon (mount/daemon.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "index/snapshot.h"

namespace ucpfs::cli {

struct SourceArgs {
  std::string src;
  std::string index_dir;
  std::string rules;
  bool read_only_index = false;
  bool quiet = false;  // -q, --quiet: no progress on stderr
  std::string s3_endpoint;  // --s3-endpoint: the S3 endpoint URL for an s3:// SRC (no secrets)
};

// Whether SRC names a bucket prefix (s3://BUCKET/PREFIX) rather than a directory.
bool IsS3Source(const std::string& src);

// The tree SRC is read through: for s3:// an S3Tree whose client takes its endpoint, region and
// credentials from the AWS environment variables and ~/.aws (--s3-endpoint above them), else a
// LocalTree over AbsPath(src). *source_dir: the URL (no trailing '/') or the absolute path.
Result<std::shared_ptr<const SourceTree>> SourceTreeOf(const SourceArgs& args, std::string* source_dir);

// The local cache of an s3:// source's index (its own build, and under from-bucket/ the copies
// of the bucket's: index/bucket_index.h): $XDG_CACHE_HOME/ucpfs/s3-index/<16 hex digits> when
// XDG_CACHE_HOME is set, else /var/cache/ucpfs/s3-index/... for root and
// $HOME/.cache/ucpfs/s3-index/... otherwise, the digits an XXH3-64 of the endpoint and the URL.
std::string S3IndexDir(const std::string& endpoint_url, const std::string& url);

// `p` with symlinks resolved and made absolute (realpath); `p` itself when that fails.
std::string AbsPath(const std::string& p);
// AbsPath, or, where realpath fails (a dead FUSE mount point answers ENOTCONN), the path made
// absolute against the working directory, without trailing slashes.
std::string AbsPathOrJoined(const std::string& p);
// Prints "ucpfs CMD: <status>" to stderr; returns the exit code 1.
int Fail(const char* cmd, const Status& s);

// The Snapshot of SRC as the mount opens it: its index built or reused (progress on stderr
// unless `progress` is false or SRC.quiet), --rules applied. Errors: kNotFound (no SRC),
// kInvalidArgument (SRC is not a directory), LoadRules's, OpenSnapshot's.
Result<std::shared_ptr<const index::Snapshot>> OpenSourceSnapshot(const SourceArgs& args, bool progress = true);

// Builds (or reuses) the index of SRC; progress on stderr, summary on stdout (text, or one JSON
// object with `json`).
int RunIndex(const SourceArgs& args, bool json);

// Per parameter: states, dtype, global shape, pattern, fragments, bytes, source files.
int RunInspectCheckpoint(const SourceArgs& args, bool json);

// The most --lookup-memory-mib may be (1 TiB): above it the byte count would overflow.
inline constexpr uint64_t kMaxLookupMemoryMib = uint64_t{1} << 20;

struct MountArgs {
  SourceArgs source;
  std::string mountpoint;
  bool foreground = false;
  std::vector<std::string> fuse_options;  // -o a,b,c (split on ',')
  std::string log_file;                   // daemon stderr; empty: discarded
  std::vector<std::string> layouts;       // --layout: target views to serve
  std::string preset = "auto";            // --preset
  std::string pattern_rules;              // --pattern-rules FILE
  std::string pp_split;                   // --pp-split a,b,...
  int64_t vocab_pad_multiple = 0;         // --make-vocab-size-divisible-by (0: not given)
  uint64_t lookup_memory_mib = 256;       // --lookup-memory-mib, at most kMaxLookupMemoryMib
  std::string cache_size = "2G";          // --cache-size: the pinned write-capture cache
  uint64_t write_stall_timeout_s = 30;    // --write-stall-timeout (WriteCaptureOptions)
  std::string safetensors_shard_size;     // --safetensors-shard-size (empty: Hugging Face's 5GB)
  std::string hf_dtype;                   // --hf-dtype: hf/'s weights (empty: as trained)
  std::string hf_config;                  // --hf-config FILE: the base model's config.json
  std::string readahead;                  // --readahead (ParseReadAhead)
  std::string prefetch;                   // --prefetch (ParseReadAhead)
  bool read_only = false;                 // --read-only: no writes, no capture
  std::string stage_dir;                  // --stage-dir DIR: an s3:// mount's local staging (empty: beside its index)
  uint64_t stage_keep_s = 60;             // --stage-keep: how long an uploaded staged copy stays (at least 1)
  bool stage_keep_given = false;          // --stage-keep or -o stage_keep= was given (for an s3:// mount only)
  bool no_passthrough = false;            // --no-passthrough: the kernel's passthrough off
  std::string materialize_dir;            // --materialize DIR: views computed into DIR (empty: off)
  std::string materialize_size = "8G";    // --materialize-size: the most DIR holds
};

// The --safetensors-shard-size value (io::ParseByteSize forms; empty: Hugging Face's default,
// 5 GB decimal). Errors: kInvalidArgument for a bad text or zero.
Result<uint64_t> ParseShardSize(const std::string& text);

// Returns once the mount is live (the daemon keeps serving), or serves in the foreground
// (mount::StartMount).
int RunMount(const MountArgs& args);
}  // namespace ucpfs::cli
