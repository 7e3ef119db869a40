// S3 configuration: where a client sends requests and as whom, resolved the way the AWS CLI and
// SDKs do (environment variables, ~/.aws/credentials and ~/.aws/config with profiles, an explicit
// endpoint override), and the pure pieces of a request (object URLs in path-style or
// virtual-host addressing, s3:// names, which failures are retried and after how long).
//
// Pure: no network, and no file or environment access except in LoadS3Environment, so every rule
// here is unit-tested with plain strings. Secrets come from the environment or files, never from
// a command line (where `ps` shows them), and are never put into error messages.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "core/status.h"

namespace ucpfs::s3 {

struct Credentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // empty: none (long-term keys)
  // No keys: requests go unsigned (public buckets).
  bool anonymous() const { return access_key_id.empty(); }
};

enum class Addressing {
  kAuto,         // virtual-host for AWS's own endpoints when the bucket name allows, else path
  kPath,         // SCHEME://HOST/BUCKET/KEY
  kVirtualHost,  // SCHEME://BUCKET.HOST/KEY
};

// How requests are retried: 5xx, 429 and 503 SlowDown, and transport errors (connection refused
// or reset, timeouts), with exponential backoff and full jitter, at most `max_attempts` tries and
// `max_total_ms` from the first; never other 4xx.
struct RetryPolicy {
  int max_attempts = 5;
  uint64_t base_delay_ms = 100;
  uint64_t max_delay_ms = 5000;
  uint64_t max_total_ms = 60000;
};

struct Options {
  // SCHEME://HOST[:PORT] (a path after it is kept as a prefix of every request's path).
  std::string endpoint_url;
  std::string region = "us-east-1";
  Addressing addressing = Addressing::kAuto;
  Credentials credentials;
  // A PEM file of the certificate authorities to trust for https (AWS_CA_BUNDLE or the profile's
  // ca_bundle); empty: the system's.
  std::string ca_bundle;
  RetryPolicy retry;
  // Transfers of one batch in flight at once (ReadRanges), over connections kept open and shared.
  int max_in_flight = 32;
  // A ranged GET pinned to one version (If-Match) larger than this is split into GETs of at most
  // this size, in flight together (0: never split).
  uint64_t max_get_bytes = 8ull << 20;
  // Reads of one object in a batch at most this far apart are merged into one GET (the bytes
  // between them fetched and dropped); 0 merges only reads that touch.
  uint64_t merge_gap_bytes = 0;
  // Connections kept open between calls, shared by every thread of the client.
  int max_idle_connections = 64;
  uint64_t connect_timeout_ms = 10000;
  // A transfer slower than 1 KiB/s for this long is aborted (and retried): no fixed total
  // timeout, so large reads over a slow link still finish.
  uint64_t low_speed_time_ms = 30000;
  // Bodies read into memory (lists, errors, multipart answers) are refused above this.
  uint64_t max_response_bytes = 16ull << 20;
  // Where the values came from, for `ucpfs status` and errors ("profile train from
  // /root/.aws/config"); never a secret.
  std::string source;
};

// The inputs options are resolved from: environment variables and the two files' text, so tests
// hand them in directly (LoadS3Environment reads the real ones).
struct Environment {
  std::map<std::string, std::string> vars;
  std::optional<std::string> credentials_file_text;  // ~/.aws/credentials, when it exists
  std::optional<std::string> config_file_text;       // ~/.aws/config, when it exists
  std::string credentials_file_path;                 // for messages
  std::string config_file_path;
};

// What the caller asks for explicitly (the future `--s3-endpoint`, `--s3-region`), above
// everything else.
struct Overrides {
  std::string endpoint_url;
  std::string region;
  std::optional<Addressing> addressing;
};

// The process's environment and the files AWS_SHARED_CREDENTIALS_FILE / AWS_CONFIG_FILE name
// (default ~/.aws/credentials and ~/.aws/config), each read up to 1 MiB. Errors: kIo when a file
// exists and cannot be read, kResourceExhausted when one is larger than 1 MiB.
Result<Environment> LoadS3Environment();

// Resolves the options as the AWS CLI does. Profile: AWS_PROFILE, else "default" ([NAME] in the
// credentials file, [profile NAME] or [default] in the config file). Credentials: both
// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (with AWS_SESSION_TOKEN) from the environment, else
// the profile's aws_access_key_id / aws_secret_access_key / aws_session_token from the
// credentials file, else from the config file, else none (anonymous). Region: overrides,
// AWS_REGION, AWS_DEFAULT_REGION, the profile's region, else us-east-1. Endpoint: overrides,
// AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile's `s3 =` sub-section endpoint_url, its
// endpoint_url, else https://s3.REGION.amazonaws.com. Addressing: overrides, the profile's
// `s3 =` addressing_style (auto, path, virtual), else auto. CA bundle: AWS_CA_BUNDLE, else the
// profile's ca_bundle.
// Errors: kInvalidArgument naming the variable or the file and line (a profile named by
// AWS_PROFILE that neither file has, one key of a pair without the other, a malformed endpoint,
// an unknown addressing style, a file that is not INI text).
Result<Options> ResolveOptions(const Environment& env, const Overrides& overrides = {});

// An INI file as the AWS tools read it: `[section]` headers, `key = value` lines, `#` and `;`
// comment lines, and indented `key = value` lines after a `key =` line with no value, stored as
// "key.subkey" (`s3 =\n  addressing_style = path` gives "s3.addressing_style"). Keys are
// lower-cased; values are trimmed. Errors: kInvalidArgument naming `file_name` and the line.
using IniFile = std::map<std::string, std::map<std::string, std::string>>;
Result<IniFile> ParseIni(const std::string& text, const std::string& file_name);

// The parts of an endpoint URL. Errors: kInvalidArgument unless SCHEME is http or https and HOST
// is not empty.
struct Endpoint {
  std::string scheme;     // "http" or "https"
  std::string host;       // without port; IPv6 literals keep their brackets
  std::string port;       // "" when none was given
  std::string base_path;  // "" or "/prefix" without a trailing slash
};
Result<Endpoint> ParseEndpoint(const std::string& url);

// True when `bucket` can be a DNS label prefix (virtual-host addressing): 3-63 lower-case
// letters, digits, '-' and '.', starting and ending with a letter or digit, no "..".
bool IsDnsCompatibleBucket(const std::string& bucket);

// S3's encoding of a path or query part: every byte but A-Z a-z 0-9 - . _ ~ as %XX (upper-case
// hex); '/' kept when `keep_slash` (object keys in paths).
std::string UriEncode(const std::string& s, bool keep_slash);

// The URL of a request to `bucket`/`key` (key may be empty: the bucket itself) with `query`, a
// list of (name, value) pairs that this function sorts by name and encodes, every pair written
// "name=value" even when the value is empty: the canonical query string SigV4 signs, so the URL
// curl sends is already canonical. Errors: kInvalidArgument when the bucket is empty, or is not
// DNS-compatible and virtual-host addressing was asked for.
Result<std::string> ObjectUrl(const Options& options, const std::string& bucket, const std::string& key,
                              std::map<std::string, std::string> query = {});

// "s3://BUCKET/KEY" -> (BUCKET, KEY); KEY may be empty ("s3://BUCKET" or "s3://BUCKET/").
// Errors: kInvalidArgument unless it starts with s3:// and names a bucket.
struct BucketKey {
  std::string bucket;
  std::string key;
};
Result<BucketKey> ParseS3Url(const std::string& url);
std::string S3Name(const std::string& bucket, const std::string& key);  // "s3://bucket/key"

// Whether a finished attempt is tried again: `curl_code` is the transfer's CURLcode (0 when it
// completed), `http_status` the response's status (0 when none), `s3_code` the error body's
// <Code>. Transport failures (refused, reset, timed out, cut short; not bad URLs, certificates
// or a body this client refused), 5xx (503 SlowDown included), 429, and the two 4xx codes S3 uses
// for throttling and stalled uploads (SlowDown, RequestTimeout) are retried; other 4xx never.
bool IsRetryable(int curl_code, long http_status, const std::string& s3_code);

// The wait before attempt `attempt` + 1 (attempt counts from 1): a uniformly random delay in
// [0, min(max_delay_ms, base_delay_ms * 2^(attempt-1))] ("full jitter"), `unit_random` in [0, 1).
uint64_t BackoffDelayMs(const RetryPolicy& policy, int attempt, double unit_random);

}  // namespace ucpfs::s3
