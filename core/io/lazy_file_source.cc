#include "core/io/lazy_file_source.h"

#include <sys/resource.h>

#include <algorithm>

namespace ucpfs {
namespace {

Result<std::shared_ptr<FileSource>> OpenChecked(const std::string& path, const FileIdentity& expected) {
  UCPFS_ASSIGN_OR_RETURN(auto file, FileSource::Open(path));
  const std::string diff = expected.Differences(file->identity());
  if (!diff.empty()) {
    return Status(StatusCode::kDataLoss,
                  path + ": not the file that was indexed (" + diff + "); remount to re-index the source");
  }
  return file;
}

}  // namespace

Result<std::shared_ptr<FileSource>> FdCache::Get(const std::string& path, const FileIdentity& expected,
                                                 bool* opened) {
  if (opened != nullptr) *opened = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = open_.find(path); it != open_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.pos);
      return it->second.file;
    }
  }
  // Opened outside the lock: a slow open must not stall reads of other files.
  UCPFS_ASSIGN_OR_RETURN(auto file, OpenChecked(path, expected));
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = open_.find(path); it != open_.end()) return it->second.file;  // a racing open won
  while (open_.size() >= capacity_ && !lru_.empty()) {
    open_.erase(lru_.back());
    lru_.pop_back();
  }
  lru_.push_front(path);
  open_.emplace(path, Entry{file, lru_.begin()});
  if (opened != nullptr) *opened = true;
  return file;
}

size_t FdCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return open_.size();
}

size_t FdCache::DefaultCapacity() {
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return 65536;
  return std::clamp<size_t>(static_cast<size_t>(rl.rlim_cur / 4), 16, 65536);
}

uint64_t RaiseOpenFileLimit() {
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return 0;
  if (rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &rl);
    (void)::getrlimit(RLIMIT_NOFILE, &rl);
  }
  return static_cast<uint64_t>(rl.rlim_cur);
}

Result<std::shared_ptr<FileSource>> LazyFileSource::Get() const {
  if (cache_) {
    bool opened = false;
    auto file = cache_->Get(path_, expected_, &opened);
    if (opened && counters_) {
      counters_->files_opened.fetch_add(1, std::memory_order_relaxed);
    }
    return file;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (file_) return file_;
  UCPFS_ASSIGN_OR_RETURN(file_, OpenChecked(path_, expected_));
  if (counters_) counters_->files_opened.fetch_add(1, std::memory_order_relaxed);
  return file_;
}

void LazyFileSource::Prefetch(uint64_t byte_offset, uint64_t n_bytes) const {
  auto file = Get();
  if (file.ok()) (*file)->Prefetch(byte_offset, n_bytes);
}

void LazyFileSource::Count(uint64_t n_reads, uint64_t n_bytes, bool ok) const {
  if (!counters_) return;
  counters_->source_reads.fetch_add(n_reads, std::memory_order_relaxed);
  if (ok) {
    counters_->source_bytes_read.fetch_add(n_bytes, std::memory_order_relaxed);
  } else {
    counters_->source_read_errors.fetch_add(1, std::memory_order_relaxed);
  }
}

Status LazyFileSource::ReadAt(uint64_t byte_offset, std::span<std::byte> out) const {
  auto file = Get();
  Status s = file.ok() ? (*file)->ReadAt(byte_offset, out) : file.status();
  // After the read: an edit in place before or during it shows in mtime/ctime now.
  if (s.ok()) s = (*file)->CheckUnchanged();
  Count(1, out.size(), s.ok());
  return s;
}

Status LazyFileSource::ReadPieces(std::span<const ReadPiece> pieces, size_t* failed_index) const {
  if (pieces.empty()) return Status::Ok();
  auto file = Get();
  if (failed_index != nullptr) *failed_index = 0;
  Status s = file.ok() ? (*file)->ReadPieces(pieces, failed_index) : file.status();
  // After the batch: an edit in place before or during it shows in mtime/ctime now; it fails
  // the batch from its first piece (none of its bytes can be trusted).
  if (s.ok()) s = (*file)->CheckUnchanged();
  uint64_t n_bytes = 0;
  for (const ReadPiece& p : pieces) n_bytes += p.out.size();
  Count(pieces.size(), n_bytes, s.ok());
  return s;
}

Result<bool> LazyFileSource::LocatePieces(std::span<const ReadPiece> pieces, std::span<FileExtent> extents) const {
  if (pieces.empty()) return true;
  auto file = Get();
  Status s = file.status();
  if (s.ok()) s = (*file)->CheckUnchanged();
  Result<bool> located = s.ok() ? (*file)->LocatePieces(pieces, extents) : Result<bool>(s);
  uint64_t n_bytes = 0;
  for (const ReadPiece& p : pieces) n_bytes += p.out.size();
  Count(pieces.size(), n_bytes, located.ok());
  return located;
}

}  // namespace ucpfs
