// S3Tree: a SourceTree over a bucket prefix, `s3://BUCKET/PREFIX` (core/io/source_tree.h), on the
// S3 client (core/io/s3_client.h). Directories are common prefixes of ListObjectsV2 with delimiter
// '/'; files are objects, mode 0444, with identity n_bytes = the object's size, mtime_ns = its
// Last-Modified (whole seconds: HEAD reports no more), ctime_ns = mtime_ns, dev 0 and ino = a
// 64-bit hash of its ETag, so a replaced object is another version.
//
// A store has no symlinks or special files; an empty "directory" exists only while some key lies
// under it (a marker object `dir/` included). A key that is both an object and a prefix (`x` and
// `x/y`) lists as the file; names that are not a clean component (empty, ".", "..") are left out.
//
// Lazy files (OpenLazy) read with If-Match on the ETag seen when the object was listed or
// HEAD'ed (kept in a map shared by the tree and its subtrees, at most kMaxRememberedETags
// entries, cleared when full); a file whose ETag is not remembered is HEAD'ed on first open and
// its ETag's hash compared with the indexed identity. A replaced or removed object fails with
// kDataLoss naming s3://BUCKET/KEY, never with other bytes.
//
// A listing is remembered for kListingFreshMs while the tree's client writes nothing
// (s3::Client::writes()): List of that directory again, and Stat, Open and the directory checks of
// the names in it, are answered from it without a request. A mount's checks would otherwise HEAD
// every file the listing just described, in the command and again in its daemon (WithClient hands
// the daemon what the command listed). What another client changes in that window is seen a
// second late, as a listing seen a second ago would be anyway.
//
// Not for: writing to the bucket (the write side of a mount stays local), the index directory.
// Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/io/s3_client.h"
#include "core/io/source_tree.h"

namespace ucpfs {

// ETags remembered for lazy files: past this many the map is cleared (a later open HEADs).
inline constexpr size_t kMaxRememberedETags = size_t{1} << 20;
// How long a listing answers for its directory, and how many directories' listings are kept (past
// that they are all dropped).
inline constexpr int64_t kListingFreshMs = 1000;
inline constexpr size_t kMaxRememberedListings = 64;

// The inode an object's ETag stands for (64-bit xxHash of the ETag as sent, quotes included).
uint64_t ETagInode(std::string_view etag);

// Seconds since the epoch of S3's two date forms: ISO 8601 (listings: "2026-11-27T12:00:00.000Z")
// and HTTP dates (HEAD: "Fri, 27 Nov 2026 12:00:00 GMT"), fractions dropped; in nanoseconds.
// Errors: kCorrupt naming the text.
Result<int64_t> ParseS3TimeNs(std::string_view text);

class S3Tree final : public SourceTree {
 public:
  // The tree at `url` (s3://BUCKET or s3://BUCKET/PREFIX, a trailing '/' dropped) read through
  // `client`. Nothing is requested yet. Errors: kInvalidArgument when the URL does not parse or
  // its prefix is not a clean relative path.
  static Result<std::shared_ptr<const S3Tree>> Make(std::shared_ptr<s3::Client> client, const std::string& url);

  // A client from the AWS environment and files (LoadS3Environment, ResolveOptions with
  // `overrides`, e.g. --s3-endpoint) and the tree at `url` over it.
  static Result<std::shared_ptr<const S3Tree>> FromEnvironment(const std::string& url,
                                                               const s3::Overrides& overrides = {});

  const std::string& Root() const override { return root_; }
  Result<std::vector<TreeEntry>> List(std::string_view rel_dir) const override;
  Result<TreeEntry> Stat(std::string_view rel) const override;
  Result<OpenedFile> Open(std::string_view rel) const override;
  Result<std::shared_ptr<const LazySource>> OpenLazy(std::string_view rel, const FileIdentity& expected,
                                                     std::shared_ptr<IoCounters> counters,
                                                     std::shared_ptr<FdCache> cache) const override;
  Result<std::shared_ptr<const SourceTree>> Subtree(std::string_view rel_dir) const override;

  // The same tree over another client (a forked daemon's own: it must not share this one's
  // connections), taking over the ETags and the listings still fresh.
  std::shared_ptr<const S3Tree> WithClient(std::shared_ptr<s3::Client> client) const;

  const std::shared_ptr<s3::Client>& client() const { return shared_->client; }
  const std::string& bucket() const { return bucket_; }
  const std::string& prefix() const { return prefix_; }  // no trailing '/'; "" for the bucket

  // What the tree and its subtrees share: the client, the remembered ETags (by object key) and
  // listings (by the directory's key: "" for the bucket's root, else "a/b").
  struct Shared {
    struct Listed {
      std::vector<TreeEntry> entries;  // as List returns them: sorted by name, never empty
      int64_t at_ms = 0;               // steady clock, when the request was sent
      uint64_t writes = 0;             // the client's writes() then
    };
    std::shared_ptr<s3::Client> client;
    mutable std::mutex mu;
    std::unordered_map<std::string, std::string> etags;
    std::unordered_map<std::string, Listed> listed;
    std::unordered_map<std::string, Listed> not_empty;  // one-key listings that found a key (no entries)
    void Remember(const std::string& key, const std::string& etag);
    std::string Recall(const std::string& key) const;  // "" when not remembered
    void RememberListing(const std::string& dir_key, Listed listed);
    void RememberNotEmpty(const std::string& dir_key, Listed listed);
    // The directory's listing while fresh (kListingFreshMs, no write by the client since).
    std::optional<std::vector<TreeEntry>> FreshListing(const std::string& dir_key) const;
    // `name` in the directory's fresh listing: the entry, or an empty optional inside when the
    // listing lacks it; nullopt when no fresh listing is remembered.
    std::optional<std::optional<TreeEntry>> FreshEntry(const std::string& dir_key, std::string_view name) const;
    // Whether a fresh listing (whole or of one key) found a key under the directory.
    bool FreshNotEmpty(const std::string& dir_key) const;
  };
  S3Tree(std::shared_ptr<Shared> shared, std::string bucket, std::string prefix);  // use Make

 private:
  std::string KeyOf(std::string_view rel) const;
  // Whether some key lies under the directory `rel` (one-key list of `KEY/`).
  Result<bool> HasKeysUnder(std::string_view rel) const;
  // `rel` (not "") as its parent's fresh listing has it: the entry, or kNotFound when the listing
  // lacks it; nullopt when no fresh listing of the parent is remembered.
  std::optional<Result<TreeEntry>> FromListing(std::string_view rel) const;

  std::shared_ptr<Shared> shared_;
  std::string bucket_;
  std::string prefix_;
  std::string root_;
};

}  // namespace ucpfs
