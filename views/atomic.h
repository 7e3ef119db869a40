// Atomic views: the consolidated per-parameter files `atomic/<param>/<state>.pt`, laid out as
// DeepSpeed's universal checkpoint writes them (docs/formats.md "The universal checkpoint"): a dict
// of pattern keys (`cat_dim` when the tensor-parallel dimension is known, `vocab_tensor` for
// vocabulary parameters) ending in 'param', the consolidated fp32 tensor. Built lazily: the file's
// size and headers come from the layout alone; tensor bytes are gathered (and converted to fp32)
// from the source fragments on read.
//
// Pure logic over ByteSources: no FUSE, no LMDB.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/byte_source.h"
#include "core/format/torch_writer.h"
#include "core/layout/patterns.h"
#include "core/slice/plan_cache.h"
#include "core/slice/slice.h"

namespace ucpfs::views {

// The `atomic/<param>` directory name of a parameter (the mount and `ucpfs convert --atomic`
// both use it): its fqn with '/' written as "%2F", '%' as "%25" and NUL as "%00"; "." and ".."
// become "%2E" and "%2E%2E"; a name over 255 bytes keeps its first bytes and ends in '~' and
// 16 hex digits of a hash of the whole fqn. Deterministic; other bytes (non-UTF-8 included) are
// kept as they are. The mount lists every name that differs from its fqn in status.json.
std::string AtomicDirName(const std::string& fqn);

// Describes the source geometry: "unique" (one fragment), "shard(dim=0)", "shard(dims=0,1)",
// "flat" (flattened-range fragments), "empty".
std::string DescribePattern(const slice::TensorLayout& layout);

// The dimension the source chunks split along, when exactly one.
std::optional<int> ShardDim(const slice::TensorLayout& layout);

struct AtomicPattern {
  std::optional<int64_t> cat_dim;  // written as 'cat_dim' when known
  bool vocab_tensor = false;       // written as 'vocab_tensor': True
};

// cat_dim/vocab_tensor of a parameter from its pattern (views::PatternsOf, the one pattern
// source of target views too): the split dimension of column, row and vocabulary parameters,
// vocab_tensor for vocabulary ones, nothing for replicated or averaged ones.
AtomicPattern AtomicPatternOf(const layout::ParamPattern& pattern);

// A TensorBytesProvider that gathers a tensor's row-major bytes in `dst_dtype` from its
// fragments (slice::ReadTensorBytes), through the tensor's copy plan made once (slice::PlanCache:
// one per view file, so per inode and generation).
class LayoutProvider final : public format::TensorBytesProvider {
 public:
  LayoutProvider(std::shared_ptr<const slice::TensorLayout> layout, DType dst_dtype,
                 std::shared_ptr<const std::vector<std::shared_ptr<const ByteSource>>> files)
      : layout_(std::move(layout)), dst_dtype_(dst_dtype), files_(std::move(files)), plans_(*layout_, dst_dtype_) {}
  Status Read(uint64_t byte_offset, std::span<std::byte> out) const override;
  void Prefetch(uint64_t byte_offset, uint64_t n_bytes) const override {
    slice::PrefetchTensorBytes(*layout_, dst_dtype_, *files_, byte_offset, n_bytes);
  }
  Status DescribeReads(uint64_t byte_offset, uint64_t n_bytes, const SourceRunSink& sink) const override {
    return slice::DescribeTensorReads(*layout_, dst_dtype_, *files_, byte_offset, n_bytes, sink);
  }

 private:
  std::shared_ptr<const slice::TensorLayout> layout_;
  DType dst_dtype_;
  std::shared_ptr<const std::vector<std::shared_ptr<const ByteSource>>> files_;
  slice::PlanCache plans_;  // over *layout_, which it must not outlive: declared after it
};

// Whether every fragment of `layout` converts to float32; kUnsupported naming `name` if not.
Status CheckAtomicDtypes(const slice::TensorLayout& layout, const std::string& name);

// Builds the atomic file for one state of one parameter: {[cat_dim], [vocab_tensor], param}
// with `param` the consolidated tensor in float32. `name` is used in errors. Its size depends
// only on the shape and `pattern`, not on where the tensor's bytes lie.
// Errors: CheckAtomicDtypes'.
Result<std::shared_ptr<format::LazyTorchFile>> BuildAtomicFile(
    std::shared_ptr<const slice::TensorLayout> layout, const AtomicPattern& pattern,
    std::shared_ptr<const std::vector<std::shared_ptr<const ByteSource>>> files, std::string name);

}  // namespace ucpfs::views
