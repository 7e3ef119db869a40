// S3 client on libcurl (Debian 12's 7.88, loaded on first use: curl_api.h): SigV4 signed by
// libcurl itself (CURLOPT_AWS_SIGV4), connections kept open and shared by every request of a
// client (one CURLSH: connection, DNS and TLS session caches), each call's transfers run through
// a multi handle so a batch of ranged GETs is in flight at once, retries with backoff and jitter
// on 5xx, throttling and transport errors (s3_config.h: RetryPolicy), and S3's error code and
// message in every error.
//
// Not for: listing or reading checkpoints as sources (a SourceTree over S3 builds on this),
// the pure rules (s3_config.h) or XML (s3_xml.h).
//
// Bounded memory: a ranged GET writes straight into the caller's buffer and fails (kCorrupt) when
// the server sends more or fewer bytes than asked or another range; list, error and multipart
// bodies are capped at Options::max_response_bytes. Every request carries
// `x-amz-content-sha256: UNSIGNED-PAYLOAD` (S3 and RGW need the header; bodies are not hashed).
// Secrets stay in the Options (never in a message, a URL or a command line).
//
// Errors of every call: kNotFound (404: NoSuchKey, NoSuchBucket, NoSuchUpload), kIo with
// sys_errno EACCES (401/403: AccessDenied, SignatureDoesNotMatch, InvalidAccessKeyId...),
// kDataLoss (412: If-Match failed), kOutOfRange (416), kInvalidArgument (other 4xx), kIo (5xx
// or transport errors once retries are spent; sys_errno ETIMEDOUT, ECONNREFUSED or EIO), kCorrupt
// (a malformed or oversized answer). Messages read "s3://BUCKET/KEY: OP: HTTP 403
// SignatureDoesNotMatch: MESSAGE (request REQID)" and say how many attempts were made.
// Thread-safe: one Client serves every thread of a mount; calls block their thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/byte_source.h"
#include "core/io/s3_config.h"
#include "core/io/s3_xml.h"
#include "core/status.h"

namespace ucpfs::s3 {

struct ObjectInfo {
  uint64_t n_bytes = 0;
  std::string etag;           // as sent, quotes included ("" when the server sent none)
  std::string last_modified;  // HTTP date, as sent
};

// One ranged GET of a batch: exactly out.size() bytes at byte_offset of bucket/key; with
// if_match set, sent as `If-Match` so a replaced object fails (kDataLoss) instead of serving
// other bytes.
struct RangeRead {
  std::string bucket;
  std::string key;
  uint64_t byte_offset = 0;
  std::span<std::byte> out;
  std::string if_match;
};

struct Listing {
  std::vector<ObjectEntry> objects;
  std::vector<std::string> common_prefixes;
};

// What a client did, summed over its life (for `ucpfs status` and the multi-node tests).
struct CounterValues {
  uint64_t requests = 0;   // attempts sent, retries included
  uint64_t retries = 0;
  uint64_t failures = 0;   // calls that failed after their retries
  uint64_t bytes_get = 0;  // body bytes of successful GETs (objects, lists), not error bodies
  uint64_t bytes_put = 0;  // body bytes sent by PUT and UploadPart
  uint64_t connects = 0;   // new connections made (the rest reused a kept-open one)
};

// Ranged GET body bytes by object, for checking that a reader fetched only its part of each
// object (the multi-node tests): retried attempts' bytes included, as in bytes_get.
inline constexpr size_t kMaxCountedObjects = 4096;  // past this many names, bytes go to `uncounted`
struct ObjectBytes {
  std::vector<std::pair<std::string, uint64_t>> by_object;  // ("s3://BUCKET/KEY", bytes), by name
  uint64_t uncounted = 0;
};

class Client {
 public:
  // Errors: kInvalidArgument when the endpoint does not parse; kUnsupported naming libcurl.so.4
  // when it cannot be loaded or lacks SigV4 (older than 7.75); kInternal when it cannot be set up.
  static Result<std::shared_ptr<Client>> Make(Options options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const Options& options() const { return options_; }
  CounterValues counters() const;
  // Requests that change the bucket's objects (PUT, DELETE, CompleteMultipartUpload, bucket
  // create and delete) begun plus those finished: an answer taken while it stood still holds
  // for what this client wrote (S3Tree's remembered listings).
  uint64_t writes() const;
  ObjectBytes ObjectBytesGet() const;

  // HEAD: size, ETag, Last-Modified.
  Result<ObjectInfo> Head(const std::string& bucket, const std::string& key);

  // One ranged GET (GetRanges of one). out.size() == 0 sends nothing.
  Status GetRange(const std::string& bucket, const std::string& key, uint64_t byte_offset, std::span<std::byte> out,
                  const std::string& if_match = "");
  // Every read in flight at once, at most Options::max_in_flight transfers at a time, each retried
  // on its own; a read with if_match larger than Options::max_get_bytes goes out as several GETs
  // in flight together, and reads of one object that touch (or lie within
  // Options::merge_gap_bytes) go out as one GET. All of them are finished when this returns. Errors: the first failing read's, in
  // the order given, its index in *failed_index; the other reads' bytes are then unspecified.
  Status GetRanges(std::span<const RangeRead> reads, size_t* failed_index = nullptr);

  // One page of ListObjectsV2 (max_keys 1..1000; continuation_token from the previous page).
  Result<ListPage> ListObjectsPage(const std::string& bucket, const std::string& prefix, const std::string& delimiter,
                                   int max_keys, const std::string& continuation_token);
  // Every page. Errors: kResourceExhausted past max_entries objects and prefixes together.
  Result<Listing> ListObjects(const std::string& bucket, const std::string& prefix, const std::string& delimiter,
                              int max_keys_per_page = 1000, uint64_t max_entries = 10000000);

  // PUT of a whole object: its ETag.
  Result<std::string> PutObject(const std::string& bucket, const std::string& key, std::span<const std::byte> body);
  Status DeleteObject(const std::string& bucket, const std::string& key);
  Status CreateBucket(const std::string& bucket);
  Status DeleteBucket(const std::string& bucket);

  // Multipart upload: create (the upload id), upload parts (1..10000; every part but the last at
  // least 5 MiB on AWS; each part's ETag), complete with the parts' ETags in part order (the
  // object's ETag; a 200 answer carrying an <Error> is an error), abort (the parts are dropped).
  Result<std::string> CreateMultipartUpload(const std::string& bucket, const std::string& key);
  Result<std::string> UploadPart(const std::string& bucket, const std::string& key, const std::string& upload_id,
                                 int part_number, std::span<const std::byte> body);
  Result<std::string> CompleteMultipartUpload(const std::string& bucket, const std::string& key,
                                              const std::string& upload_id, const std::vector<CompletedPart>& parts);
  Status AbortMultipartUpload(const std::string& bucket, const std::string& key, const std::string& upload_id);
  // Uploads begun and neither completed nor aborted under `prefix` (crash recovery), every page.
  Result<std::vector<UploadEntry>> ListMultipartUploads(const std::string& bucket, const std::string& prefix,
                                                        uint64_t max_entries = 1000000);

  struct Impl;

 private:
  explicit Client(Options options);
  Options options_;
  std::unique_ptr<Impl> impl_;
};

// A ByteSource over one object. Name() is "s3://BUCKET/KEY"; ReadAt is one ranged GET and
// ReadPieces one batch of them in flight at once; with an ETag recorded every read carries
// If-Match, so an object replaced under a reader fails with kDataLoss naming it and what changed
// (as a local file edited in place does: core/io/file_source.h). Thread-safe.
class S3ObjectSource final : public ByteSource {
 public:
  // HEADs the object for its size and ETag. Errors: Client::Head's.
  static Result<std::shared_ptr<S3ObjectSource>> Open(std::shared_ptr<Client> client, const std::string& bucket,
                                                      const std::string& key);
  // An object whose size and ETag were recorded earlier (an index): no request until a read.
  static std::shared_ptr<S3ObjectSource> FromRecorded(std::shared_ptr<Client> client, const std::string& bucket,
                                                      const std::string& key, uint64_t n_bytes, std::string etag);

  uint64_t Size() const override { return n_bytes_; }
  const std::string& Name() const override { return name_; }
  // Errors: kOutOfRange past Size(); kDataLoss "s3://B/K: the object changed since it was
  // recorded: ETag "A" -> "B", size N -> M" (or "no longer exists"); the client's.
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override;
  Status ReadPieces(std::span<const ReadPiece> pieces, size_t* failed_index = nullptr) const override;

  const std::string& bucket() const { return bucket_; }
  const std::string& key() const { return key_; }
  const std::string& etag() const { return etag_; }

 private:
  S3ObjectSource(std::shared_ptr<Client> client, std::string bucket, std::string key, uint64_t n_bytes,
                 std::string etag);
  // A read's error, with what changed when the object is no longer the recorded one.
  Status Explain(Status st) const;
  std::shared_ptr<Client> client_;
  std::string bucket_;
  std::string key_;
  uint64_t n_bytes_;
  std::string etag_;
  std::string name_;
};

}  // namespace ucpfs::s3
