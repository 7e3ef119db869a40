// See catalog_file.h. LMDB trusts its pages, so reading runs in a forked child whose answer comes
// back bounds-checked; a published data.mdb is never written again, so readers need no lock
// table (no lock.mdb is ever created or opened).
//
// Lifetimes: every environment is opened, used and closed inside one function; MDB_val data
// points into the map and is copied (decoded) before its transaction ends.
#include "index/catalog_file.h"

#include <fcntl.h>
#include <lmdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <string_view>
#include <vector>

#include "index/catalog.h"
#include "index/catalog_codec.h"
#include "index/source_facts.h"

namespace ucpfs::index {
namespace {

// LMDB's map is virtual address space, not disk: a generous size costs nothing.
constexpr size_t kMapSizeBytes = size_t{64} << 30;
constexpr unsigned kMaxDbs = 4;
constexpr char kMetaDb[] = "meta";
constexpr char kFilesDb[] = "files";
constexpr char kItemsDb[] = "items";

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

}  // namespace

Status WriteCatalogFile(const IndexDir& dir, const Checkpoint& checkpoint, uint64_t fingerprint) {
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

namespace {

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

}  // namespace

Result<Checkpoint> ReadCatalogFile(const IndexDir& dir, uint64_t* fingerprint) {
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


}  // namespace ucpfs::index
