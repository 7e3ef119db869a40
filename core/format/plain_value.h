// Plain values: a torch.save blob (e.g. a DCP BYTE_IO item: an LR scheduler's state dict, a
// train step, a dataloader's state) decoded into a SaveValue the lazy writer can serve again,
// when its object is plain data: None, bool, int, float, str, bytes, list, tuple, dict and
// OrderedDict with str or int keys, and tensors. Tensors stay lazy: their bytes are read from
// the blob's storage record when the served file is read.
//
// Not for: objects a weights_only torch.load refuses (instances of other classes, numpy arrays,
// sets, ints beyond 64 bits): those are kUnsupported with the path and the reason, so the caller
// can report the item instead of serving something else.
// Invariants: nothing is executed; the walk is bounded in depth and in nodes visited (shared
// sub-objects count each time they are reached), so a hostile blob cannot make it loop or blow up.
#pragma once

#include <cstdint>
#include <memory>

#include "core/byte_source.h"
#include "core/format/torch_writer.h"
#include "core/status.h"

namespace ucpfs::format {

struct PlainValueLimits {
  uint32_t max_depth = 64;
  uint64_t max_nodes = 1u << 20;  // nodes visited, counting shared ones at each visit
};

// Errors: those of TorchFile::Open; kUnsupported "<blob>: at <path>: <what> (...)" for a value
// that is not plain data or a tensor that is not contiguous; kResourceExhausted past a limit.
Result<SaveValue> DecodePlainValue(std::shared_ptr<const ByteSource> blob,
                                   const PlainValueLimits& limits = {});

}  // namespace ucpfs::format
