// Plain values: a torch.save blob (e.g. a DCP BYTE_IO item: an LR scheduler's state dict, a
// train step, a dataloader's state) decoded into a SaveValue the lazy writer can serve again,
// when its object is plain data: None, bool, int, float, str, bytes, list, tuple, dict and
// OrderedDict with str or int keys, and tensors. Tensors stay lazy: their bytes are read from
// the blob's storage record when the served file is read.
//
// Not for (unless PlainValueLimits::keep_objects): objects a weights_only torch.load refuses (instances of other classes, numpy arrays,
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
  // Keep globals and instances of other classes as SaveValue::Global/Object, re-emitted as the
  // source pickled them (nothing runs here; whoever loads the served file with
  // weights_only=False runs them, as it would the source). For files that DeepSpeed's own
  // loaders read (its universal checkpoint's zero/optimizer_state.pt). Sets, big ints, keyword
  // constructors (NEWOBJ_EX), Parameters and bare storages stay unsupported.
  bool keep_objects = false;
};

// Errors: those of TorchFile::Open; kUnsupported "<blob>: at <path>: <what> (...)" for a value
// that is not plain data or a tensor that is not contiguous; kResourceExhausted past a limit.
Result<SaveValue> DecodePlainValue(std::shared_ptr<const ByteSource> blob,
                                   const PlainValueLimits& limits = {});

class TorchFile;
// The value at `node` of `tf`, a torch file opened over `file` (tensor bytes are read from
// `file` lazily). Errors as DecodePlainValue, with "at <path>" relative to `node`.
Result<SaveValue> DecodeValueAt(const TorchFile& tf, std::shared_ptr<const ByteSource> file,
                                uint32_t node, const PlainValueLimits& limits = {});

}  // namespace ucpfs::format
