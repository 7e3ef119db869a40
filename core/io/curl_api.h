// libcurl reached through a table of function pointers filled by dlopen on the
// first use of an s3:// source, so that the binary does not link libcurl: its ~30 dependencies
// (TLS, Kerberos, LDAP, IDN...) are then loaded only by the mounts and commands that talk to
// object storage, not by every `ucpfs` start (a local mount's cold start was ~40 ms of loading
// them). The S3 client (s3_client.cc) is the only caller; it calls curl through this table alone.
//
// Not for: the curl calls themselves (s3_client.cc), the pure S3 rules (s3_config.h).
#pragma once

#include <curl/curl.h>

#include <string>
#include <vector>

#include "core/status.h"

namespace ucpfs::s3 {

// The system's soname: Debian's libcurl4 (OpenSSL), what libcurl4-openssl-dev builds against.
inline constexpr const char* kCurlLibrary = "libcurl.so.4";

// Where libcurl is looked for, in order: the installed copy of the one the build chose
// (BIN/../lib/ucpfs/libcurl.so.4 of the running binary, put there by `cmake --install`), the one
// the build chose (UCPFS_CURL in the top CMakeLists.txt: tests/build-curl.sh's HTTP(S)-only
// build of Debian's curl source), then kCurlLibrary by the system's search. Paths are tried
// only when the file exists.
std::vector<std::string> CurlLibraryCandidates();

// For `ucpfs --version`: the libcurl an s3:// source would load (without loading it), e.g.
// "libcurl for s3://: /var/cache/ucpfs/libcurl-7.88.1-10+deb12u15/lib/libcurl.so.4 (HTTP and
// HTTPS only)" or "libcurl for s3://: the system's libcurl.so.4".
std::string CurlLibraryText();

// Each member has the type of the libcurl function it is named after (decltype of the header's
// declaration, so a mismatch cannot compile).
struct CurlApi {
  decltype(&::curl_global_init) global_init;
  decltype(&::curl_version_info) version_info;
  decltype(&::curl_easy_init) easy_init;
  decltype(&::curl_easy_setopt) easy_setopt;
  decltype(&::curl_easy_getinfo) easy_getinfo;
  decltype(&::curl_easy_cleanup) easy_cleanup;
  decltype(&::curl_easy_strerror) easy_strerror;
  decltype(&::curl_slist_append) slist_append;
  decltype(&::curl_slist_free_all) slist_free_all;
  decltype(&::curl_multi_init) multi_init;
  decltype(&::curl_multi_setopt) multi_setopt;
  decltype(&::curl_multi_add_handle) multi_add_handle;
  decltype(&::curl_multi_remove_handle) multi_remove_handle;
  decltype(&::curl_multi_perform) multi_perform;
  decltype(&::curl_multi_info_read) multi_info_read;
  decltype(&::curl_multi_poll) multi_poll;
  decltype(&::curl_multi_cleanup) multi_cleanup;
  decltype(&::curl_multi_strerror) multi_strerror;
  decltype(&::curl_share_init) share_init;
  decltype(&::curl_share_setopt) share_setopt;
  decltype(&::curl_share_cleanup) share_cleanup;
};

// The table, loaded, checked and curl_global_init'ed once per process (thread-safe); the same
// answer on every later call. The library stays loaded for the process's life.
// The first candidate that loads is used. Errors: kUnsupported naming each candidate's failure
// when none loads (not installed), or naming the one loaded when it lacks a function or is older
// than 7.75 (no SigV4 signing); kInternal when curl_global_init fails.
Result<const CurlApi*> LoadCurl();

}  // namespace ucpfs::s3
