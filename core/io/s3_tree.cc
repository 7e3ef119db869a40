// See s3_tree.h.
#include "core/io/s3_tree.h"
#include "core/io/s3_readahead.h"

#include <time.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace ucpfs {

uint64_t ETagInode(std::string_view etag) { return XXH64(etag.data(), etag.size(), 0); }

Result<int64_t> ParseS3TimeNs(std::string_view text) {
  const std::string s(text);
  struct tm tm {};
  const char* end = nullptr;
  if (s.find(',') == std::string::npos) {  // ISO 8601 has no comma, an HTTP date always one
    end = ::strptime(s.c_str(), "%Y-%m-%dT%H:%M:%S", &tm);
  } else {
    end = ::strptime(s.c_str(), "%a, %d %b %Y %H:%M:%S", &tm);
  }
  if (end == nullptr) return CorruptError("not an S3 date: \"" + s.substr(0, 64) + "\"");
  const time_t secs = ::timegm(&tm);
  return static_cast<int64_t>(secs) * 1000000000;
}

namespace {

Status BadPath(const std::string& root, std::string_view rel) {
  return InvalidArgumentError(root + ": not a clean relative path: \"" + std::string(rel) + "\"");
}

// The identity of an object as a listing or a HEAD reports it.
FileIdentity IdentityOf(uint64_t n_bytes, const std::string& etag, const std::string& last_modified) {
  FileIdentity id;
  id.n_bytes = n_bytes;
  id.ino = ETagInode(etag);
  Result<int64_t> t = ParseS3TimeNs(last_modified);
  id.mtime_ns = t.ok() ? *t : 0;  // a store without dates: the ETag still tells versions apart
  id.ctime_ns = id.mtime_ns;
  return id;
}

TreeEntry FileEntry(std::string name, const FileIdentity& id) {
  TreeEntry e;
  e.name = std::move(name);
  e.kind = EntryKind::kFile;
  e.identity = id;
  e.mode = 0444;
  return e;
}

TreeEntry DirEntry(std::string name) {
  TreeEntry e;
  e.name = std::move(name);
  e.kind = EntryKind::kDirectory;
  e.mode = 0555;
  return e;
}

int64_t SteadyMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool CleanComponent(std::string_view name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string_view::npos &&
         name.find('\0') == std::string_view::npos;
}

std::string LastComponent(std::string_view rel) {
  const size_t slash = rel.rfind('/');
  return std::string(slash == std::string_view::npos ? rel : rel.substr(slash + 1));
}

// A lazy file of an S3Tree: the object is looked up on first read (its remembered ETag, else a
// HEAD), checked against the indexed identity, then read with If-Match on that ETag.
class S3LazySource final : public LazySource {
 public:
  S3LazySource(std::shared_ptr<S3Tree::Shared> shared, std::string bucket, std::string key, FileIdentity expected,
               std::shared_ptr<IoCounters> counters)
      : shared_(std::move(shared)),
        bucket_(std::move(bucket)),
        key_(std::move(key)),
        name_(s3::S3Name(bucket_, key_)),
        expected_(expected),
        counters_(std::move(counters)) {}

  uint64_t Size() const override { return expected_.n_bytes; }
  const std::string& Name() const override { return name_; }
  Status Open() const override { return Get().status(); }

  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override {
    Result<std::shared_ptr<s3::S3ObjectSource>> obj = Get();
    if (!obj.ok()) return Count(1, 0, obj.error());
    if (byte_offset <= expected_.n_bytes && out.size() <= expected_.n_bytes - byte_offset &&
        ahead_->TryRead(byte_offset, out)) {
      return Count(1, out.size(), Status::Ok());
    }
    ahead_->NoteRead(byte_offset, out.size());
    return Count(1, out.size(), (*obj)->ReadAt(byte_offset, out));
  }

  Status ReadPieces(std::span<const ReadPiece> pieces, size_t* failed_index = nullptr) const override {
    Result<std::shared_ptr<s3::S3ObjectSource>> obj = Get();
    if (!obj.ok()) {
      if (failed_index != nullptr) *failed_index = 0;
      return Count(pieces.size(), 0, obj.error());
    }
    uint64_t n_bytes = 0;
    std::vector<ReadPiece> rest;  // what the read-ahead does not hold: GET now, as one batch
    std::vector<size_t> rest_index;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const ReadPiece& p = pieces[i];
      n_bytes += p.out.size();
      if (p.byte_offset <= expected_.n_bytes && p.out.size() <= expected_.n_bytes - p.byte_offset &&
          ahead_->TryRead(p.byte_offset, p.out)) {
        continue;
      }
      ahead_->NoteRead(p.byte_offset, p.out.size());
      rest.push_back(p);
      rest_index.push_back(i);
    }
    size_t failed = 0;
    Status st = rest.empty() ? Status::Ok() : (*obj)->ReadPieces(rest, &failed);
    if (!st.ok() && failed_index != nullptr) *failed_index = failed < rest_index.size() ? rest_index[failed] : 0;
    return Count(pieces.size(), n_bytes, st);
  }

  // The view's announcement of what it reads next: fetched ahead (s3_readahead.h).
  void Prefetch(uint64_t byte_offset, uint64_t n_bytes) const override {
    if (Get().ok()) ahead_->Hint(byte_offset, n_bytes);
  }

 private:
  Status Count(uint64_t n_reads, uint64_t n_bytes, Status st) const {
    if (counters_ != nullptr) {
      counters_->source_reads += n_reads;
      if (st.ok()) {
        counters_->source_bytes_read += n_bytes;
      } else {
        counters_->source_read_errors += 1;
      }
    }
    return st;
  }

  Result<std::shared_ptr<s3::S3ObjectSource>> Get() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (object_ != nullptr) return object_;
    std::string etag = shared_->Recall(key_);
    if (etag.empty() || ETagInode(etag) != expected_.ino) {
      // Not remembered, or remembered as another version: ask the store what is there now.
      Result<s3::ObjectInfo> head = shared_->client->Head(bucket_, key_);
      if (!head.ok()) {
        if (head.error().code() == StatusCode::kNotFound) {
          return Status(StatusCode::kDataLoss, name_ + ": the object no longer exists since it was indexed");
        }
        return head.error();
      }
      const FileIdentity now = IdentityOf(head->n_bytes, head->etag, head->last_modified);
      if (now.ino != expected_.ino || now.n_bytes != expected_.n_bytes) {
        return Status(StatusCode::kDataLoss, name_ + ": the object changed since it was indexed (ETag now " +
                                                 head->etag + ", size " + std::to_string(expected_.n_bytes) +
                                                 " -> " + std::to_string(now.n_bytes) + "); re-index it");
      }
      etag = head->etag;
      shared_->Remember(key_, etag);
    }
    object_ = s3::S3ObjectSource::FromRecorded(shared_->client, bucket_, key_, expected_.n_bytes, etag);
    ahead_ = std::make_shared<s3::S3ReadAhead>(object_);
    if (counters_ != nullptr) counters_->files_opened += 1;
    return object_;
  }

  std::shared_ptr<S3Tree::Shared> shared_;
  std::string bucket_;
  std::string key_;
  std::string name_;
  FileIdentity expected_;
  std::shared_ptr<IoCounters> counters_;
  mutable std::mutex mu_;
  mutable std::shared_ptr<s3::S3ObjectSource> object_;  // guarded by mu_
  mutable std::shared_ptr<s3::S3ReadAhead> ahead_;      // set with object_, then constant
};

}  // namespace

void S3Tree::Shared::Remember(const std::string& key, const std::string& etag) {
  if (etag.empty()) return;
  std::lock_guard<std::mutex> lock(mu);
  if (etags.size() >= kMaxRememberedETags) etags.clear();
  etags[key] = etag;
}

std::string S3Tree::Shared::Recall(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu);
  auto it = etags.find(key);
  return it == etags.end() ? std::string() : it->second;
}

void S3Tree::Shared::RememberListing(const std::string& dir_key, Listed l) {
  if (l.entries.empty()) return;
  std::lock_guard<std::mutex> lock(mu);
  if (listed.size() >= kMaxRememberedListings && listed.count(dir_key) == 0) listed.clear();
  listed[dir_key] = std::move(l);
}

void S3Tree::Shared::RememberNotEmpty(const std::string& dir_key, Listed l) {
  std::lock_guard<std::mutex> lock(mu);
  if (not_empty.size() >= kMaxRememberedListings && not_empty.count(dir_key) == 0) not_empty.clear();
  not_empty[dir_key] = std::move(l);
}

namespace {

// The listing of `dir_key` in `listed` while fresh for a client that has made `writes` writes.
const S3Tree::Shared::Listed* Fresh(const std::unordered_map<std::string, S3Tree::Shared::Listed>& listed,
                                    const std::string& dir_key, uint64_t writes) {
  auto it = listed.find(dir_key);
  if (it == listed.end() || it->second.writes != writes || SteadyMs() - it->second.at_ms >= kListingFreshMs) {
    return nullptr;
  }
  return &it->second;
}

}  // namespace

std::optional<std::vector<TreeEntry>> S3Tree::Shared::FreshListing(const std::string& dir_key) const {
  const uint64_t writes = client->writes();
  std::lock_guard<std::mutex> lock(mu);
  const Listed* l = Fresh(listed, dir_key, writes);
  if (l == nullptr) return std::nullopt;
  return l->entries;
}

bool S3Tree::Shared::FreshNotEmpty(const std::string& dir_key) const {
  const uint64_t writes = client->writes();
  std::lock_guard<std::mutex> lock(mu);
  return Fresh(listed, dir_key, writes) != nullptr || Fresh(not_empty, dir_key, writes) != nullptr;
}

std::optional<std::optional<TreeEntry>> S3Tree::Shared::FreshEntry(const std::string& dir_key,
                                                                   std::string_view name) const {
  const uint64_t writes = client->writes();
  std::lock_guard<std::mutex> lock(mu);
  const Listed* l = Fresh(listed, dir_key, writes);
  if (l == nullptr) return std::nullopt;
  auto it = std::lower_bound(l->entries.begin(), l->entries.end(), name,
                             [](const TreeEntry& e, std::string_view n) { return e.name < n; });
  if (it == l->entries.end() || it->name != name) return std::optional<TreeEntry>();
  return std::optional<TreeEntry>(*it);
}

S3Tree::S3Tree(std::shared_ptr<Shared> shared, std::string bucket, std::string prefix)
    : shared_(std::move(shared)), bucket_(std::move(bucket)), prefix_(std::move(prefix)) {
  root_ = s3::S3Name(bucket_, prefix_);
  while (root_.size() > 5 && root_.back() == '/') root_.pop_back();  // "s3://b/" -> "s3://b"
}

Result<std::shared_ptr<const S3Tree>> S3Tree::Make(std::shared_ptr<s3::Client> client, const std::string& url) {
  UCPFS_ASSIGN_OR_RETURN(s3::BucketKey bk, s3::ParseS3Url(url));
  std::string prefix = bk.key;
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  if (!SafeTreePath(prefix)) return InvalidArgumentError(url + ": the prefix is not a clean relative path");
  auto shared = std::make_shared<Shared>();
  shared->client = std::move(client);
  return std::make_shared<const S3Tree>(std::move(shared), bk.bucket, std::move(prefix));
}

Result<std::shared_ptr<const S3Tree>> S3Tree::FromEnvironment(const std::string& url,
                                                              const s3::Overrides& overrides) {
  UCPFS_ASSIGN_OR_RETURN(s3::BucketKey bk, s3::ParseS3Url(url));
  (void)bk;
  UCPFS_ASSIGN_OR_RETURN(s3::Environment env, s3::LoadS3Environment());
  UCPFS_ASSIGN_OR_RETURN(s3::Options options, s3::ResolveOptions(env, overrides));
  UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<s3::Client> client, s3::Client::Make(std::move(options)));
  return Make(std::move(client), url);
}

std::shared_ptr<const S3Tree> S3Tree::WithClient(std::shared_ptr<s3::Client> client) const {
  auto shared = std::make_shared<Shared>();
  shared->client = std::move(client);
  const uint64_t old_writes = shared_->client->writes();
  const uint64_t new_writes = shared->client->writes();
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared->etags = shared_->etags;
    for (auto [from, to] : {std::pair(&shared_->listed, &shared->listed), std::pair(&shared_->not_empty, &shared->not_empty)}) {
      for (const auto& [dir_key, l] : *from) {
        if (Fresh(*from, dir_key, old_writes) == nullptr) continue;
        Shared::Listed copy = l;
        copy.writes = new_writes;
        to->emplace(dir_key, std::move(copy));
      }
    }
  }
  return std::make_shared<const S3Tree>(std::move(shared), bucket_, prefix_);
}

std::optional<Result<TreeEntry>> S3Tree::FromListing(std::string_view rel) const {
  const size_t slash = rel.rfind('/');
  const std::string_view parent = slash == std::string_view::npos ? std::string_view() : rel.substr(0, slash);
  std::optional<std::optional<TreeEntry>> known = shared_->FreshEntry(KeyOf(parent), LastComponent(rel));
  if (!known) return std::nullopt;
  if (!*known) return Result<TreeEntry>(NotFoundError(PathOf(rel) + ": no such object or prefix"));
  return Result<TreeEntry>(std::move(**known));
}

std::string S3Tree::KeyOf(std::string_view rel) const {
  if (prefix_.empty()) return std::string(rel);
  if (rel.empty()) return prefix_;
  return prefix_ + "/" + std::string(rel);
}

Result<bool> S3Tree::HasKeysUnder(std::string_view rel) const {
  const std::string dir = KeyOf(rel);
  if (shared_->FreshNotEmpty(dir)) return true;
  if (!rel.empty()) {
    std::optional<Result<TreeEntry>> known = FromListing(rel);
    if (known && known->ok() && (*known)->kind == EntryKind::kDirectory) return true;
    if (known && !known->ok()) return false;  // the parent's listing has no such name
  }
  const std::string p = dir.empty() ? "" : dir + "/";
  Shared::Listed found;
  found.at_ms = SteadyMs();
  found.writes = shared_->client->writes();
  UCPFS_ASSIGN_OR_RETURN(s3::ListPage page, shared_->client->ListObjectsPage(bucket_, p, "/", 1, ""));
  if (page.objects.empty() && page.common_prefixes.empty()) return false;
  shared_->RememberNotEmpty(dir, std::move(found));
  return true;
}

Result<std::vector<TreeEntry>> S3Tree::List(std::string_view rel_dir) const {
  if (!SafeTreePath(rel_dir)) return BadPath(root_, rel_dir);
  const std::string dir = KeyOf(rel_dir);
  if (std::optional<std::vector<TreeEntry>> fresh = shared_->FreshListing(dir)) return std::move(*fresh);
  const std::string p = dir.empty() ? "" : dir + "/";
  Shared::Listed remembered;
  remembered.at_ms = SteadyMs();
  remembered.writes = shared_->client->writes();
  Result<s3::Listing> listing = shared_->client->ListObjects(bucket_, p, "/", 1000, kMaxTreeListEntries);
  if (!listing.ok()) {
    if (listing.error().code() == StatusCode::kResourceExhausted) {
      return ResourceExhaustedError(PathOf(rel_dir) + ": more than " + std::to_string(kMaxTreeListEntries) +
                                    " names in one directory");
    }
    return listing.error().WithContext("listing " + PathOf(rel_dir));
  }
  if (listing->objects.empty() && listing->common_prefixes.empty()) {
    return NotFoundError(PathOf(rel_dir) + ": no such directory (no key under it)");
  }
  std::vector<TreeEntry> out;
  out.reserve(listing->objects.size() + listing->common_prefixes.size());
  for (const s3::ObjectEntry& o : listing->objects) {
    const std::string_view name = std::string_view(o.key).substr(p.size());
    if (!CleanComponent(name)) continue;  // the directory's own marker `dir/`, or a name no path can reach
    shared_->Remember(o.key, o.etag);
    out.push_back(FileEntry(std::string(name), IdentityOf(o.n_bytes, o.etag, o.last_modified)));
  }
  for (const std::string& cp : listing->common_prefixes) {
    std::string_view name = std::string_view(cp).substr(p.size());
    if (!name.empty() && name.back() == '/') name.remove_suffix(1);
    if (!CleanComponent(name)) continue;
    out.push_back(DirEntry(std::string(name)));
  }
  // Sorted by name; a name that is both an object and a prefix stays the file (as Stat says).
  std::stable_sort(out.begin(), out.end(), [](const TreeEntry& a, const TreeEntry& b) { return a.name < b.name; });
  out.erase(std::unique(out.begin(), out.end(), [](const TreeEntry& a, const TreeEntry& b) { return a.name == b.name; }),
            out.end());
  remembered.entries = out;
  shared_->RememberListing(dir, std::move(remembered));
  return out;
}

Result<TreeEntry> S3Tree::Stat(std::string_view rel) const {
  if (!SafeTreePath(rel)) return BadPath(root_, rel);
  if (!rel.empty()) {
    if (std::optional<Result<TreeEntry>> known = FromListing(rel)) return std::move(*known);
    const std::string key = KeyOf(rel);
    Result<s3::ObjectInfo> head = shared_->client->Head(bucket_, key);
    if (head.ok()) {
      shared_->Remember(key, head->etag);
      return FileEntry(LastComponent(rel), IdentityOf(head->n_bytes, head->etag, head->last_modified));
    }
    if (head.error().code() != StatusCode::kNotFound) return head.error();
  }
  UCPFS_ASSIGN_OR_RETURN(bool is_dir, HasKeysUnder(rel));
  if (!is_dir) return NotFoundError(PathOf(rel) + ": no such object or prefix");
  return DirEntry(LastComponent(rel));
}

Result<OpenedFile> S3Tree::Open(std::string_view rel) const {
  if (rel.empty() || !SafeTreePath(rel)) return BadPath(root_, rel);
  const std::string key = KeyOf(rel);
  if (std::optional<Result<TreeEntry>> known = FromListing(rel); known && known->ok() && (*known)->kind == EntryKind::kFile) {
    const std::string etag = shared_->Recall(key);
    if (!etag.empty() && ETagInode(etag) == (*known)->identity.ino) {
      OpenedFile f;
      f.identity = (*known)->identity;
      f.bytes = s3::S3ObjectSource::FromRecorded(shared_->client, bucket_, key, f.identity.n_bytes, etag);
      return f;
    }
  }
  Result<s3::ObjectInfo> head = shared_->client->Head(bucket_, key);
  if (!head.ok()) {
    if (head.error().code() == StatusCode::kNotFound) {
      Result<bool> is_dir = HasKeysUnder(rel);
      if (is_dir.ok() && *is_dir) return InvalidArgumentError(PathOf(rel) + ": is a directory, not a file");
    }
    return head.error();
  }
  shared_->Remember(key, head->etag);
  OpenedFile f;
  f.identity = IdentityOf(head->n_bytes, head->etag, head->last_modified);
  f.bytes = s3::S3ObjectSource::FromRecorded(shared_->client, bucket_, key, head->n_bytes, head->etag);
  return f;
}

Result<std::shared_ptr<const LazySource>> S3Tree::OpenLazy(std::string_view rel, const FileIdentity& expected,
                                                           std::shared_ptr<IoCounters> counters,
                                                           std::shared_ptr<FdCache> cache) const {
  (void)cache;  // no descriptors: an idle object holds nothing but its name
  if (rel.empty() || !SafeTreePath(rel)) return BadPath(root_, rel);
  return std::shared_ptr<const LazySource>(
      std::make_shared<S3LazySource>(shared_, bucket_, KeyOf(rel), expected, std::move(counters)));
}

Result<std::shared_ptr<const SourceTree>> S3Tree::Subtree(std::string_view rel_dir) const {
  if (!SafeTreePath(rel_dir)) return BadPath(root_, rel_dir);
  return std::shared_ptr<const SourceTree>(std::make_shared<const S3Tree>(shared_, bucket_, KeyOf(rel_dir)));
}

}  // namespace ucpfs
