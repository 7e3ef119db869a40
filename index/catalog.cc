// The LMDB catalog (see catalog.h). The index is one file, `data.mdb`, an LMDB environment
// opened with MDB_NOSUBDIR | MDB_NOLOCK:
//   "meta"  : schema_version (u32 LE), fingerprint (u64 LE), format, flavor, facts (source_facts.h)
//             (strings), n_files, n_items (u64 LE)
//   "files" : u32 BE file_id  -> codec::EncodeSourceFile
//   "items" : u64 BE item index -> codec::EncodeItem
//
// The index directory is untrusted (a checkpoint may ship one): see IndexDir. A catalog is
// written whole into a new file ucpfs creates (O_TMPFILE, or an O_EXCL name), synced, and renamed
// over data.mdb. So a published data.mdb is never written again: readers need no lock table
// (no lock.mdb is ever created or opened) and see the old catalog or the new one, never a mix;
// builders serialize on an exclusive flock of index_dir/lock. Nothing in the directory is ever
// deleted except a temporary name ucpfs itself created.
//
// Lifetimes: every environment is opened, used and closed inside one function; MDB_val data
// points into the map and is copied (decoded) before its transaction ends.
#include "index/catalog.h"

#include <fcntl.h>
#include <lmdb.h>
#include <pwd.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "core/checked.h"
#include "index/catalog_codec.h"
#include "index/scanner.h"

namespace ucpfs::index {
namespace fs = std::filesystem;
namespace {

// LMDB's map is virtual address space, not disk: a generous size costs nothing.
constexpr size_t kMapSizeBytes = size_t{64} << 30;
constexpr unsigned kMaxDbs = 4;
constexpr char kMetaDb[] = "meta";
constexpr char kFilesDb[] = "files";
constexpr char kItemsDb[] = "items";
constexpr char kIndexDirName[] = ".ucpfs";

Status LmdbError(int rc, const std::string& what) {
  std::string msg = what + ": " + mdb_strerror(rc);
  switch (rc) {
    case MDB_INVALID:
    case MDB_VERSION_MISMATCH:
    case MDB_CORRUPTED:
    case MDB_PAGE_NOTFOUND:
    case MDB_INCOMPATIBLE:
    case MDB_BAD_VALSIZE:
      return Status(StatusCode::kDataLoss, msg);
    case MDB_MAP_FULL:
    case ENOSPC:
    case EDQUOT:
      return Status(StatusCode::kNoSpace, msg, rc > 0 ? rc : 0);
    case MDB_NOTFOUND:
    case ENOENT:
      return NotFoundError(msg);
    default:
      if (rc > 0) return IoError(msg, rc);
      return InternalError(msg);
  }
}

struct EnvCloser {
  void operator()(MDB_env* env) const { mdb_env_close(env); }
};
using EnvPtr = std::unique_ptr<MDB_env, EnvCloser>;

// Aborts unless committed; must be destroyed before its environment.
class Txn {
 public:
  Txn() = default;
  Txn(const Txn&) = delete;
  Txn& operator=(const Txn&) = delete;
  ~Txn() {
    if (txn_ != nullptr) mdb_txn_abort(txn_);
  }
  MDB_txn** out() { return &txn_; }
  MDB_txn* get() const { return txn_; }
  int Commit() {
    int rc = mdb_txn_commit(txn_);
    txn_ = nullptr;  // committed or not, the handle is freed
    return rc;
  }

 private:
  MDB_txn* txn_ = nullptr;
};

class Cursor {
 public:
  Cursor() = default;
  Cursor(const Cursor&) = delete;
  Cursor& operator=(const Cursor&) = delete;
  ~Cursor() {
    if (cursor_ != nullptr) mdb_cursor_close(cursor_);
  }
  MDB_cursor** out() { return &cursor_; }
  MDB_cursor* get() const { return cursor_; }

 private:
  MDB_cursor* cursor_ = nullptr;
};

std::string Hex16(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// A file descriptor, closed when it goes.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // The magic link that reopens this very inode, whatever its names now are.
  std::string ProcPath() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_ = -1;
};

std::string NotFollowed(const std::string& what, const std::string& path, const struct stat& st) {
  return what + " " + path + " is " + (S_ISLNK(st.st_mode) ? "a symbolic link" : "not a regular file") +
         ": not followed (remove it, or give --index-dir)";
}

// The index directory, opened once with O_DIRECTORY|O_NOFOLLOW: a checkpoint may ship its own
// `.ucpfs/` (data.mdb -> /etc/passwd, or `.ucpfs` -> /etc), so neither the directory nor any
// file in it is ever reached through a symlink, and everything in it is reached relative to
// this descriptor, never by path again (nothing can be swapped between a check and a use); a
// file there is opened for I/O only once its pinned inode is known to be a regular file.
// What ucpfs writes there: `data.mdb`, only ever replaced whole by renaming a file ucpfs created
// itself over it, and `lock` (the builders' flock). Nothing there is deleted or written in place.
class IndexDir {
 public:
  // Errors: kNotFound when absent; kInvalidArgument when a symlink or not a directory; kIo.
  static Result<IndexDir> Open(const std::string& path) {
    IndexDir dir;
    dir.path_ = path;
    dir.fd_ = Fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (dir.fd_.get() >= 0) return dir;
    const int e = errno;
    struct stat st;
    if (e == ENOENT) return Status(StatusCode::kNotFound, "no index at " + path, e);
    if ((e == ELOOP || e == ENOTDIR) && ::lstat(path.c_str(), &st) == 0) {
      if (S_ISLNK(st.st_mode)) {
        return InvalidArgumentError("index directory " + path +
                                    " is a symbolic link: not followed (remove it, or give --index-dir)");
      }
      return InvalidArgumentError("index directory " + path + " is not a directory");
    }
    return IoError("opening index directory " + path + ": " + std::strerror(e), e);
  }

  // Open, creating the directory (and its parents) first when it is absent. A symlink in its
  // place, dangling or not, is refused by Open, never created through.
  static Result<IndexDir> OpenOrCreate(const std::string& path) {
    Result<IndexDir> dir = Open(path);
    if (dir.ok() || dir.error().code() != StatusCode::kNotFound) return dir;
    std::error_code ec;
    fs::create_directories(path, ec);
    if (ec) return IoError("creating index directory " + path + ": " + ec.message(), ec.value());
    return Open(path);
  }

  const std::string& path() const { return path_; }
  std::string PathOf(const char* name) const { return path_ + "/" + name; }

  // Opens regular file `name` for I/O without following a symlink and without opening anything
  // else: the entry is first pinned with O_PATH|O_NOFOLLOW (which opens no FIFO or device: a
  // device's open can have effects of its own) and checked with fstat, and only then is that very
  // inode opened, through its /proc/self/fd link. With O_CREAT a missing file is created O_EXCL
  // (which also fails on a symlink, dangling or not). Errors: kNotFound; kInvalidArgument (a
  // symlink, or not a regular file); kIo.
  Result<Fd> OpenFile(const char* name, int flags, struct stat* st) const {
    if ((flags & O_CREAT) != 0) {
      Fd created(::openat(fd_.get(), name, flags | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
      if (created.get() >= 0) return StatRegular(std::move(created), name, st);
      if (errno != EEXIST) return IoError("creating " + PathOf(name) + ": " + std::strerror(errno), errno);
      flags &= ~O_CREAT;
    }
    Fd pinned(::openat(fd_.get(), name, O_PATH | O_NOFOLLOW | O_CLOEXEC));
    if (pinned.get() < 0) {
      const int e = errno;
      if (e == ENOENT) return Status(StatusCode::kNotFound, "no " + PathOf(name), e);
      return IoError("opening " + PathOf(name) + ": " + std::strerror(e), e);
    }
    UCPFS_ASSIGN_OR_RETURN(pinned, StatRegular(std::move(pinned), name, st));
    Fd fd(::open(pinned.ProcPath().c_str(), flags | O_CLOEXEC));
    if (fd.get() < 0) return IoError("opening " + PathOf(name) + ": " + std::strerror(errno), errno);
    return StatRegular(std::move(fd), name, st);
  }

  // Absent, or a regular file (checked before `name` is replaced).
  Status CheckReplaceable(const char* name) const {
    struct stat st;
    if (::fstatat(fd_.get(), name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) return Status::Ok();
      return IoError("stat " + PathOf(name) + ": " + std::strerror(errno), errno);
    }
    if (!S_ISREG(st.st_mode)) return InvalidArgumentError(NotFollowed("index file", PathOf(name), st));
    return Status::Ok();
  }

  // A new, empty file only ucpfs knows: an unnamed O_TMPFILE inode where the filesystem has
  // them, else a fresh name created with O_EXCL (*tmp_name set; the caller removes it on failure).
  Result<Fd> CreateTemp(std::string* tmp_name) const {
    tmp_name->clear();
    Fd fd(::openat(fd_.get(), ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0644));
    if (fd.get() >= 0) return fd;
    if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL && errno != ENOENT) {
      return IoError("creating a file in " + path_ + ": " + std::strerror(errno), errno);
    }
    *tmp_name = TempName();
    fd = Fd(::openat(fd_.get(), tmp_name->c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
    if (fd.get() < 0) {
      const int e = errno;
      tmp_name->clear();
      return IoError("creating a file in " + path_ + ": " + std::strerror(e), e);
    }
    return fd;
  }

  // Makes the file of CreateTemp `name` (replacing it atomically), then syncs the directory.
  Status Publish(const Fd& fd, std::string* tmp_name, const char* name) const {
    UCPFS_RETURN_IF_ERROR(CheckReplaceable(name));
    if (tmp_name->empty()) {
      *tmp_name = TempName();
      if (::linkat(AT_FDCWD, fd.ProcPath().c_str(), fd_.get(), tmp_name->c_str(), AT_SYMLINK_FOLLOW) != 0) {
        const int e = errno;
        tmp_name->clear();
        return IoError("linking the new index into " + path_ + ": " + std::strerror(e), e);
      }
    }
    if (::renameat(fd_.get(), tmp_name->c_str(), fd_.get(), name) != 0) {
      return IoError("renaming the new index to " + PathOf(name) + ": " + std::strerror(errno), errno);
    }
    tmp_name->clear();
    if (::fsync(fd_.get()) != 0 && errno != EINVAL) {
      return IoError("syncing " + path_ + ": " + std::strerror(errno), errno);
    }
    return Status::Ok();
  }

  // Removes a temporary name ucpfs created (never anything else).
  void RemoveTemp(std::string* tmp_name) const {
    if (!tmp_name->empty()) ::unlinkat(fd_.get(), tmp_name->c_str(), 0);
    tmp_name->clear();
  }

 private:
  Result<Fd> StatRegular(Fd fd, const char* name, struct stat* st) const {
    if (::fstat(fd.get(), st) != 0) return IoError("stat " + PathOf(name) + ": " + std::strerror(errno), errno);
    if (!S_ISREG(st->st_mode)) return InvalidArgumentError(NotFollowed("index file", PathOf(name), *st));
    return fd;
  }

  std::string TempName() const {
    static std::atomic<uint64_t> counter{0};
    return "data.mdb.tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1)) + "-" +
           Hex16(static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  }

  std::string path_;
  Fd fd_;
};

// An LMDB environment over the single file `file` (MDB_NOSUBDIR, through its /proc/self/fd
// link, so LMDB reopens that very inode) with MDB_NOLOCK: no lock.mdb is ever created or
// opened. Readers need no lock table because a published data.mdb is never written again.
Result<EnvPtr> OpenEnvOnFile(const Fd& file, const std::string& what, unsigned flags) {
  MDB_env* raw = nullptr;
  int rc = mdb_env_create(&raw);
  if (rc != 0) return LmdbError(rc, "mdb_env_create");
  EnvPtr env(raw);
  if ((rc = mdb_env_set_maxdbs(env.get(), kMaxDbs)) != 0) return LmdbError(rc, what);
  if ((rc = mdb_env_set_mapsize(env.get(), kMapSizeBytes)) != 0) return LmdbError(rc, what);
  rc = mdb_env_open(env.get(), file.ProcPath().c_str(), flags | MDB_NOSUBDIR | MDB_NOLOCK | MDB_NOTLS, 0644);
  if (rc != 0) return LmdbError(rc, "opening index " + what);
  return env;
}

std::string_view View(const MDB_val& v) {
  return std::string_view(static_cast<const char*>(v.mv_data), v.mv_size);
}

MDB_val Val(const std::string& s) {
  MDB_val v;
  v.mv_size = s.size();
  v.mv_data = const_cast<char*>(s.data());
  return v;
}

Status DataLoss(const std::string& dir, const std::string& msg) {
  return Status(StatusCode::kDataLoss, "index " + dir + ": " + msg);
}

// Reads one meta value; a missing key is data loss (meta is written whole, in one txn).
Result<std::string_view> GetMeta(MDB_txn* txn, MDB_dbi dbi, const std::string& dir,
                                 const char* name) {
  std::string key = name;
  MDB_val k = Val(key);
  MDB_val v;
  int rc = mdb_get(txn, dbi, &k, &v);
  if (rc == MDB_NOTFOUND) return DataLoss(dir, std::string("meta has no ") + name);
  if (rc != 0) return LmdbError(rc, "index " + dir + ": reading meta " + name);
  return View(v);
}

Result<uint64_t> GetMetaU64(MDB_txn* txn, MDB_dbi dbi, const std::string& dir, const char* name) {
  UCPFS_ASSIGN_OR_RETURN(std::string_view raw, GetMeta(txn, dbi, dir, name));
  uint64_t v = 0;
  if (!codec::DecodeU64Le(raw, &v)) {
    return DataLoss(dir, std::string("meta ") + name + " has " + std::to_string(raw.size()) +
                             " bytes, expected 8");
  }
  return v;
}

Status CheckFileIds(const Checkpoint& cp, const std::string& where, StatusCode code) {
  const uint64_t n_files = cp.files.size();
  for (size_t i = 0; i < cp.items.size(); ++i) {
    const Item& item = cp.items[i];
    if (item.kind == ItemKind::kBytes) {
      if (item.file_id >= n_files) {
        return Status(code, where + ": item " + std::to_string(i) + " (" + item.key + ") file_id " +
                                std::to_string(item.file_id) + " out of range (" +
                                std::to_string(n_files) + " files)");
      }
      continue;
    }
    for (size_t j = 0; j < item.layout.fragments.size(); ++j) {
      const slice::Fragment& f = item.layout.fragments[j];
      if (f.file_id >= n_files) {
        return Status(code, where + ": item " + std::to_string(i) + " (" + item.key +
                                ") fragment " + std::to_string(j) + " file_id " +
                                std::to_string(f.file_id) + " out of range (" +
                                std::to_string(n_files) + " files)");
      }
      for (const slice::MeanPart& m : f.mean_with) {
        if (m.file_id >= n_files) {
          return Status(code, where + ": item " + std::to_string(i) + " (" + item.key + ") fragment " +
                                  std::to_string(j) + " averaged copy file_id " + std::to_string(m.file_id) +
                                  " out of range (" + std::to_string(n_files) + " files)");
        }
      }
    }
  }
  return Status::Ok();
}

// Walks a table whose keys must be 0, 1, 2, ... (big-endian, `key_bytes` wide) and hands each
// value to `decode`.
template <typename Decode>
Status ReadTable(MDB_txn* txn, MDB_dbi dbi, const std::string& dir, const char* table,
                 uint64_t expected_count, size_t key_bytes, Decode&& decode) {
  MDB_stat stat;
  int rc = mdb_stat(txn, dbi, &stat);
  if (rc != 0) return LmdbError(rc, "index " + dir + ": stat " + table);
  if (stat.ms_entries != expected_count) {
    return DataLoss(dir, std::string(table) + " holds " + std::to_string(stat.ms_entries) +
                             " records, meta says " + std::to_string(expected_count));
  }
  Cursor cursor;
  rc = mdb_cursor_open(txn, dbi, cursor.out());
  if (rc != 0) return LmdbError(rc, "index " + dir + ": cursor on " + table);
  MDB_val k, v;
  uint64_t n = 0;
  for (rc = mdb_cursor_get(cursor.get(), &k, &v, MDB_FIRST); rc == 0;
       rc = mdb_cursor_get(cursor.get(), &k, &v, MDB_NEXT), ++n) {
    uint64_t id = 0;
    bool key_ok = false;
    if (key_bytes == 4) {
      uint32_t id32 = 0;
      key_ok = codec::DecodeU32Be(View(k), &id32);
      id = id32;
    } else {
      key_ok = codec::DecodeU64Be(View(k), &id);
    }
    if (!key_ok || id != n) {
      return DataLoss(dir, std::string(table) + " record " + std::to_string(n) +
                               " has an unexpected key");
    }
    Status s = decode(n, View(v));
    if (!s.ok()) {
      return DataLoss(dir, "index record " + std::to_string(n) + " (" + table +
                               ") undecodable: " + s.message());
    }
  }
  if (rc != MDB_NOTFOUND) return LmdbError(rc, "index " + dir + ": reading " + table);
  if (n != expected_count) {
    return DataLoss(dir, std::string(table) + ": read " + std::to_string(n) + " records, expected " +
                             std::to_string(expected_count));
  }
  return Status::Ok();
}

// An exclusive flock on index_dir/lock, held while an index is (re)built.
class BuildLock {
 public:
  Status Acquire(const IndexDir& dir) {
    struct stat st;
    UCPFS_ASSIGN_OR_RETURN(fd_, dir.OpenFile("lock", O_RDWR | O_CREAT, &st));
    while (::flock(fd_.get(), LOCK_EX) != 0) {
      if (errno == EINTR) continue;
      return IoError("locking " + dir.PathOf("lock") + ": " + std::strerror(errno), errno);
    }
    return Status::Ok();
  }

 private:
  Fd fd_;  // closing the descriptor drops the flock
};

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

namespace {

// Writes the catalog into `file` (new and empty), in one transaction.
Status WriteCatalog(const Fd& file, const std::string& index_dir, const Checkpoint& checkpoint,
                    uint64_t fingerprint) {
  UCPFS_ASSIGN_OR_RETURN(EnvPtr env, OpenEnvOnFile(file, index_dir, 0));
  Txn txn;
  int rc = mdb_txn_begin(env.get(), nullptr, 0, txn.out());
  if (rc != 0) return LmdbError(rc, "index " + index_dir + ": begin write");
  MDB_dbi meta, files, items;
  if ((rc = mdb_dbi_open(txn.get(), kMetaDb, MDB_CREATE, &meta)) != 0 ||
      (rc = mdb_dbi_open(txn.get(), kFilesDb, MDB_CREATE, &files)) != 0 ||
      (rc = mdb_dbi_open(txn.get(), kItemsDb, MDB_CREATE, &items)) != 0) {
    return LmdbError(rc, "index " + index_dir + ": opening tables");
  }
  auto put = [&](MDB_dbi dbi, const std::string& key, const std::string& value, unsigned flags,
                 const char* what) -> Status {
    MDB_val k = Val(key);
    MDB_val v = Val(value);
    int put_rc = mdb_put(txn.get(), dbi, &k, &v, flags);
    if (put_rc != 0) return LmdbError(put_rc, "index " + index_dir + ": writing " + what);
    return Status::Ok();
  };
  // Keys ascend, so MDB_APPEND fills pages without searching.
  for (size_t i = 0; i < checkpoint.files.size(); ++i) {
    UCPFS_RETURN_IF_ERROR(put(files, codec::EncodeU32Be(static_cast<uint32_t>(i)),
                              codec::EncodeSourceFile(checkpoint.files[i]), MDB_APPEND, "files"));
  }
  for (size_t i = 0; i < checkpoint.items.size(); ++i) {
    UCPFS_RETURN_IF_ERROR(put(items, codec::EncodeU64Be(i), codec::EncodeItem(checkpoint.items[i]),
                              MDB_APPEND, "items"));
  }
  UCPFS_RETURN_IF_ERROR(put(meta, "format", checkpoint.format, 0, "meta"));
  UCPFS_RETURN_IF_ERROR(put(meta, "flavor", checkpoint.flavor, 0, "meta"));
  UCPFS_RETURN_IF_ERROR(put(meta, "facts", EncodeSourceFacts(checkpoint.facts), 0, "meta"));
  UCPFS_RETURN_IF_ERROR(put(meta, "n_files", codec::EncodeU64Le(checkpoint.files.size()), 0, "meta"));
  UCPFS_RETURN_IF_ERROR(put(meta, "n_items", codec::EncodeU64Le(checkpoint.items.size()), 0, "meta"));
  UCPFS_RETURN_IF_ERROR(put(meta, "fingerprint", codec::EncodeU64Le(fingerprint), 0, "meta"));
  UCPFS_RETURN_IF_ERROR(
      put(meta, "schema_version", codec::EncodeU32Le(kCatalogSchemaVersion), 0, "meta"));
  rc = txn.Commit();  // LMDB syncs the file before it returns
  if (rc != 0) return LmdbError(rc, "index " + index_dir + ": commit");
  return Status::Ok();
}

// Builds the catalog in a file of ucpfs's own and renames it over data.mdb: readers see the old
// catalog or the new one, and the old file (maybe a hard link to something else) is never
// written.
Status StoreIn(const IndexDir& dir, const Checkpoint& checkpoint, uint64_t fingerprint) {
  std::string tmp_name;
  UCPFS_ASSIGN_OR_RETURN(Fd file, dir.CreateTemp(&tmp_name));
  Status status = WriteCatalog(file, dir.path(), checkpoint, fingerprint);
  if (status.ok()) status = dir.Publish(file, &tmp_name, "data.mdb");
  dir.RemoveTemp(&tmp_name);
  return status;
}

Status CheckStorable(const std::string& index_dir, const Checkpoint& checkpoint) {
  if (checkpoint.files.size() > UINT32_MAX) {
    return InvalidArgumentError("index " + index_dir + ": too many files (" +
                                std::to_string(checkpoint.files.size()) + ")");
  }
  // An index that can never load would be rebuilt on every mount: refuse it up front.
  if (EncodeSourceFacts(checkpoint.facts).size() > kMaxSourceFactsBytes) {
    return InvalidArgumentError("index " + index_dir + ": the scanner's facts are too large to store");
  }
  return CheckFileIds(checkpoint, "index " + index_dir, StatusCode::kInvalidArgument);
}

// Reads the catalog in `file` in this process. LMDB trusts its pages: a crafted data.mdb can
// make it read outside the map (SIGSEGV, SIGBUS), so this runs only in ReadCatalogIsolated's
// child.
Result<Checkpoint> ReadCatalog(const Fd& file, const std::string& index_dir, uint64_t* fingerprint) {
  UCPFS_ASSIGN_OR_RETURN(EnvPtr env, OpenEnvOnFile(file, index_dir, MDB_RDONLY));

  Txn txn;
  int rc = mdb_txn_begin(env.get(), nullptr, MDB_RDONLY, txn.out());
  if (rc != 0) return LmdbError(rc, "index " + index_dir + ": begin read");
  MDB_dbi meta;
  rc = mdb_dbi_open(txn.get(), kMetaDb, 0, &meta);
  // data.mdb exists (an empty one never gets here): without a catalog it is damaged.
  if (rc == MDB_NOTFOUND) return DataLoss(index_dir, "data.mdb holds no catalog");
  if (rc != 0) return LmdbError(rc, "index " + index_dir + ": opening meta");

  UCPFS_ASSIGN_OR_RETURN(std::string_view version_raw, GetMeta(txn.get(), meta, index_dir, "schema_version"));
  uint32_t version = 0;
  if (!codec::DecodeU32Le(version_raw, &version)) return DataLoss(index_dir, "meta schema_version undecodable");
  if (version != kCatalogSchemaVersion) {
    return DataLoss(index_dir, "schema version " + std::to_string(version) + ", this ucpfs reads " +
                                   std::to_string(kCatalogSchemaVersion));
  }
  UCPFS_ASSIGN_OR_RETURN(uint64_t stored_fingerprint, GetMetaU64(txn.get(), meta, index_dir, "fingerprint"));
  UCPFS_ASSIGN_OR_RETURN(uint64_t n_files, GetMetaU64(txn.get(), meta, index_dir, "n_files"));
  UCPFS_ASSIGN_OR_RETURN(uint64_t n_items, GetMetaU64(txn.get(), meta, index_dir, "n_items"));
  Checkpoint cp;
  {
    UCPFS_ASSIGN_OR_RETURN(std::string_view format, GetMeta(txn.get(), meta, index_dir, "format"));
    UCPFS_ASSIGN_OR_RETURN(std::string_view flavor, GetMeta(txn.get(), meta, index_dir, "flavor"));
    UCPFS_ASSIGN_OR_RETURN(std::string_view facts, GetMeta(txn.get(), meta, index_dir, "facts"));
    Result<SourceFacts> decoded = DecodeSourceFacts(facts);
    if (!decoded.ok()) return DataLoss(index_dir, "meta facts: " + decoded.error().message());
    cp.format = std::string(format);
    cp.flavor = std::string(flavor);
    cp.facts = std::move(*decoded);
  }

  MDB_dbi files, items;
  if ((rc = mdb_dbi_open(txn.get(), kFilesDb, 0, &files)) != 0 ||
      (rc = mdb_dbi_open(txn.get(), kItemsDb, 0, &items)) != 0) {
    if (rc == MDB_NOTFOUND) return DataLoss(index_dir, "meta present but a table is missing");
    return LmdbError(rc, "index " + index_dir + ": opening tables");
  }
  if (n_files > UINT32_MAX) return DataLoss(index_dir, "meta n_files " + std::to_string(n_files));

  // Counts are checked against the tables' own entry counts before these reserves.
  UCPFS_RETURN_IF_ERROR(ReadTable(txn.get(), files, index_dir, kFilesDb, n_files, 4,
                                  [&](uint64_t, std::string_view rec) -> Status {
                                    if (cp.files.empty()) cp.files.reserve(n_files);
                                    Result<SourceFile> f = codec::DecodeSourceFile(rec);
                                    if (!f.ok()) return f.error();
                                    cp.files.push_back(std::move(f).value());
                                    return Status::Ok();
                                  }));
  UCPFS_RETURN_IF_ERROR(ReadTable(txn.get(), items, index_dir, kItemsDb, n_items, 8,
                                  [&](uint64_t, std::string_view rec) -> Status {
                                    if (cp.items.empty()) cp.items.reserve(n_items);
                                    Result<Item> item = codec::DecodeItem(rec);
                                    if (!item.ok()) return item.error();
                                    cp.items.push_back(std::move(item).value());
                                    return Status::Ok();
                                  }));
  UCPFS_RETURN_IF_ERROR(CheckFileIds(cp, "index " + index_dir, StatusCode::kDataLoss));
  if (fingerprint != nullptr) *fingerprint = stored_fingerprint;
  return cp;
}

// The child's answer, as frames (u32 LE length, bytes): "ok", fingerprint (u64 LE), format,
// flavor, facts (EncodeSourceFacts), n_files (u64 LE), one codec::EncodeSourceFile frame per file, n_items (u64 LE), one
// codec::EncodeItem frame per item; or "error", code (u32 LE), errno (u32 LE), message.
class FrameWriter {
 public:
  void Add(std::string_view bytes) {
    out_ += codec::EncodeU32Le(static_cast<uint32_t>(bytes.size()));
    out_.append(bytes);
  }
  const std::string& bytes() const { return out_; }

 private:
  std::string out_;
};

class FrameReader {
 public:
  explicit FrameReader(std::string_view in) : in_(in) {}
  bool Next(std::string_view* frame) {
    uint32_t n = 0;
    if (in_.size() < 4 || !codec::DecodeU32Le(in_.substr(0, 4), &n) || in_.size() - 4 < n) return false;
    *frame = in_.substr(4, n);
    in_.remove_prefix(4 + size_t{n});
    return true;
  }
  bool NextU64(uint64_t* v) {
    std::string_view f;
    return Next(&f) && codec::DecodeU64Le(f, v);
  }
  size_t frames_left_at_most() const { return in_.size() / 4; }
  bool done() const { return in_.empty(); }

 private:
  std::string_view in_;
};

std::string EncodeAnswer(const Result<Checkpoint>& r, uint64_t fingerprint) {
  FrameWriter w;
  if (!r.ok()) {
    w.Add("error");
    w.Add(codec::EncodeU32Le(static_cast<uint32_t>(r.error().code())));
    w.Add(codec::EncodeU32Le(static_cast<uint32_t>(r.error().sys_errno())));
    w.Add(r.error().message());
    return w.bytes();
  }
  w.Add("ok");
  w.Add(codec::EncodeU64Le(fingerprint));
  w.Add(r->format);
  w.Add(r->flavor);
  w.Add(EncodeSourceFacts(r->facts));
  w.Add(codec::EncodeU64Le(r->files.size()));
  for (const SourceFile& f : r->files) w.Add(codec::EncodeSourceFile(f));
  w.Add(codec::EncodeU64Le(r->items.size()));
  for (const Item& item : r->items) w.Add(codec::EncodeItem(item));
  return w.bytes();
}

Result<Checkpoint> DecodeAnswer(std::string_view answer, const std::string& index_dir, uint64_t* fingerprint) {
  const Status garbled = DataLoss(index_dir, "the index reader's answer is garbled");
  FrameReader r(answer);
  std::string_view kind;
  if (!r.Next(&kind)) return garbled;
  if (kind == "error") {
    std::string_view code_raw, errno_raw, message;
    uint32_t code = 0, sys_errno = 0;
    if (!r.Next(&code_raw) || !r.Next(&errno_raw) || !r.Next(&message) || !codec::DecodeU32Le(code_raw, &code) ||
        !codec::DecodeU32Le(errno_raw, &sys_errno) || code > static_cast<uint32_t>(StatusCode::kInternal) ||
        code == 0) {
      return garbled;
    }
    return Status(static_cast<StatusCode>(code), std::string(message), static_cast<int>(sys_errno));
  }
  Checkpoint cp;
  std::string_view format, flavor, info, rec;
  uint64_t stored = 0, n = 0;
  if (kind != "ok" || !r.NextU64(&stored) || !r.Next(&format) || !r.Next(&flavor) || !r.Next(&info) ||
      !r.NextU64(&n) || n > r.frames_left_at_most()) {
    return garbled;
  }
  Result<SourceFacts> facts = DecodeSourceFacts(info);
  if (!facts.ok()) return DataLoss(index_dir, "meta facts: " + facts.error().message());
  cp.format = std::string(format);
  cp.flavor = std::string(flavor);
  cp.facts = std::move(*facts);
  cp.files.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    if (!r.Next(&rec)) return garbled;
    UCPFS_ASSIGN_OR_RETURN(SourceFile f, codec::DecodeSourceFile(rec));
    cp.files.push_back(std::move(f));
  }
  if (!r.NextU64(&n) || n > r.frames_left_at_most()) return garbled;
  cp.items.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    if (!r.Next(&rec)) return garbled;
    UCPFS_ASSIGN_OR_RETURN(Item item, codec::DecodeItem(rec));
    cp.items.push_back(std::move(item));
  }
  if (!r.done()) return garbled;
  UCPFS_RETURN_IF_ERROR(CheckFileIds(cp, "index " + index_dir, StatusCode::kDataLoss));
  if (fingerprint != nullptr) *fingerprint = stored;
  return cp;
}

// Reads the catalog in a forked child that hands it back through a pipe in the bounds-checked
// encoding above, so a crafted data.mdb that crashes or hangs LMDB is a corrupt index (rebuilt,
// or refused read-only), never a crashed or hung ucpfs. The child gets `timeout` to finish.
Result<Checkpoint> ReadCatalogIsolated(const Fd& file, const std::string& index_dir, uint64_t file_bytes,
                                       uint64_t* fingerprint) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return IoError("index " + index_dir + ": pipe: " + std::strerror(errno), errno);
  Fd read_end(fds[0]), write_end(fds[1]);
  const pid_t pid = ::fork();
  if (pid < 0) return IoError("index " + index_dir + ": fork: " + std::strerror(errno), errno);
  if (pid == 0) {
    uint64_t stored = 0;
    const Result<Checkpoint> r = ReadCatalog(file, index_dir, &stored);
    const std::string answer = EncodeAnswer(r, stored);
    size_t done = 0;
    while (done < answer.size()) {
      const ssize_t n = ::write(write_end.get(), answer.data() + done, answer.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) ::_exit(3);
      done += static_cast<size_t>(n);
    }
    ::_exit(0);
  }
  write_end = Fd();
  // A generous bound: 30 s, plus 1 s per 16 MiB of index.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30 + (file_bytes >> 24));
  std::string answer;
  std::vector<char> buf(1 << 16);
  bool timed_out = false;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    struct pollfd pfd = {read_end.get(), POLLIN, 0};
    const int ready = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (ready < 0 && errno != EINTR) break;
    if (ready <= 0) continue;
    const ssize_t n = ::read(read_end.get(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    answer.append(buf.data(), static_cast<size_t>(n));
  }
  if (timed_out) ::kill(pid, SIGKILL);
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) return DataLoss(index_dir, "reading data.mdb did not finish in time (corrupt?)");
  if (WIFSIGNALED(wstatus)) {
    return DataLoss(index_dir, std::string("data.mdb is corrupt (reading it crashed: ") +
                                   ::strsignal(WTERMSIG(wstatus)) + ")");
  }
  if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
    return DataLoss(index_dir, "the index reader failed (exit status " + std::to_string(wstatus) + ")");
  }
  return DecodeAnswer(answer, index_dir, fingerprint);
}

Result<Checkpoint> LoadFrom(const IndexDir& dir, uint64_t* fingerprint) {
  const std::string& index_dir = dir.path();
  struct stat st;
  Result<Fd> file = dir.OpenFile("data.mdb", O_RDONLY, &st);
  if (!file.ok()) {
    if (file.error().code() == StatusCode::kNotFound) return NotFoundError("no index in " + index_dir);
    return file.error();
  }
  // LMDB treats an empty data file as a new environment and would try to initialize it.
  if (st.st_size == 0) return DataLoss(index_dir, "data.mdb is empty");
  return ReadCatalogIsolated(*file, index_dir, static_cast<uint64_t>(st.st_size), fingerprint);
}

}  // namespace

Status StoreCheckpoint(const std::string& index_dir, const Checkpoint& checkpoint,
                       uint64_t fingerprint) {
  UCPFS_RETURN_IF_ERROR(CheckStorable(index_dir, checkpoint));
  UCPFS_ASSIGN_OR_RETURN(IndexDir dir, IndexDir::OpenOrCreate(index_dir));
  return StoreIn(dir, checkpoint, fingerprint);
}

Result<Checkpoint> LoadCheckpoint(const std::string& index_dir, bool /*read_only*/,
                                  uint64_t* fingerprint) {
  Result<IndexDir> dir = IndexDir::Open(index_dir);
  if (!dir.ok()) {
    if (dir.error().code() == StatusCode::kNotFound) return NotFoundError("no index in " + index_dir);
    return dir.error();
  }
  return LoadFrom(*dir, fingerprint);
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
    Result<Checkpoint> loaded = LoadFrom(dir, &stored);
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
  Result<Checkpoint> loaded = LoadFrom(dir, &stored);
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
  UCPFS_RETURN_IF_ERROR(StoreIn(dir, scanned.value(), fingerprint));
  out.checkpoint = std::move(scanned).value();
  out.elapsed_s = SecondsSince(t0);
  return out;
}

}  // namespace ucpfs::index
