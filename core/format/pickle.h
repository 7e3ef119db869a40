// Safe pickle reader: parses a pickle (protocols 0-5 opcodes as used by torch.save, DCP
// `.metadata`, DeepSpeed and Megatron checkpoints) into an inert object graph. It never
// imports, calls or executes anything: GLOBAL/STACK_GLOBAL become Global nodes, REDUCE/NEWOBJ
// become generic Object nodes (callable + args), BUILD records state. A short whitelist is
// *interpreted* structurally (no code runs):
//   collections.OrderedDict()             -> Dict node with ordered = true
//   torch._utils._rebuild_tensor_v2/v3    -> Tensor node (storage, offset, shape, stride, dtype)
//   torch._utils._rebuild_tensor          -> Tensor node (old 4-arg form)
//   torch._utils._rebuild_parameter(_with_state), torch._tensor._rebuild_from_type_v2
//                                         -> the wrapped Tensor node (is_parameter = true)
//   torch.Size(tuple)                     -> that Tuple node
//   BINPERSID ('storage', <StorageClass global>, key, location, numel)
//                                         -> Storage node
//   _codecs.encode(str, 'latin1'), builtins.bytearray(...) -> Bytes node
//   builtins.set/frozenset(list)          -> Set node
//   GLOBAL names from Python 2 modules (__builtin__, copy_reg, ...) are mapped to Python 3.
// Everything else stays generic: an unknown class becomes Object{callable=Global(module,name),
// args, state, list_items, dict_items}, so argparse.Namespace, enums, dataclasses, pathlib
// paths, numpy reconstructs, ... all parse.
//
// Untrusted input: bounded node count, memo size, stack size, MARK nesting and string length
// (PickleLimits); a malformed pickle returns kCorrupt naming the source, the byte offset of the
// opcode and what is wrong; limits give kResourceExhausted. Graphs may contain cycles (through
// the memo), so walkers must track what they visit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"

namespace ucpfs::pickle {

using NodeId = uint32_t;
inline constexpr NodeId kNoNode = 0xFFFFFFFFu;

enum class Kind : uint8_t {
  kNone,
  kBool,
  kInt,           // fits int64: int_value
  kBigInt,        // does not fit int64: text = two's complement little-endian bytes
  kFloat,         // float_value
  kString,        // text (UTF-8 as stored)
  kBytes,         // text holds the raw bytes
  kTuple,         // items
  kList,          // items
  kDict,          // dict_items (insertion order); ordered = OrderedDict
  kSet,           // items (set or frozenset)
  kGlobal,        // module, name (after Python 2 -> 3 name mapping)
  kObject,        // generic instance: callable, args, state, list_items, dict_items
  kPersistentId,  // a persistent id that is not a torch storage: args = the pid value
  kStorage,       // torch storage from a persistent id: storage_* fields
  kTensor,        // torch tensor: tensor_* fields
};

const char* KindName(Kind kind);

struct Node {
  Kind kind = Kind::kNone;

  bool bool_value = false;
  int64_t int_value = 0;
  double float_value = 0.0;
  std::string text;  // kString, kBytes, kBigInt

  std::string module;  // kGlobal
  std::string name;    // kGlobal

  std::vector<NodeId> items;                          // kTuple, kList, kSet
  std::vector<std::pair<NodeId, NodeId>> dict_items;  // kDict; kObject (SETITEM(S) on an object)
  bool ordered = false;                               // kDict: collections.OrderedDict

  // kObject: `callable` is the class/function node (usually kGlobal), `args` the argument
  // tuple (kNoNode if none), `state` what BUILD set (kNoNode if never built), `list_items`
  // what APPEND(S) added. kDict (OrderedDict) may also carry `state` from BUILD
  // (e.g. {'_metadata': ...}). kPersistentId: `args` is the pid value.
  NodeId callable = kNoNode;
  NodeId args = kNoNode;
  NodeId kwargs = kNoNode;  // NEWOBJ_EX
  NodeId state = kNoNode;
  std::vector<NodeId> list_items;
  bool newobj = false;  // created by NEWOBJ/NEWOBJ_EX rather than REDUCE

  // kStorage
  std::string storage_key;       // e.g. "0" -> record "data/0"
  std::string storage_location;  // e.g. "cpu", "cuda:0"
  DType storage_dtype = DType::kUInt8;  // element type of a typed storage; kUInt8 for untyped
  bool storage_untyped = false;  // torch.storage.UntypedStorage (numel counts bytes)
  uint64_t storage_numel = 0;    // as pickled: elements (typed) or bytes (untyped)

  // kTensor
  NodeId tensor_storage = kNoNode;  // a kStorage node
  DType tensor_dtype = DType::kFloat32;
  int64_t tensor_storage_offset = 0;  // in elements of tensor_dtype
  std::vector<int64_t> tensor_shape;
  std::vector<int64_t> tensor_stride;  // in elements
  bool tensor_requires_grad = false;
  bool tensor_is_parameter = false;
};

struct PickleLimits {
  uint64_t max_nodes = 1u << 24;
  uint64_t max_memo = 1u << 24;        // memo entries (and largest memo index accepted)
  uint64_t max_stack = 1u << 24;       // values on the stack at once
  uint32_t max_mark_depth = 512;       // nested MARKs
  uint64_t max_string_bytes = 1ull << 30;
};

class PickleGraph {
 public:
  const Node& at(NodeId id) const { return nodes_[id]; }
  NodeId root() const { return root_; }
  size_t size() const { return nodes_.size(); }

  // Helpers for walkers (return nullptr / false when the shape does not match):
  // the value stored under string key `key` in a kDict node.
  const Node* DictGet(NodeId dict, std::string_view key) const;
  // True when node is a kGlobal with this module and name.
  bool IsGlobal(NodeId id, std::string_view module, std::string_view name) const;
  // For a kObject whose callable is a kGlobal: its class name (module-less), else "".
  std::string_view ClassName(NodeId id) const;

  // Mutable access for the parser.
  std::vector<Node>& mutable_nodes() { return nodes_; }
  void set_root(NodeId id) { root_ = id; }

 private:
  std::vector<Node> nodes_;
  NodeId root_ = kNoNode;
};

// Parses a complete pickle (up to and including STOP). `source_name` is used in errors
// ("<file>: pickle offset 123: <reason>"). Trailing bytes after STOP are ignored.
// Errors: kCorrupt (truncated, unknown opcode, stack underflow, wrong operand types, bad memo
// index, ...), kResourceExhausted (a PickleLimits bound).
Result<PickleGraph> ParsePickle(std::span<const std::byte> data, std::string_view source_name,
                                const PickleLimits& limits = {});

}  // namespace ucpfs::pickle
