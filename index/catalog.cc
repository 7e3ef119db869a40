// The LMDB catalog (see catalog.h): where the index lives, the source's fingerprint, the checks of
// a loaded catalog against the real files, and OpenOrBuildIndex. The file itself (its tables, the
// atomic publish and the isolated read) is catalog_file.cc; the untrusted directory it lives in,
// index_dir.cc.
//
// The index directory is untrusted (a checkpoint may ship one): see IndexDir. A catalog is
// written whole into a new file ucpfs creates (O_TMPFILE, or an O_EXCL name), synced, and renamed
// over data.mdb. So a published data.mdb is never written again: readers need no lock table
// and see the old catalog or the new one, never a mix; builders serialize on an exclusive flock
// of index_dir/lock. Nothing in the directory is ever deleted except a temporary name ucpfs
// itself created.
#include "index/catalog.h"

#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "core/checked.h"
#include "index/catalog_file.h"
#include "index/index_dir.h"
#include "index/scanner.h"

namespace ucpfs::index {
namespace fs = std::filesystem;
namespace {

constexpr char kIndexDirName[] = ".ucpfs";

bool IsMetadataFile(std::string_view name) {
  if (name == ".metadata" || name == "metadata.json") return true;
  return name.size() > 2 + 9 && name.substr(0, 2) == "__" &&
         name.substr(name.size() - 9) == ".metadata";
}

void HashU64(XXH3_state_t* state, uint64_t v) {
  unsigned char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>((v >> (8 * i)) & 0xFF);
  XXH3_64bits_update(state, b, sizeof(b));
}

// The bytes of the source file `rel`, as they are when it is opened.
Status HashFileBytes(XXH3_state_t* state, const SourceTree& tree, const std::string& rel) {
  Result<OpenedFile> file = tree.Open(rel);
  if (!file.ok()) return Status(file.error().code(), "fingerprint: opening " + file.error().message(), file.error().sys_errno());
  const ByteSource& src = *file->bytes;
  std::vector<std::byte> buf(1 << 20);
  for (uint64_t at = 0; at < src.Size();) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), src.Size() - at));
    Status read = src.ReadAt(at, std::span(buf.data(), n));
    if (!read.ok()) return Status(read.code(), "fingerprint: reading " + read.message(), read.sys_errno());
    XXH3_64bits_update(state, buf.data(), n);
    at += n;
  }
  return Status::Ok();
}


// Creating SRC/.ucpfs is the probe: access(W_OK) is true for root even on a directory it
// cannot write into (a read-only mount answers EROFS only to an actual write).
bool CanCreateIndexDirIn(const std::string& src_dir) {
  if (::access(src_dir.c_str(), W_OK) != 0) return false;
  std::string dir = src_dir + "/" + kIndexDirName;
  if (::mkdir(dir.c_str(), 0755) == 0) return true;
  if (errno != EEXIST) return false;
  struct stat st;  // lstat: a symlinked SRC/.ucpfs is refused later (IndexDir::Open)
  return ::lstat(dir.c_str(), &st) == 0 && (S_ISLNK(st.st_mode) || (S_ISDIR(st.st_mode) &&
                                                                    ::access(dir.c_str(), W_OK) == 0));
}

// Read-only mode writes nothing, not even the probe directory: SRC/.ucpfs when it holds an
// environment, else the cache path.
std::string ReadOnlyIndexDir(const std::string& src_dir) {
  std::string dir = src_dir + "/" + kIndexDirName;
  struct stat st;
  if (::lstat((dir + "/data.mdb").c_str(), &st) == 0) return dir;  // checked when opened
  return CacheIndexDir(src_dir);
}

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

const char* IndexStateName(IndexState state) {
  switch (state) {
    case IndexState::kReused: return "reused";
    case IndexState::kBuilt: return "built";
    case IndexState::kRebuiltChanged: return "rebuilt (source changed)";
    case IndexState::kRebuiltCorrupt: return "rebuilt (index was corrupt)";
  }
  return "unknown";
}

Result<uint64_t> FingerprintSource(const SourceTree& tree) {
  const std::string& dir = tree.Root();
  Result<TreeEntry> root = tree.Stat("");
  if (!root.ok()) {
    if (root.error().code() == StatusCode::kNotFound) return NotFoundError("fingerprint: no directory " + dir);
    return IoError("fingerprint: " + root.error().message(), root.error().sys_errno());
  }
  if (root->kind != EntryKind::kDirectory) return NotFoundError("fingerprint: " + dir + " is not a directory");

  struct Entry {
    std::string rel_path;
    uint64_t n_bytes;
    int64_t mtime_ns;
    int64_t ctime_ns;
    uint64_t ino;
    bool is_metadata;
  };
  std::vector<Entry> entries;
  // Depth first through real directories: List never follows a symlink (the scan refuses one by
  // name), and FIFOs, sockets and devices are never opened.
  std::vector<std::string> pending = {""};
  while (!pending.empty()) {
    const std::string rel_dir = std::move(pending.back());
    pending.pop_back();
    Result<std::vector<TreeEntry>> listed = tree.List(rel_dir);
    if (!listed.ok()) {
      if (!rel_dir.empty() && listed.error().code() == StatusCode::kNotFound) continue;  // vanished while walking
      return IoError("fingerprint: listing " + listed.error().message(), listed.error().sys_errno());
    }
    for (TreeEntry& e : *listed) {
      if (e.name == kIndexDirName) continue;
      std::string rel = rel_dir.empty() ? e.name : rel_dir + "/" + e.name;
      if (e.kind == EntryKind::kDirectory) {
        pending.push_back(std::move(rel));
      } else if (e.kind == EntryKind::kFile) {
        entries.push_back(Entry{std::move(rel), e.identity.n_bytes, e.identity.mtime_ns, e.identity.ctime_ns,
                                e.identity.ino, IsMetadataFile(e.name)});
      }
    }
  }
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.rel_path < b.rel_path; });

  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
  if (!state) return ResourceExhaustedError("fingerprint: out of memory");
  XXH3_64bits_reset(state.get());
  for (const Entry& e : entries) {
    // Length-prefixed path, so that ("ab", ...) and ("a", "b"...) cannot collide by framing.
    HashU64(state.get(), e.rel_path.size());
    XXH3_64bits_update(state.get(), e.rel_path.data(), e.rel_path.size());
    HashU64(state.get(), e.n_bytes);
    HashU64(state.get(), static_cast<uint64_t>(e.mtime_ns));
    // ctime and inode too: a file replaced or edited in place (even with its size and mtime
    // restored) is re-indexed, so a remount clears the EIO its changed bytes gave.
    HashU64(state.get(), static_cast<uint64_t>(e.ctime_ns));
    HashU64(state.get(), e.ino);
    if (e.is_metadata) UCPFS_RETURN_IF_ERROR(HashFileBytes(state.get(), tree, e.rel_path));
  }
  return static_cast<uint64_t>(XXH3_64bits_digest(state.get()));
}

std::string CacheIndexDir(const std::string& src_dir) {
  std::string base;
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg != nullptr && xdg[0] == '/') {  // the XDG spec ignores relative paths
    base = xdg;
  } else {
    const char* home = std::getenv("HOME");
    if (home == nullptr || home[0] == '\0') {
      const struct passwd* pw = ::getpwuid(::getuid());
      home = pw != nullptr ? pw->pw_dir : "/tmp";
    }
    base = std::string(home) + "/.cache";
  }
  std::error_code ec;
  fs::path abs = fs::weakly_canonical(fs::absolute(src_dir, ec), ec);
  if (ec) abs = fs::absolute(src_dir, ec).lexically_normal();
  std::string key = abs.string();
  while (key.size() > 1 && key.back() == '/') key.pop_back();
  return base + "/ucpfs/" + Hex16(XXH3_64bits(key.data(), key.size()));
}

std::string DefaultIndexDirFor(const std::string& src_dir,
                               const std::function<bool(const std::string&)>& can_create_index_dir_in) {
  if (can_create_index_dir_in(src_dir)) return src_dir + "/" + kIndexDirName;
  return CacheIndexDir(src_dir);
}

std::string DefaultIndexDir(const std::string& src_dir) {
  return DefaultIndexDirFor(src_dir, CanCreateIndexDirIn);
}


Status StoreCheckpoint(const std::string& index_dir, const Checkpoint& checkpoint,
                       uint64_t fingerprint) {
  UCPFS_RETURN_IF_ERROR(CheckStorable(index_dir, checkpoint));
  UCPFS_ASSIGN_OR_RETURN(IndexDir dir, IndexDir::OpenOrCreate(index_dir));
  return WriteCatalogFile(dir, checkpoint, fingerprint);
}

Result<Checkpoint> LoadCheckpoint(const std::string& index_dir, bool /*read_only*/,
                                  uint64_t* fingerprint) {
  Result<IndexDir> dir = IndexDir::Open(index_dir);
  if (!dir.ok()) {
    if (dir.error().code() == StatusCode::kNotFound) return NotFoundError("no index in " + index_dir);
    return dir.error();
  }
  return ReadCatalogFile(*dir, fingerprint);
}

Status ValidateIndexRecords(const SourceTree& tree, const std::string& index_dir, const Checkpoint& c) {
  const std::string& src_dir = tree.Root();
  auto bad = [&](const std::string& what) {
    return Status(StatusCode::kDataLoss, "index " + index_dir + " does not match " + src_dir + ": " + what);
  };
  std::vector<uint64_t> sizes;
  sizes.reserve(c.files.size());
  for (const SourceFile& f : c.files) {
    if (!SafeRelativePath(f.rel_path) || !SafeTreePath(f.rel_path)) {
      return bad("file path '" + f.rel_path + "' leaves the checkpoint");
    }
    Result<TreeEntry> st = tree.Stat(f.rel_path);
    if (!st.ok() || st->kind != EntryKind::kFile) {
      return bad("'" + f.rel_path + "' is not a regular file of the checkpoint");
    }
    if (st->identity.n_bytes != f.n_bytes) {
      return bad("'" + f.rel_path + "' has " + std::to_string(st->identity.n_bytes) + " bytes, the index says " +
                 std::to_string(f.n_bytes));
    }
    sizes.push_back(f.n_bytes);
  }
  auto inside = [&](uint32_t file_id, uint64_t offset, uint64_t n) {
    return file_id < sizes.size() && offset <= sizes[file_id] && n <= sizes[file_id] - offset;
  };
  for (const Item& it : c.items) {
    if (it.kind == ItemKind::kBytes) {
      if (!inside(it.file_id, it.byte_offset, it.n_bytes)) return bad("item '" + it.key + "' lies outside its file");
      continue;
    }
    for (int64_t d : it.layout.shape) {
      if (d < 0) return bad("item '" + it.key + "' has a negative dimension");
    }
    for (const slice::Fragment& f : it.layout.fragments) {
      if (f.file_id == slice::kZeroFileId) continue;
      if (f.box.sizes.size() != it.layout.shape.size() || f.flat_lo > f.flat_hi) {
        return bad("item '" + it.key + "' has a malformed fragment");
      }
      // The stored extent: contiguous elements, or the farthest strided element.
      std::optional<uint64_t> n_elems = f.NumElems();
      if (!f.strides.empty()) {
        if (f.strides.size() != f.box.sizes.size()) return bad("item '" + it.key + "' has malformed strides");
        n_elems = f.box.Volume() == 0 ? 0 : 1;
        for (size_t k = 0; k < f.strides.size() && n_elems && *n_elems > 0; ++k) {
          if (f.strides[k] < 0 || f.box.sizes[k] < 0) return bad("item '" + it.key + "' has negative strides");
          auto span = CheckedMul(static_cast<uint64_t>(f.box.sizes[k] - (f.box.sizes[k] > 0 ? 1 : 0)),
                                 static_cast<uint64_t>(f.strides[k]));
          n_elems = span ? CheckedAdd(*n_elems, *span) : std::nullopt;
        }
      }
      std::optional<uint64_t> n_bytes = n_elems ? CheckedMul(*n_elems, ItemSize(f.dtype)) : std::nullopt;
      if (!n_bytes || !inside(f.file_id, f.byte_offset, *n_bytes)) {
        return bad("a fragment of '" + it.key + "' lies outside its file");
      }
      for (const slice::MeanPart& m : f.mean_with) {  // the other copies of an averaged fragment
        std::optional<uint64_t> m_bytes = n_elems ? CheckedMul(*n_elems, ItemSize(m.dtype)) : std::nullopt;
        if (!m_bytes || !inside(m.file_id, m.byte_offset, *m_bytes)) {
          return bad("an averaged copy of '" + it.key + "' lies outside its file");
        }
      }
    }
    Status covered = slice::ValidateCoverage(it.layout, it.key);
    if (!covered.ok()) return bad(covered.message());
  }
  return Status::Ok();
}

Result<OpenedIndex> OpenOrBuildIndex(const std::string& src_dir, const IndexOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::shared_ptr<const SourceTree> tree = options.tree ? options.tree : LocalTree::Make(src_dir);
  UCPFS_ASSIGN_OR_RETURN(uint64_t fingerprint, FingerprintSource(*tree));

  OpenedIndex out;
  out.fingerprint = fingerprint;
  if (options.read_only) {
    out.index_dir = options.index_dir.empty() ? ReadOnlyIndexDir(src_dir) : options.index_dir;
    const std::string hint = ": run `ucpfs index " + src_dir + "` to build it";
    uint64_t stored = 0;
    Result<Checkpoint> loaded = LoadCheckpoint(out.index_dir, /*read_only=*/true, &stored);
    if (!loaded.ok()) {
      const Status& e = loaded.error();
      if (e.code() == StatusCode::kNotFound) {
        return NotFoundError("no index for " + src_dir + " (" + e.message() + ")" + hint);
      }
      if (e.code() == StatusCode::kDataLoss) {
        return Status(StatusCode::kDataLoss, e.message() + hint);
      }
      return e;
    }
    if (stored != fingerprint) {
      return Status(StatusCode::kDataLoss, "index " + out.index_dir + " is stale (" + src_dir +
                                               " changed since it was indexed)" + hint);
    }
    // A prebuilt index is untrusted like the rest of the checkpoint: every record is checked
    // against the real files before it is used.
    Status valid = ValidateIndexRecords(*tree, out.index_dir, loaded.value());
    if (!valid.ok()) return Status(StatusCode::kDataLoss, valid.message() + hint);
    out.checkpoint = std::move(loaded).value();
    out.state = IndexState::kReused;
    out.elapsed_s = SecondsSince(t0);
    return out;
  }

  out.index_dir = options.index_dir.empty() ? DefaultIndexDir(src_dir) : options.index_dir;
  bool crafted = false;  // records that do not match the real files: rebuilt, never served
  auto try_reuse = [&](Result<Checkpoint>& loaded, uint64_t stored) -> bool {
    if (!loaded.ok() || stored != fingerprint) return false;
    crafted = !ValidateIndexRecords(*tree, out.index_dir, loaded.value()).ok();
    if (crafted) return false;
    out.checkpoint = std::move(loaded).value();
    out.state = IndexState::kReused;
    out.elapsed_s = SecondsSince(t0);
    return true;
  };
  // One descriptor of the index directory for the whole operation: nothing below reaches it by
  // path again.
  UCPFS_ASSIGN_OR_RETURN(IndexDir dir, IndexDir::OpenOrCreate(out.index_dir));
  {
    // Fast path without the build lock: a published data.mdb is never written again, so this
    // reads a whole catalog, the old one or the new one.
    uint64_t stored = 0;
    Result<Checkpoint> loaded = ReadCatalogFile(dir, &stored);
    if (try_reuse(loaded, stored)) return out;
    // A symlinked or special data.mdb, or an I/O error: refused before the lock file is created.
    if (!loaded.ok() && loaded.error().code() != StatusCode::kNotFound &&
        loaded.error().code() != StatusCode::kDataLoss) {
      return loaded.error();
    }
  }

  BuildLock lock;
  UCPFS_RETURN_IF_ERROR(lock.Acquire(dir));
  // Under the lock, look again: another process may have just built it.
  uint64_t stored = 0;
  Result<Checkpoint> loaded = ReadCatalogFile(dir, &stored);
  if (try_reuse(loaded, stored)) return out;
  if (loaded.ok()) {
    out.state = crafted ? IndexState::kRebuiltCorrupt : IndexState::kRebuiltChanged;
  } else if (loaded.error().code() == StatusCode::kNotFound) {
    out.state = IndexState::kBuilt;
  } else if (loaded.error().code() == StatusCode::kDataLoss) {
    // Undecodable, or not an LMDB file at all: replaced below, never deleted or written.
    out.state = IndexState::kRebuiltCorrupt;
  } else {
    return loaded.error();
  }

  const CheckpointScanner& scanner = options.scanner;
  Result<Checkpoint> scanned = scanner ? scanner(src_dir, options.progress)
                                       : ScanCheckpoint(*tree, options.progress);
  if (!scanned.ok()) return scanned.error();
  UCPFS_RETURN_IF_ERROR(CheckStorable(out.index_dir, scanned.value()));
  UCPFS_RETURN_IF_ERROR(WriteCatalogFile(dir, scanned.value(), fingerprint));
  out.checkpoint = std::move(scanned).value();
  out.elapsed_s = SecondsSince(t0);
  return out;
}

}  // namespace ucpfs::index
