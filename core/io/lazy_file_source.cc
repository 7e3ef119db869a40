#include "core/io/lazy_file_source.h"

namespace ucpfs {

Result<std::shared_ptr<FileSource>> LazyFileSource::Get() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_) return file_;
  UCPFS_ASSIGN_OR_RETURN(auto file, FileSource::Open(path_));
  if (file->Size() != n_bytes_) {
    return Status(StatusCode::kDataLoss, path_ + ": size is " + std::to_string(file->Size()) +
                                             " bytes but the index recorded " +
                                             std::to_string(n_bytes_) + "; re-index the source");
  }
  file_ = std::move(file);
  if (counters_) counters_->files_opened.fetch_add(1, std::memory_order_relaxed);
  return file_;
}

Status LazyFileSource::ReadAt(uint64_t byte_offset, std::span<std::byte> out) const {
  auto file = Get();
  Status s = file.ok() ? (*file)->ReadAt(byte_offset, out) : file.status();
  if (counters_) {
    counters_->source_reads.fetch_add(1, std::memory_order_relaxed);
    if (s.ok()) counters_->source_bytes_read.fetch_add(out.size(), std::memory_order_relaxed);
    else counters_->source_read_errors.fetch_add(1, std::memory_order_relaxed);
  }
  return s;
}

}  // namespace ucpfs
