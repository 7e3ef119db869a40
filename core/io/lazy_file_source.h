// LazyFileSource: a ByteSource over a file whose size is already known (from the index), opened
// on first read. A mount may reference thousands of shard files; they cost no descriptor until
// a read needs them. Thread-safe. The opened file's size must equal the expected size, else
// every read fails with kDataLoss (the source changed under the index).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "core/byte_source.h"
#include "core/io/file_source.h"

namespace ucpfs {

// Counters shared by the source files of one mount (reported in .ucpfs/stats.json).
struct IoCounters {
  std::atomic<uint64_t> source_bytes_read{0};
  std::atomic<uint64_t> source_reads{0};
  std::atomic<uint64_t> source_read_errors{0};
  std::atomic<uint64_t> files_opened{0};
};

class LazyFileSource final : public ByteSource {
 public:
  LazyFileSource(std::string path, uint64_t n_bytes, std::shared_ptr<IoCounters> counters = nullptr)
      : path_(std::move(path)), n_bytes_(n_bytes), counters_(std::move(counters)) {}

  uint64_t Size() const override { return n_bytes_; }
  const std::string& Name() const override { return path_; }
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override;

 private:
  Result<std::shared_ptr<FileSource>> Get() const;

  std::string path_;
  uint64_t n_bytes_;
  std::shared_ptr<IoCounters> counters_;
  mutable std::mutex mu_;
  mutable std::shared_ptr<FileSource> file_;  // guarded by mu_ until set
};

}  // namespace ucpfs
