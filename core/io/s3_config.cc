// See s3_config.h.
#include "core/io/s3_config.h"

#include <curl/curl.h>  // the CURLcode values only: nothing here calls libcurl
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

extern char** environ;

namespace ucpfs::s3 {
namespace {

constexpr uint64_t kMaxConfigFileBytes = 1 << 20;

std::string Trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r");
  return s.substr(b, e - b + 1);
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Reads a whole file of at most kMaxConfigFileBytes; nullopt when it does not exist.
Result<std::optional<std::string>> ReadSmallFile(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return std::optional<std::string>();
    return IoError(path + ": stat: " + std::strerror(errno), errno);
  }
  if (static_cast<uint64_t>(st.st_size) > kMaxConfigFileBytes) {
    return ResourceExhaustedError(path + ": larger than 1 MiB, not an AWS configuration file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return IoError(path + ": cannot be read", EIO);
  std::ostringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  if (text.size() > kMaxConfigFileBytes) {
    return ResourceExhaustedError(path + ": larger than 1 MiB, not an AWS configuration file");
  }
  return std::optional<std::string>(std::move(text));
}

const std::string* Get(const std::map<std::string, std::string>& m, const std::string& key) {
  auto it = m.find(key);
  if (it == m.end() || it->second.empty()) return nullptr;
  return &it->second;
}

Result<Addressing> ParseAddressing(const std::string& value, const std::string& where) {
  std::string v = Lower(value);
  if (v == "auto") return Addressing::kAuto;
  if (v == "path") return Addressing::kPath;
  if (v == "virtual") return Addressing::kVirtualHost;
  return InvalidArgumentError(where + ": addressing_style '" + value + "' is not auto, path or virtual");
}

}  // namespace

Result<IniFile> ParseIni(const std::string& text, const std::string& file_name) {
  IniFile ini;
  std::string section;
  bool in_section = false;
  std::string parent_key;  // a "key =" line with no value: indented lines below are its sub-keys
  std::istringstream in(text);
  std::string raw;
  int line_no = 0;
  while (std::getline(in, raw)) {
    ++line_no;
    std::string line = Trim(raw);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    const bool indented = raw[0] == ' ' || raw[0] == '\t';
    const std::string where = file_name + ":" + std::to_string(line_no);
    if (line[0] == '[') {
      if (line.back() != ']') return InvalidArgumentError(where + ": section header without ']'");
      section = Trim(line.substr(1, line.size() - 2));
      if (section.empty()) return InvalidArgumentError(where + ": empty section name");
      ini[section];
      in_section = true;
      parent_key.clear();
      continue;
    }
    size_t eq = line.find('=');
    if (eq == std::string::npos) return InvalidArgumentError(where + ": expected 'key = value' or '[section]'");
    if (!in_section) return InvalidArgumentError(where + ": 'key = value' before any [section]");
    std::string key = Lower(Trim(line.substr(0, eq)));
    std::string value = Trim(line.substr(eq + 1));
    if (key.empty()) return InvalidArgumentError(where + ": empty key");
    if (indented && !parent_key.empty()) {
      ini[section][parent_key + "." + key] = value;
      continue;
    }
    if (value.empty()) {
      parent_key = key;
    } else {
      parent_key.clear();
    }
    ini[section][key] = value;
  }
  return ini;
}

Result<Environment> LoadS3Environment() {
  Environment env;
  for (char** e = environ; e && *e; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (!eq) continue;
    std::string name(*e, static_cast<size_t>(eq - *e));
    if (name.rfind("AWS_", 0) == 0 || name == "HOME") env.vars[name] = eq + 1;
  }
  std::string home = env.vars.count("HOME") ? env.vars["HOME"] : "";
  auto path_of = [&](const char* var, const char* leaf) -> std::string {
    if (const std::string* v = Get(env.vars, var)) return *v;
    return home.empty() ? "" : home + "/.aws/" + leaf;
  };
  env.credentials_file_path = path_of("AWS_SHARED_CREDENTIALS_FILE", "credentials");
  env.config_file_path = path_of("AWS_CONFIG_FILE", "config");
  if (!env.credentials_file_path.empty()) {
    UCPFS_ASSIGN_OR_RETURN(env.credentials_file_text, ReadSmallFile(env.credentials_file_path));
  }
  if (!env.config_file_path.empty()) {
    UCPFS_ASSIGN_OR_RETURN(env.config_file_text, ReadSmallFile(env.config_file_path));
  }
  return env;
}

Result<Options> ResolveOptions(const Environment& env, const Overrides& overrides) {
  Options opt;
  const auto& vars = env.vars;
  std::string profile = "default";
  const bool profile_named = Get(vars, "AWS_PROFILE") != nullptr;
  if (profile_named) profile = *Get(vars, "AWS_PROFILE");

  IniFile creds_ini, config_ini;
  if (env.credentials_file_text) {
    UCPFS_ASSIGN_OR_RETURN(creds_ini, ParseIni(*env.credentials_file_text, env.credentials_file_path));
  }
  if (env.config_file_text) {
    UCPFS_ASSIGN_OR_RETURN(config_ini, ParseIni(*env.config_file_text, env.config_file_path));
  }
  // [NAME] in the credentials file; [profile NAME] (or [default]) in the config file.
  static const std::map<std::string, std::string> kEmpty;
  const std::map<std::string, std::string>* creds_sec = &kEmpty;
  const std::map<std::string, std::string>* config_sec = &kEmpty;
  if (auto it = creds_ini.find(profile); it != creds_ini.end()) creds_sec = &it->second;
  if (auto it = config_ini.find("profile " + profile); it != config_ini.end()) {
    config_sec = &it->second;
  } else if (profile == "default") {
    if (auto d = config_ini.find("default"); d != config_ini.end()) config_sec = &d->second;
  }
  if (profile_named && creds_sec == &kEmpty && config_sec == &kEmpty) {
    return InvalidArgumentError("AWS_PROFILE=" + profile + ": no such profile in " +
                                (env.credentials_file_path.empty() ? "~/.aws/credentials" : env.credentials_file_path) +
                                " or " + (env.config_file_path.empty() ? "~/.aws/config" : env.config_file_path));
  }

  // Credentials: a pair from one place, never half from each.
  const std::string* env_id = Get(vars, "AWS_ACCESS_KEY_ID");
  const std::string* env_secret = Get(vars, "AWS_SECRET_ACCESS_KEY");
  std::string cred_source;
  if (env_id || env_secret) {
    if (!env_id || !env_secret) {
      return InvalidArgumentError(std::string(env_id ? "AWS_ACCESS_KEY_ID" : "AWS_SECRET_ACCESS_KEY") +
                                  " is set without " + (env_id ? "AWS_SECRET_ACCESS_KEY" : "AWS_ACCESS_KEY_ID"));
    }
    opt.credentials.access_key_id = *env_id;
    opt.credentials.secret_access_key = *env_secret;
    if (const std::string* t = Get(vars, "AWS_SESSION_TOKEN")) opt.credentials.session_token = *t;
    cred_source = "keys from the environment";
  } else {
    for (auto [sec, path] : {std::pair{creds_sec, &env.credentials_file_path}, std::pair{config_sec, &env.config_file_path}}) {
      const std::string* id = Get(*sec, "aws_access_key_id");
      const std::string* secret = Get(*sec, "aws_secret_access_key");
      if (!id && !secret) continue;
      if (!id || !secret) {
        return InvalidArgumentError(*path + ": profile " + profile + " has " +
                                    (id ? "aws_access_key_id without aws_secret_access_key"
                                        : "aws_secret_access_key without aws_access_key_id"));
      }
      opt.credentials.access_key_id = *id;
      opt.credentials.secret_access_key = *secret;
      if (const std::string* t = Get(*sec, "aws_session_token")) opt.credentials.session_token = *t;
      cred_source = "keys of profile " + profile + " from " + *path;
      break;
    }
    if (cred_source.empty()) cred_source = "no keys (anonymous)";
  }

  if (!overrides.region.empty()) {
    opt.region = overrides.region;
  } else if (const std::string* r = Get(vars, "AWS_REGION")) {
    opt.region = *r;
  } else if (const std::string* dr = Get(vars, "AWS_DEFAULT_REGION")) {
    opt.region = *dr;
  } else if (const std::string* pr = Get(*config_sec, "region")) {
    opt.region = *pr;
  }
  // The region goes into the signing scope and the default host name: plain characters only.
  for (char c : opt.region) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-') {
      return InvalidArgumentError("region '" + opt.region + "' has a character other than letters, digits and '-'");
    }
  }

  std::string endpoint_source;
  if (!overrides.endpoint_url.empty()) {
    opt.endpoint_url = overrides.endpoint_url;
    endpoint_source = "the endpoint given";
  } else if (const std::string* e3 = Get(vars, "AWS_ENDPOINT_URL_S3")) {
    opt.endpoint_url = *e3;
    endpoint_source = "AWS_ENDPOINT_URL_S3";
  } else if (const std::string* e = Get(vars, "AWS_ENDPOINT_URL")) {
    opt.endpoint_url = *e;
    endpoint_source = "AWS_ENDPOINT_URL";
  } else if (const std::string* ps = Get(*config_sec, "s3.endpoint_url")) {
    opt.endpoint_url = *ps;
    endpoint_source = "profile " + profile + " (s3.endpoint_url)";
  } else if (const std::string* p = Get(*config_sec, "endpoint_url")) {
    opt.endpoint_url = *p;
    endpoint_source = "profile " + profile + " (endpoint_url)";
  } else {
    opt.endpoint_url = "https://s3." + opt.region + ".amazonaws.com";
    endpoint_source = "AWS's endpoint for the region";
  }
  if (auto ep = ParseEndpoint(opt.endpoint_url); !ep.ok()) {
    return ep.error().WithContext(endpoint_source);
  }

  if (overrides.addressing) {
    opt.addressing = *overrides.addressing;
  } else if (const std::string* a = Get(*config_sec, "s3.addressing_style")) {
    UCPFS_ASSIGN_OR_RETURN(opt.addressing, ParseAddressing(*a, env.config_file_path + ": profile " + profile));
  }
  if (const std::string* ca = Get(vars, "AWS_CA_BUNDLE")) {
    opt.ca_bundle = *ca;
  } else if (const std::string* pca = Get(*config_sec, "ca_bundle")) {
    opt.ca_bundle = *pca;
  }
  opt.source = "endpoint " + opt.endpoint_url + " from " + endpoint_source + ", region " + opt.region + ", " +
               cred_source;
  return opt;
}

Result<Endpoint> ParseEndpoint(const std::string& url) {
  Endpoint ep;
  size_t sep = url.find("://");
  if (sep == std::string::npos) return InvalidArgumentError("endpoint '" + url + "' is not SCHEME://HOST[:PORT]");
  ep.scheme = Lower(url.substr(0, sep));
  if (ep.scheme != "http" && ep.scheme != "https") {
    return InvalidArgumentError("endpoint '" + url + "': scheme must be http or https");
  }
  std::string rest = url.substr(sep + 3);
  size_t slash = rest.find('/');
  std::string authority = rest.substr(0, slash);
  if (slash != std::string::npos) {
    ep.base_path = rest.substr(slash);
    while (!ep.base_path.empty() && ep.base_path.back() == '/') ep.base_path.pop_back();
  }
  if (authority.find('@') != std::string::npos || authority.find_first_of("?#") != std::string::npos ||
      ep.base_path.find_first_of("?#") != std::string::npos) {
    return InvalidArgumentError("endpoint '" + url + "': user info, query or fragment not allowed");
  }
  if (!authority.empty() && authority[0] == '[') {  // [IPv6]:port
    size_t close = authority.find(']');
    if (close == std::string::npos) return InvalidArgumentError("endpoint '" + url + "': unterminated '['");
    ep.host = authority.substr(0, close + 1);
    std::string after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after[0] != ':') return InvalidArgumentError("endpoint '" + url + "': junk after ']'");
      ep.port = after.substr(1);
    }
  } else {
    size_t colon = authority.rfind(':');
    ep.host = authority.substr(0, colon);
    if (colon != std::string::npos) ep.port = authority.substr(colon + 1);
  }
  if (ep.host.empty()) return InvalidArgumentError("endpoint '" + url + "' has no host");
  if (authority.find(':') != std::string::npos && ep.host[0] != '[' && ep.port.empty()) {
    return InvalidArgumentError("endpoint '" + url + "': empty port");
  }
  if (!ep.port.empty()) {
    if (ep.port.size() > 5 || !std::all_of(ep.port.begin(), ep.port.end(), ::isdigit) || std::stoi(ep.port) > 65535) {
      return InvalidArgumentError("endpoint '" + url + "': port '" + ep.port + "' is not a number up to 65535");
    }
  }
  ep.host = Lower(ep.host);
  return ep;
}

bool IsDnsCompatibleBucket(const std::string& b) {
  if (b.size() < 3 || b.size() > 63) return false;
  auto alnum = [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); };
  if (!alnum(b.front()) || !alnum(b.back())) return false;
  for (size_t i = 0; i < b.size(); ++i) {
    char c = b[i];
    if (!alnum(c) && c != '-' && c != '.') return false;
    if (c == '.' && i > 0 && b[i - 1] == '.') return false;
  }
  return true;
}

std::string UriEncode(const std::string& s, bool keep_slash) {
  static const char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~' || (keep_slash && c == '/')) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

Result<std::string> ObjectUrl(const Options& options, const std::string& bucket, const std::string& key,
                              std::map<std::string, std::string> query) {
  if (bucket.empty()) return InvalidArgumentError("no bucket named");
  UCPFS_ASSIGN_OR_RETURN(Endpoint ep, ParseEndpoint(options.endpoint_url));
  bool virtual_host = false;
  switch (options.addressing) {
    case Addressing::kPath: break;
    case Addressing::kVirtualHost:
      if (!IsDnsCompatibleBucket(bucket)) {
        return InvalidArgumentError("bucket '" + bucket + "' cannot be a host name (virtual-host addressing)");
      }
      virtual_host = true;
      break;
    case Addressing::kAuto: {
      // AWS's own endpoints serve every DNS-compatible bucket as a host name (and https with
      // dots in the name breaks the wildcard certificate); other stores often do not.
      const std::string suffix = ".amazonaws.com";
      bool aws = ep.host.size() > suffix.size() && ep.host.compare(ep.host.size() - suffix.size(), suffix.size(), suffix) == 0;
      virtual_host = aws && IsDnsCompatibleBucket(bucket) && (ep.scheme == "http" || bucket.find('.') == std::string::npos);
      break;
    }
  }
  std::string url = ep.scheme + "://";
  if (virtual_host) url += bucket + ".";
  url += ep.host;
  if (!ep.port.empty()) url += ":" + ep.port;
  url += ep.base_path;
  if (!virtual_host) url += "/" + UriEncode(bucket, false);
  url += "/" + UriEncode(key, true);
  if (!query.empty()) {
    // std::map keeps the names sorted by byte value: SigV4's canonical order.
    char sep = '?';
    for (const auto& [name, value] : query) {
      url += sep;
      url += UriEncode(name, false) + "=" + UriEncode(value, false);
      sep = '&';
    }
  }
  return url;
}

Result<BucketKey> ParseS3Url(const std::string& url) {
  if (url.rfind("s3://", 0) != 0) return InvalidArgumentError("'" + url + "' is not an s3://BUCKET/KEY name");
  std::string rest = url.substr(5);
  size_t slash = rest.find('/');
  BucketKey bk{rest.substr(0, slash), slash == std::string::npos ? "" : rest.substr(slash + 1)};
  if (bk.bucket.empty()) return InvalidArgumentError("'" + url + "' names no bucket");
  return bk;
}

std::string S3Name(const std::string& bucket, const std::string& key) { return "s3://" + bucket + "/" + key; }

bool IsRetryable(int curl_code, long http_status, const std::string& s3_code) {
  if (curl_code != CURLE_OK) {
    // Transport failures that another try may not meet; not our own aborts (a body larger than
    // asked for), bad URLs or certificates, which fail the same way every time.
    switch (curl_code) {
      case CURLE_COULDNT_RESOLVE_HOST:
      case CURLE_COULDNT_CONNECT:
      case CURLE_OPERATION_TIMEDOUT:
      case CURLE_SEND_ERROR:
      case CURLE_RECV_ERROR:
      case CURLE_GOT_NOTHING:
      case CURLE_PARTIAL_FILE:
      case CURLE_HTTP2:
      case CURLE_HTTP2_STREAM:
      case CURLE_SSL_CONNECT_ERROR:
        return true;
      default:
        return false;
    }
  }
  if (http_status >= 500 || http_status == 429) return true;
  if (s3_code == "SlowDown" || s3_code == "RequestTimeout") return true;
  return false;
}

uint64_t BackoffDelayMs(const RetryPolicy& policy, int attempt, double unit_random) {
  uint64_t cap = policy.base_delay_ms;
  for (int i = 1; i < attempt && cap < policy.max_delay_ms; ++i) cap *= 2;
  cap = std::min(cap, policy.max_delay_ms);
  if (unit_random < 0) unit_random = 0;
  if (unit_random >= 1) unit_random = 0.999999;
  return static_cast<uint64_t>(static_cast<double>(cap) * unit_random);
}

}  // namespace ucpfs::s3
