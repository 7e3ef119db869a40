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
// args, state, list_items, dict_items}, so argparse.Namespace, dataclasses, pathlib paths, numpy
// reconstructs, ... all parse. Details a walker may rely on:
//   - Equal ints share one NodeId, and so do all Nones, all Trues and all Falses (pickles never
//     memoize them). Other values share a node only through the memo (GET, DUP), torch.Size
//     (its tuple) and _rebuild_parameter* (its tensor, marked in place).
//   - copyreg._reconstructor(cls, base, state) (protocols 0/1) becomes an Object whose callable
//     is cls and whose args are the original 3-tuple (cls, base, state).
//   - _rebuild_from_type_v2(func, type, args, state) becomes the Tensor that func(*args) builds;
//     is_parameter is set only when type is torch.nn.parameter.Parameter, and state is kept.
//   - BUILD sets the state of an Object, Dict, Tensor, Storage or PersistentId (a second BUILD
//     replaces it); on any other kind it is kCorrupt.
//   - APPEND(S) and ADDITEMS on an Object add to its list_items, SETITEM(S) to its dict_items.
//   - Dict items keep every SETITEM in order, duplicate keys included; DictGet returns the value
//     of the last one, as Python would.
//   - Enums stay generic: pickled by name, Object{callable=builtins.getattr, args=(Cls, 'NAME')};
//     by value, Object{callable=Cls, args=(value,)}. IntEnumValue reads either form.
//
// Untrusted input: bounded node count, memo size, stack size, MARK nesting and string length
// (PickleLimits); a malformed pickle returns kCorrupt naming the source, the byte offset of the
// opcode and what is wrong; limits give kResourceExhausted. Graphs may contain cycles (through
// the memo), so walkers must track what they visit.
//
// Memory: a node is 16 bytes (kind, flags, a 32-bit index, a 64-bit payload). Everything else
// lives in side tables owned by the graph: one byte arena for all text (immutable text is
// shared, not copied), one pool of item ids, one of dict pairs, one of tensor dims, and small
// records for globals, objects, storages and tensors. A DCP-like .metadata costs under 40 bytes
// per node, text included (MemoryBytes; ~400 when every node carried every field).
// Not for: mutating a graph after parsing.
#pragma once

#include <cassert>
#include <cstddef>
#include <cstdint>
#include <optional>
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
  kBool,          // bool_value
  kInt,           // fits int64: int_value
  kBigInt,        // does not fit int64: text = two's complement little-endian bytes
  kFloat,         // float_value
  kString,        // text (UTF-8 as stored)
  kBytes,         // text holds the raw bytes
  kTuple,         // items
  kList,          // items
  kDict,          // dict_items (insertion order), ordered (OrderedDict), state
  kSet,           // items (set or frozenset)
  kGlobal,        // module, name (after Python 2 -> 3 name mapping)
  kObject,        // generic instance: object() (callable, args, kwargs, state, list/dict items)
  kPersistentId,  // a persistent id that is not a torch storage: persistent_id, state
  kStorage,       // torch storage from a persistent id: storage()
  kTensor,        // torch tensor: tensor()
};

const char* KindName(Kind kind);

// The payload of a kObject node. Spans point into the graph (see PickleGraph).
struct ObjectInfo {
  NodeId callable = kNoNode;  // the class or function: usually kGlobal, kObject for a nested call
  NodeId args = kNoNode;      // the argument tuple (REDUCE/NEWOBJ/NEWOBJ_EX/INST/OBJ)
  NodeId kwargs = kNoNode;    // NEWOBJ_EX keyword dict, else kNoNode
  NodeId state = kNoNode;     // what BUILD set, kNoNode if never built
  bool newobj = false;        // created by NEWOBJ/NEWOBJ_EX rather than REDUCE
  std::span<const NodeId> list_items;                     // APPEND(S)/ADDITEMS on the object
  std::span<const std::pair<NodeId, NodeId>> dict_items;  // SETITEM(S) on the object
};

// The payload of a kStorage node (a torch storage persistent id).
struct StorageInfo {
  std::string_view key;       // e.g. "0" -> record "data/0"
  std::string_view location;  // e.g. "cpu", "cuda:0"
  DType dtype = DType::kUInt8;  // element type of a typed storage; kUInt8 for untyped
  bool untyped = false;         // torch.storage.UntypedStorage (numel counts bytes)
  uint64_t numel = 0;           // as pickled: elements (typed) or bytes (untyped)
  NodeId state = kNoNode;       // what BUILD set
};

// The payload of a kTensor node.
struct TensorInfo {
  NodeId storage = kNoNode;  // a kStorage node
  DType dtype = DType::kFloat32;
  int64_t storage_offset = 0;      // in elements of dtype
  std::span<const int64_t> shape;
  std::span<const int64_t> stride;  // in elements; as many dims as shape
  bool requires_grad = false;
  bool is_parameter = false;
  NodeId state = kNoNode;  // BUILD, _rebuild_parameter_with_state or _rebuild_from_type_v2
};

struct PickleLimits {
  uint64_t max_nodes = 1u << 24;       // above 2^32-1 acts as 2^32-1 (NodeIds are 32-bit)
  uint64_t max_memo = 1u << 24;        // memo entries (and largest memo index accepted)
  uint64_t max_stack = 1u << 24;       // values on the stack at once
  uint32_t max_mark_depth = 512;       // nested MARKs
  uint64_t max_string_bytes = 1ull << 30;  // above 2^32-1 acts as 2^32-1 (32-bit lengths)
};

class PickleGraph;

// Parses a complete pickle (up to and including STOP). `source_name` is used in errors
// ("<file>: pickle offset 123: <reason>"). Trailing bytes after STOP are ignored.
// Errors: kCorrupt (truncated, unknown opcode, stack underflow, wrong operand types, bad memo
// index, ...), kResourceExhausted (a PickleLimits bound, more than 2^32-1 items in one container,
// or out of memory). When it fails and `ran_out` is given, *ran_out says whether `data` ended
// before the pickle's STOP (a longer prefix of the same stream might parse), rather than the
// pickle being wrong in the bytes it has.
Result<PickleGraph> ParsePickle(std::span<const std::byte> data, std::string_view source_name,
                                const PickleLimits& limits = {}, bool* ran_out = nullptr);

// The parsed graph: nodes are numbered [0, size()) and read through the accessors below.
// kind(id) requires id < size(). Every other accessor takes any id (kNoNode included) and, for
// an id out of range or a node of another kind, returns an empty value (0, false, "", an empty
// span, kNoNode, a default-constructed *Info) rather than failing. string_views and spans point
// into storage the graph owns: they stay valid as long as the graph (or the graph it was moved
// into) lives. A graph is immutable once parsed, so any number of threads may read it.
class PickleGraph {
 public:
  NodeId root() const { return root_; }
  // The byte offset just past the pickle's STOP in the data parsed (where a next pickle begins).
  uint64_t end_offset() const { return end_offset_; }
  size_t size() const { return nodes_.size(); }

  // kNone for kNoNode or any other id outside the graph, like every other accessor.
  Kind kind(NodeId id) const { return id < nodes_.size() ? nodes_[id].kind : Kind::kNone; }
  bool bool_value(NodeId id) const;     // kBool
  int64_t int_value(NodeId id) const;   // kInt
  double float_value(NodeId id) const;  // kFloat
  // kString: UTF-8 as stored; kBytes: the raw bytes; kBigInt: two's complement little-endian.
  std::string_view text(NodeId id) const;
  std::string_view module(NodeId id) const;  // kGlobal (after Python 2 -> 3 name mapping)
  std::string_view name(NodeId id) const;    // kGlobal
  std::span<const NodeId> items(NodeId id) const;  // kTuple, kList, kSet
  // kDict: every SETITEM in insertion order (duplicate keys kept).
  std::span<const std::pair<NodeId, NodeId>> dict_items(NodeId id) const;
  bool ordered(NodeId id) const;  // kDict: collections.OrderedDict
  // What BUILD set on a kObject, kDict, kTensor, kStorage or kPersistentId (for a tensor, also
  // the state of _rebuild_parameter_with_state/_rebuild_from_type_v2); kNoNode if none.
  NodeId state(NodeId id) const;
  NodeId persistent_id(NodeId id) const;  // kPersistentId: the pid value
  ObjectInfo object(NodeId id) const;     // kObject
  StorageInfo storage(NodeId id) const;   // kStorage
  TensorInfo tensor(NodeId id) const;     // kTensor

  // Helpers for walkers (kNoNode / false / "" when the shape does not match):
  // the value of the last item under string key `key` in a kDict node.
  NodeId DictGet(NodeId dict, std::string_view key) const;
  // True when node is a kGlobal with this module and name.
  bool IsGlobal(NodeId id, std::string_view module, std::string_view name) const;
  // For a kObject whose callable is a kGlobal: its class name (module-less), else "".
  std::string_view ClassName(NodeId id) const;

  // Bytes the graph holds: its own size plus the capacity of every table, text included.
  size_t MemoryBytes() const;

 private:
  friend Result<PickleGraph> ParsePickle(std::span<const std::byte>, std::string_view,
                                         const PickleLimits&, bool*);
  class Parser;

  // A byte range of text_.
  struct TextRef {
    uint64_t offset = 0;
    uint64_t n_bytes = 0;
  };
  // A growable range of items_ or pairs_ (List, Set, Dict, an Object's list or dict items).
  // Capacity beyond count is reserved for in-place appends.
  struct Seq {
    uint64_t offset = 0;
    uint32_t count = 0;
    uint32_t capacity = 0;
  };
  static constexpr uint32_t kNoSeq = 0xFFFFFFFFu;
  static constexpr uint8_t kOrderedFlag = 1;  // kDict
  static constexpr uint8_t kNewObjFlag = 1;   // kObject

  // What `index` and `payload` hold, by kind:
  //   kBool, kInt, kFloat      payload: the value's bits
  //   kString, kBytes, kBigInt payload: offset in text_; index: n_bytes
  //   kTuple                   payload: offset in items_; index: count (tuples never grow)
  //   kList, kSet              index: seqs_ entry over items_
  //   kDict                    index: seqs_ entry over pairs_; payload: state; flags: ordered
  //   kGlobal                  index: globals_ entry
  //   kObject                  index: objects_ entry; flags: newobj
  //   kPersistentId            payload: the pid value; index: state
  //   kStorage, kTensor        index: storages_ / tensors_ entry
  struct Node {
    Kind kind = Kind::kNone;
    uint8_t flags = 0;
    uint16_t reserved = 0;
    uint32_t index = 0;
    uint64_t payload = 0;
  };
  static_assert(sizeof(Node) == 16);
  struct GlobalRecord {
    TextRef module;
    TextRef name;
  };
  struct ObjectRecord {
    NodeId callable = kNoNode;
    NodeId args = kNoNode;
    NodeId kwargs = kNoNode;
    NodeId state = kNoNode;
    uint32_t list_seq = kNoSeq;  // created by the first APPEND(S)/ADDITEMS
    uint32_t dict_seq = kNoSeq;  // created by the first SETITEM(S)
  };
  struct StorageRecord {
    TextRef key;
    TextRef location;
    uint64_t numel = 0;
    NodeId state = kNoNode;
    DType dtype = DType::kUInt8;
    bool untyped = false;
  };
  struct TensorRecord {
    uint64_t dims_offset = 0;  // shape at dims_[dims_offset, +ndim), stride right after
    int64_t storage_offset = 0;
    uint32_t ndim = 0;
    NodeId storage = kNoNode;
    NodeId state = kNoNode;
    DType dtype = DType::kFloat32;
    bool requires_grad = false;
    bool is_parameter = false;
  };

  const Node* Find(NodeId id, Kind kind) const {
    return id < nodes_.size() && nodes_[id].kind == kind ? &nodes_[id] : nullptr;
  }
  std::string_view Text(TextRef ref) const {
    return {text_.data() + ref.offset, static_cast<size_t>(ref.n_bytes)};
  }
  std::span<const NodeId> ItemsOf(uint32_t seq) const;
  std::span<const std::pair<NodeId, NodeId>> PairsOf(uint32_t seq) const;

  // Vectors rather than strings so that moving a graph keeps every view valid.
  std::vector<Node> nodes_;
  std::vector<char> text_;
  std::vector<NodeId> items_;
  std::vector<std::pair<NodeId, NodeId>> pairs_;
  std::vector<int64_t> dims_;
  std::vector<Seq> seqs_;
  std::vector<GlobalRecord> globals_;
  std::vector<ObjectRecord> objects_;
  std::vector<StorageRecord> storages_;
  std::vector<TensorRecord> tensors_;
  NodeId root_ = kNoNode;
  uint64_t end_offset_ = 0;
};

// A Python int Enum the caller knows: its class and members (aliases included).
struct IntEnumMember {
  std::string_view name;
  int64_t value = 0;
};
struct IntEnumType {
  std::string_view module;
  std::string_view name;
  std::span<const IntEnumMember> members;
};

// The value of node `id` as a member of `type`, in either form Python pickles an int Enum:
// by value, REDUCE(Cls, (value,)) (newer Pythons), or by name, REDUCE(builtins.getattr,
// (Cls, 'NAME')) (some 3.11 releases, Debian 12's 3.11.2 among them). Purely structural: the
// name is matched against `type.members`, nothing is resolved or called. nullopt for anything
// else: another class, a value or name that is no member, extra arguments or state.
std::optional<int64_t> IntEnumValue(const PickleGraph& g, NodeId id, const IntEnumType& type);

}  // namespace ucpfs::pickle
