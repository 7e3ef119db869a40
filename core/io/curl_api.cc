// See curl_api.h.
#include "core/io/curl_api.h"

#include <dlfcn.h>
#include <unistd.h>

#include <mutex>
#include <string>
#include <type_traits>

namespace ucpfs::s3 {
namespace {

constexpr const char* kWhy = " (s3:// sources need libcurl 7.75 or later: Debian's package libcurl4)";

// The installed copy beside the running binary: BIN/../lib/ucpfs/libcurl.so.4.
std::string InstalledCopy() {
#ifdef UCPFS_CURL_INSTALLED
  std::string exe(4096, '\0');
  const ssize_t n = readlink("/proc/self/exe", exe.data(), exe.size() - 1);
  if (n <= 0) return "";
  exe.resize(static_cast<size_t>(n));
  const size_t slash = exe.rfind('/');
  if (slash == std::string::npos) return "";
  return exe.substr(0, slash) + "/../" + UCPFS_CURL_INSTALLED;
#else
  return "";
#endif
}

Result<const CurlApi*> Load() {
  // RTLD_LOCAL: curl's symbols are reached only through the table, never resolved by name.
  void* lib = nullptr;
  std::string loaded_name, errors;
  for (const std::string& candidate : CurlLibraryCandidates()) {
    lib = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib) {
      loaded_name = candidate;
      break;
    }
    const char* err = dlerror();
    errors += std::string(errors.empty() ? "" : "; ") + (err ? err : candidate + ": unknown error");
  }
  if (!lib) return Status(StatusCode::kUnsupported, "cannot load libcurl: " + errors + kWhy);
  static CurlApi api;
  bool missing = false;
  std::string missing_name;
  auto bind = [&](auto& slot, const char* name) {
    void* sym = dlsym(lib, name);
    if (!sym && !missing) {
      missing = true;
      missing_name = name;
    }
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(sym);
  };
  bind(api.global_init, "curl_global_init");
  bind(api.version_info, "curl_version_info");
  bind(api.easy_init, "curl_easy_init");
  bind(api.easy_setopt, "curl_easy_setopt");
  bind(api.easy_getinfo, "curl_easy_getinfo");
  bind(api.easy_cleanup, "curl_easy_cleanup");
  bind(api.easy_strerror, "curl_easy_strerror");
  bind(api.slist_append, "curl_slist_append");
  bind(api.slist_free_all, "curl_slist_free_all");
  bind(api.multi_init, "curl_multi_init");
  bind(api.multi_setopt, "curl_multi_setopt");
  bind(api.multi_add_handle, "curl_multi_add_handle");
  bind(api.multi_remove_handle, "curl_multi_remove_handle");
  bind(api.multi_perform, "curl_multi_perform");
  bind(api.multi_info_read, "curl_multi_info_read");
  bind(api.multi_poll, "curl_multi_poll");
  bind(api.multi_cleanup, "curl_multi_cleanup");
  bind(api.multi_strerror, "curl_multi_strerror");
  bind(api.share_init, "curl_share_init");
  bind(api.share_setopt, "curl_share_setopt");
  bind(api.share_cleanup, "curl_share_cleanup");
  if (missing) {
    return Status(StatusCode::kUnsupported,
                  loaded_name + " has no " + missing_name + kWhy);
  }
  const curl_version_info_data* v = api.version_info(CURLVERSION_NOW);
  if (!v || v->version_num < 0x074b00) {
    return Status(StatusCode::kUnsupported, loaded_name + " is libcurl " +
                                                (v ? v->version : "of unknown version") + ", which has no SigV4 signing" +
                                                kWhy);
  }
  if (api.global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) return InternalError("curl_global_init failed");
  return &api;
}

}  // namespace

std::vector<std::string> CurlLibraryCandidates() {
  std::vector<std::string> out;
  auto add_file = [&](const std::string& path) {
    if (!path.empty() && access(path.c_str(), R_OK) == 0) out.push_back(path);
  };
  add_file(InstalledCopy());
#ifdef UCPFS_CURL_BUILT
  add_file(UCPFS_CURL_BUILT);
#endif
  out.push_back(kCurlLibrary);
  return out;
}

std::string CurlLibraryText() {
  const std::vector<std::string> candidates = CurlLibraryCandidates();
  if (candidates.front() == kCurlLibrary) return std::string("libcurl for s3://: the system's ") + kCurlLibrary;
  return "libcurl for s3://: " + candidates.front() + " (HTTP and HTTPS only)";
}

Result<const CurlApi*> LoadCurl() {
  static std::once_flag once;
  static Result<const CurlApi*> loaded = InternalError("libcurl not loaded");
  std::call_once(once, [] { loaded = Load(); });
  return loaded;
}

}  // namespace ucpfs::s3
