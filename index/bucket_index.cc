#include "index/bucket_index.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <span>
#include <vector>

namespace ucpfs::index {
namespace {

constexpr char kManifestFormat[] = "ucpfs-bucket-index";
constexpr int kManifestVersion = 1;
constexpr uint64_t kDownloadChunkBytes = uint64_t{64} << 20;  // one ranged read (several GETs in flight)

std::string Hex16(uint64_t v) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(v));
  return hex;
}

Result<uint64_t> ParseHex16(const nlohmann::json& j, const char* field, const std::string& where) {
  if (!j.is_string() || j.get_ref<const std::string&>().size() != 16) {
    return CorruptError(where + ": \"" + field + "\" is not 16 hex digits");
  }
  uint64_t v = 0;
  for (char c : j.get_ref<const std::string&>()) {
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return CorruptError(where + ": \"" + field + "\" is not 16 lowercase hex digits");
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  return v;
}

// "index-<16 hex>-<16 hex>.mdb": a plain name, never a path.
bool IsDataObjectName(const std::string& name) {
  if (name.size() != 6 + 16 + 1 + 16 + 4 || !name.starts_with("index-") || !name.ends_with(".mdb") || name[22] != '-') {
    return false;
  }
  for (size_t i = 6; i < 39; ++i) {
    if (i == 22) continue;
    if (!((name[i] >= '0' && name[i] <= '9') || (name[i] >= 'a' && name[i] <= 'f'))) return false;
  }
  return true;
}

std::string KeyUnder(const S3Tree& tree, const std::string& name) {
  const std::string dir = std::string(kBucketIndexDir) + "/" + name;
  return tree.prefix().empty() ? dir : tree.prefix() + "/" + dir;
}

// mkdir -p of a local directory of ours; a symlink or non-directory on the way is refused.
Status MakeDirs(const std::string& dir) {
  std::string path;
  size_t pos = 0;
  while (pos < dir.size()) {
    size_t next = dir.find('/', pos + 1);
    if (next == std::string::npos) next = dir.size();
    path = dir.substr(0, next);
    pos = next;
    if (path.empty()) continue;
    if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) return IoError("mkdir " + path, errno);
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) return IoError("stat " + path, errno);
    if (!S_ISDIR(st.st_mode)) return IoError(path + ": not a directory (a symlink is not followed)", ENOTDIR);
  }
  return Status::Ok();
}

// The whole of a local regular file of ours (the catalog just built), at most max_bytes.
Result<std::vector<std::byte>> ReadLocalFile(const std::string& path, uint64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return IoError("open " + path, errno);
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return IoError(path + ": not a regular file", EINVAL);
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    return ResourceExhaustedError(path + ": " + std::to_string(st.st_size) + " bytes, more than the " +
                                  std::to_string(max_bytes) + " a bucket index may have");
  }
  std::vector<std::byte> out(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      return IoError("read " + path, err);
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return out;
}

// The manifest, or nullopt-like kNotFound when the bucket has none.
Result<BucketManifest> FetchManifest(const S3Tree& tree, const std::string& url) {
  s3::Client& client = *tree.client();
  const std::string key = KeyUnder(tree, kBucketManifestName);
  UCPFS_ASSIGN_OR_RETURN(const s3::ObjectInfo info, client.Head(tree.bucket(), key));
  if (info.n_bytes > kMaxManifestBytes) {
    return CorruptError(url + ": " + std::to_string(info.n_bytes) + " bytes, more than a manifest's " +
                        std::to_string(kMaxManifestBytes));
  }
  std::string text(info.n_bytes, '\0');
  UCPFS_RETURN_IF_ERROR(client.GetRange(tree.bucket(), key, 0, std::as_writable_bytes(std::span(text)), info.etag));
  return ParseBucketManifest(text, url);
}

// The manifest's catalog in a local directory of its own (downloaded unless already there):
// CACHE/from-bucket/<hash of the data object's key and ETag>/data.mdb.
Result<std::string> FetchCatalog(const S3Tree& tree, const BucketManifest& m, const BucketIndexOptions& options) {
  const std::string key = KeyUnder(tree, m.object);
  const std::string name = s3::S3Name(tree.bucket(), key);
  if (m.n_bytes > options.max_index_bytes) {
    return CorruptError(name + ": " + std::to_string(m.n_bytes) + " bytes, more than the " +
                        std::to_string(options.max_index_bytes) + " a bucket index may have");
  }
  s3::Client& client = *tree.client();
  UCPFS_ASSIGN_OR_RETURN(const s3::ObjectInfo info, client.Head(tree.bucket(), key));
  if (info.n_bytes != m.n_bytes) {
    return CorruptError(name + ": " + std::to_string(info.n_bytes) + " bytes, its manifest says " +
                        std::to_string(m.n_bytes));
  }
  const std::string version = tree.bucket() + "/" + key + " " + info.etag;
  const std::string dir = options.cache_dir + "/from-bucket/" + Hex16(XXH3_64bits(version.data(), version.size()));
  const std::string path = dir + "/data.mdb";
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_size) == m.n_bytes) {
    return dir;  // this version was downloaded (and its hash checked) before
  }
  UCPFS_RETURN_IF_ERROR(MakeDirs(dir));
  const std::string tmp = dir + "/data.mdb.tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) return IoError("create " + tmp, errno);
  auto fail = [&](Status error) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return error;
  };
  XXH3_state_t* hash = XXH3_createState();
  if (hash == nullptr) return fail(InternalError("XXH3_createState failed"));
  XXH3_64bits_reset(hash);
  auto source = s3::S3ObjectSource::FromRecorded(tree.client(), tree.bucket(), key, info.n_bytes, info.etag);
  std::vector<std::byte> buf(static_cast<size_t>(std::min(kDownloadChunkBytes, std::max<uint64_t>(m.n_bytes, 1))));
  for (uint64_t off = 0; off < m.n_bytes;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), m.n_bytes - off));
    Status read = source->ReadAt(off, std::span(buf).first(n));
    if (!read.ok()) {
      XXH3_freeState(hash);
      return fail(read);
    }
    XXH3_64bits_update(hash, buf.data(), n);
    for (size_t done = 0; done < n;) {
      const ssize_t w = ::pwrite(fd, buf.data() + done, n - done, static_cast<off_t>(off + done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        XXH3_freeState(hash);
        return fail(IoError("write " + tmp, w < 0 ? errno : EIO));
      }
      done += static_cast<size_t>(w);
    }
    off += n;
  }
  const uint64_t got = XXH3_64bits_digest(hash);
  XXH3_freeState(hash);
  if (got != m.xxh3) {
    return fail(CorruptError(name + ": its bytes hash to " + Hex16(got) + ", its manifest says " + Hex16(m.xxh3)));
  }
  if (::fsync(fd) != 0) return fail(IoError("fsync " + tmp, errno));
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return IoError("rename " + tmp, err);
  }
  return dir;
}

// Writes the local catalog of `opened` to the bucket: the data object first, the manifest last,
// then the data object the previous manifest named is deleted.
Status Upload(const S3Tree& tree, const OpenedIndex& opened, const BucketIndexOptions& options,
              const Result<BucketManifest>& previous) {
  UCPFS_ASSIGN_OR_RETURN(const std::vector<std::byte> bytes,
                         ReadLocalFile(opened.index_dir + "/data.mdb", options.max_index_bytes));
  BucketManifest m;
  m.schema = kCatalogSchemaVersion;
  m.fingerprint = opened.fingerprint;
  m.n_bytes = bytes.size();
  m.xxh3 = XXH3_64bits(bytes.data(), bytes.size());
  m.object = "index-" + Hex16(m.fingerprint) + "-" + Hex16(m.xxh3) + ".mdb";
  s3::Client& client = *tree.client();
  UCPFS_RETURN_IF_ERROR(client.PutObject(tree.bucket(), KeyUnder(tree, m.object), bytes).status());
  const std::string text = BucketManifestText(m);
  UCPFS_RETURN_IF_ERROR(
      client.PutObject(tree.bucket(), KeyUnder(tree, kBucketManifestName), std::as_bytes(std::span(text))).status());
  if (previous.ok() && previous->object != m.object) {
    (void)client.DeleteObject(tree.bucket(), KeyUnder(tree, previous->object));  // best effort: a leftover only costs space
  }
  return Status::Ok();
}

}  // namespace

std::string BucketManifestText(const BucketManifest& m) {
  nlohmann::ordered_json j;
  j["format"] = kManifestFormat;
  j["version"] = kManifestVersion;
  j["schema"] = m.schema;
  j["fingerprint"] = Hex16(m.fingerprint);
  j["object"] = m.object;
  j["n_bytes"] = m.n_bytes;
  j["xxh3"] = Hex16(m.xxh3);
  return j.dump(2) + "\n";
}

Result<BucketManifest> ParseBucketManifest(std::string_view text, const std::string& where) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return CorruptError(where + ": not a JSON object");
  auto field = [&](const char* name) -> const nlohmann::json* {
    auto it = j.find(name);
    return it == j.end() ? nullptr : &*it;
  };
  const nlohmann::json* format = field("format");
  const nlohmann::json* version = field("version");
  if (!format || *format != kManifestFormat) return CorruptError(where + ": not a ucpfs bucket index manifest");
  if (!version || !version->is_number_unsigned() || version->get<uint64_t>() != kManifestVersion) {
    return CorruptError(where + ": manifest version is not " + std::to_string(kManifestVersion));
  }
  BucketManifest m;
  const nlohmann::json* schema = field("schema");
  const nlohmann::json* n_bytes = field("n_bytes");
  const nlohmann::json* object = field("object");
  if (!schema || !schema->is_number_unsigned() || schema->get<uint64_t>() > UINT32_MAX) {
    return CorruptError(where + ": \"schema\" is not a version number");
  }
  m.schema = static_cast<uint32_t>(schema->get<uint64_t>());
  if (!n_bytes || !n_bytes->is_number_unsigned()) return CorruptError(where + ": \"n_bytes\" is not a size");
  m.n_bytes = n_bytes->get<uint64_t>();
  if (!object || !object->is_string() || !IsDataObjectName(object->get<std::string>())) {
    return CorruptError(where + ": \"object\" is not index-<16 hex>-<16 hex>.mdb");
  }
  m.object = object->get<std::string>();
  const nlohmann::json* fp = field("fingerprint");
  const nlohmann::json* xxh3 = field("xxh3");
  if (!fp || !xxh3) return CorruptError(where + ": \"fingerprint\" or \"xxh3\" is missing");
  UCPFS_ASSIGN_OR_RETURN(m.fingerprint, ParseHex16(*fp, "fingerprint", where));
  UCPFS_ASSIGN_OR_RETURN(m.xxh3, ParseHex16(*xxh3, "xxh3", where));
  return m;
}

Result<OpenedIndex> OpenOrBuildBucketIndex(const std::shared_ptr<const S3Tree>& tree,
                                           const BucketIndexOptions& options, BucketIndexReport* report) {
  BucketIndexReport local_report;
  BucketIndexReport& r = report ? *report : local_report;
  r = BucketIndexReport{};
  r.manifest_url = s3::S3Name(tree->bucket(), KeyUnder(*tree, kBucketManifestName));
  const std::string hint = ": run `ucpfs index " + tree->Root() + "` to build it";

  // 1. The bucket's index, when it is there, fresh and checks out.
  Result<BucketManifest> manifest = FetchManifest(*tree, r.manifest_url);
  const bool none = !manifest.ok() && manifest.error().code() == StatusCode::kNotFound;
  if (!manifest.ok() && !none) {
    r.warning = "the bucket's index is not used: " + manifest.error().ToString();
    if (options.read_only) return Status(StatusCode::kDataLoss, r.warning + hint);
  }
  if (manifest.ok()) {
    Status why = Status::Ok();
    if (manifest->schema != kCatalogSchemaVersion) {
      why = Status(StatusCode::kDataLoss, r.manifest_url + ": index schema " + std::to_string(manifest->schema) +
                                              ", this ucpfs reads " + std::to_string(kCatalogSchemaVersion));
    } else if (Result<std::string> dir = FetchCatalog(*tree, *manifest, options); !dir.ok()) {
      why = dir.error();
    } else {
      IndexOptions io;
      io.index_dir = *dir;
      io.read_only = true;
      io.tree = tree;
      io.progress = options.progress;
      Result<OpenedIndex> opened = OpenOrBuildIndex(tree->Root(), io);
      if (opened.ok()) {
        r.from_bucket = true;
        return opened;
      }
      why = opened.error();
    }
    r.warning = "the bucket's index is not used: " + why.ToString();
    if (options.read_only) return Status(StatusCode::kDataLoss, r.warning + hint);
  } else if (none && options.read_only) {
    return NotFoundError("no index in the bucket (" + r.manifest_url + ")" + hint);
  }

  // 2. The local one, reused or built, then kept in the bucket for the next node.
  IndexOptions io;
  io.index_dir = options.cache_dir;
  io.tree = tree;
  io.progress = options.progress;
  UCPFS_ASSIGN_OR_RETURN(OpenedIndex opened, OpenOrBuildIndex(tree->Root(), io));
  if (Status up = Upload(*tree, opened, options, manifest); up.ok()) {
    r.uploaded = true;
  } else {
    r.warning += std::string(r.warning.empty() ? "" : "; ") + "the index was not written to the bucket (" +
                 up.ToString() + "): it stays in " + opened.index_dir;
  }
  return opened;
}

}  // namespace ucpfs::index
