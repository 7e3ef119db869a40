// The index of an `s3://BUCKET/PREFIX` source kept next to its data, so every node that mounts
// the prefix uses one index built once, as a shared parallel filesystem's `SRC/.ucpfs/` is used.
//
// In the bucket, under PREFIX/.ucpfs/ (a name every scan and fingerprint skips):
//   index-<fingerprint>-<xxh3>.mdb   the LMDB catalog (catalog.h's data.mdb), written first
//   index.json                       the manifest, written last: {"format": "ucpfs-bucket-index",
//                                    "version": 1, "schema", "fingerprint", "object", "n_bytes",
//                                    "xxh3"}
// A PUT of a whole object is atomic, so a reader sees the old manifest or the new one, and the
// object a manifest names was complete before the manifest was written. The data object the
// previous manifest named is deleted after the new manifest is in place (a reader that read the
// old manifest just before then finds it gone: kNotFound, and builds locally).
//
// Untrusted on read: the manifest is at most kMaxManifestBytes and must parse with every field
// of its type; the object name must be `index-<16 hex>-<16 hex>.mdb` (no path); the object's size
// must equal n_bytes (at most max_index_bytes) and its bytes must hash to xxh3. It is downloaded
// (If-Match on the ETag seen) into CACHE/from-bucket/<hash of its key and ETag>/data.mdb
// (written to a temporary file, synced, renamed; O_NOFOLLOW throughout) and opened read-only by
// OpenOrBuildIndex, which checks the schema, the fingerprint of the source as it is now and every
// record against the real objects (ValidateIndexRecords), as it does a local index.
//
// Not for: the local index (catalog.h), or deciding when to use this (the CLI: an s3:// source
// without --index-dir).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/io/s3_tree.h"
#include "core/status.h"
#include "index/catalog.h"

namespace ucpfs::index {

inline constexpr uint64_t kMaxManifestBytes = 64 * 1024;
inline constexpr char kBucketIndexDir[] = ".ucpfs";
inline constexpr char kBucketManifestName[] = "index.json";

struct BucketIndexOptions {
  // Local, ours: a local build goes here, a downloaded copy under CACHE/from-bucket/.
  std::string cache_dir;
  // Use the bucket's index only: never build, never write to the bucket (many nodes at once).
  bool read_only = false;
  uint64_t max_index_bytes = uint64_t{4} << 30;
  ScanProgress progress;
};

struct BucketIndexReport {
  std::string manifest_url;   // s3://BUCKET/PREFIX/.ucpfs/index.json
  bool from_bucket = false;   // the index served is the bucket's
  bool uploaded = false;      // built (or found) locally and written to the bucket now
  std::string warning;        // why the bucket's index was not used or not written ("" if none)
};

// The index of `tree`'s prefix: the bucket's when it is there and fresh, else the one in
// options.cache_dir (reused or built), then written to the bucket when the bucket's was missing
// or stale (unless read_only). A bucket that refuses the write (403, ...) or a bucket index that
// is stale, corrupt or crafted is no error: the local index serves and report->warning says why.
// Errors: read_only and no fresh bucket index (kNotFound / kDataLoss naming the manifest and how
// to build it); those of OpenOrBuildIndex.
Result<OpenedIndex> OpenOrBuildBucketIndex(const std::shared_ptr<const S3Tree>& tree,
                                           const BucketIndexOptions& options, BucketIndexReport* report);

// The manifest's text for a catalog of `n_bytes` bytes hashing to `xxh3`, and its parse
// (kCorrupt naming `where` for anything but a well-formed manifest of this version).
struct BucketManifest {
  uint32_t schema = 0;
  uint64_t fingerprint = 0;
  std::string object;  // the data object's name under PREFIX/.ucpfs/
  uint64_t n_bytes = 0;
  uint64_t xxh3 = 0;
};
std::string BucketManifestText(const BucketManifest& m);
Result<BucketManifest> ParseBucketManifest(std::string_view text, const std::string& where);

}  // namespace ucpfs::index
