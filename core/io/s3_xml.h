// S3's XML bodies: the answers of ListObjectsV2, ListMultipartUploads, CreateMultipartUpload and
// CompleteMultipartUpload, error bodies, and the CompleteMultipartUpload request body.
//
// Parsed with expat (libexpat1-dev), never by hand. Everything a server sends is untrusted: the
// body is refused above the caller's cap before parsing, elements nest at most 16 deep, a body
// has at most 1,000,000 elements, numbers are checked (no overflow, no sign), and expat's own
// guards stop entity expansion attacks; no external entity or DTD is ever loaded.
// Pure: no network.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "core/xml_text.h"

namespace ucpfs::s3 {

// An S3 <Error> body. Empty fields when absent.
struct ErrorBody {
  std::string code;     // e.g. "NoSuchKey", "SignatureDoesNotMatch", "SlowDown"
  std::string message;
  std::string request_id;
};

struct ObjectEntry {
  std::string key;
  uint64_t n_bytes = 0;
  std::string etag;           // as sent, quotes included
  std::string last_modified;  // ISO 8601, as sent
};

// One page of ListObjectsV2.
struct ListPage {
  std::vector<ObjectEntry> objects;
  std::vector<std::string> common_prefixes;  // with the delimiter: "directories"
  bool is_truncated = false;
  std::string next_continuation_token;  // set when is_truncated
};

struct UploadEntry {
  std::string key;
  std::string upload_id;
  std::string initiated;
};

// One page of ListMultipartUploads.
struct UploadsPage {
  std::vector<UploadEntry> uploads;
  bool is_truncated = false;
  std::string next_key_marker;
  std::string next_upload_id_marker;
};

struct CompletedPart {
  int part_number = 0;  // 1..10000
  std::string etag;     // as UploadPart returned it
};

// Each parser: kCorrupt naming `what` (e.g. "s3://b/k: ListObjectsV2 answer") and the reason
// when the body is not well-formed XML, has a different root element, lacks a required field or
// has a malformed number; kResourceExhausted past the bounds above.
Result<ErrorBody> ParseErrorBody(std::string_view xml, const std::string& what);
Result<ListPage> ParseListObjectsV2(std::string_view xml, const std::string& what);
Result<UploadsPage> ParseListMultipartUploads(std::string_view xml, const std::string& what);
// <InitiateMultipartUploadResult><UploadId>: the upload id.
Result<std::string> ParseInitiateMultipartUpload(std::string_view xml, const std::string& what);
// <CompleteMultipartUploadResult><ETag>: the object's ETag. A 200 answer may still carry an
// <Error> (S3 sends it when the assembly fails after the status line went out): then
// *error_body is filled and the result is the empty string.
Result<std::string> ParseCompleteMultipartUpload(std::string_view xml, const std::string& what, ErrorBody* error_body);

// The body of CompleteMultipartUpload, parts in the order given, text escaped for XML.
std::string CompleteMultipartUploadBody(const std::vector<CompletedPart>& parts);

}  // namespace ucpfs::s3
