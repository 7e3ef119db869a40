// Safe pickle reader: the contract is in pickle.h.
//
// Shape: one iterative loop over opcodes, no recursion anywhere. The value stack holds NodeIds;
// a MARK is a position in that stack, and (as in CPython's _pickle.c) values below the newest
// mark are fenced off: an opcode that would pop them reports a stack underflow instead. Memo
// entries alias node ids, so a BUILD/APPEND/SETITEM after BINGET mutates the one shared node
// and cycles can form. Every length and count read from the input is checked against the bytes
// that remain before anything is allocated, and every growing structure against PickleLimits.
// Immutable scalars are shared: equal ints, and None/True/False, are one node each (pickles
// never memoize them, and a DCP .metadata is full of them). Copies made while interpreting the
// whitelist are charged against a budget proportional to the input (see Charge).
// Storage (layout in pickle.h): a node is 16 bytes and its payload sits in the graph's tables.
// Tuples are written once into the item pool; lists, sets, dicts and an object's items grow
// after creation, interleaved with building their values, so each has a range that grows in
// place while it is the newest in its pool and otherwise moves to the end with double the room
// (see Grow): O(items) copying in all. Text that never changes is shared between nodes.
// Not for: executing anything, or reproducing Python semantics beyond the whitelist in pickle.h.
#include "core/format/pickle.h"

#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/checked.h"

namespace ucpfs::pickle {

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kNone: return "None";
    case Kind::kBool: return "Bool";
    case Kind::kInt: return "Int";
    case Kind::kBigInt: return "BigInt";
    case Kind::kFloat: return "Float";
    case Kind::kString: return "String";
    case Kind::kBytes: return "Bytes";
    case Kind::kTuple: return "Tuple";
    case Kind::kList: return "List";
    case Kind::kDict: return "Dict";
    case Kind::kSet: return "Set";
    case Kind::kGlobal: return "Global";
    case Kind::kObject: return "Object";
    case Kind::kPersistentId: return "PersistentId";
    case Kind::kStorage: return "Storage";
    case Kind::kTensor: return "Tensor";
  }
  return "?";
}

std::span<const NodeId> PickleGraph::ItemsOf(uint32_t seq) const {
  const Seq& s = seqs_[seq];
  return {items_.data() + s.offset, s.count};
}

std::span<const std::pair<NodeId, NodeId>> PickleGraph::PairsOf(uint32_t seq) const {
  const Seq& s = seqs_[seq];
  return {pairs_.data() + s.offset, s.count};
}

bool PickleGraph::bool_value(NodeId id) const {
  const Node* n = Find(id, Kind::kBool);
  return n != nullptr && n->payload != 0;
}

int64_t PickleGraph::int_value(NodeId id) const {
  const Node* n = Find(id, Kind::kInt);
  return n != nullptr ? static_cast<int64_t>(n->payload) : 0;
}

double PickleGraph::float_value(NodeId id) const {
  const Node* n = Find(id, Kind::kFloat);
  return n != nullptr ? std::bit_cast<double>(n->payload) : 0.0;
}

std::string_view PickleGraph::text(NodeId id) const {
  if (id >= nodes_.size()) return {};
  const Node& n = nodes_[id];
  if (n.kind != Kind::kString && n.kind != Kind::kBytes && n.kind != Kind::kBigInt) return {};
  return Text({n.payload, n.index});
}

std::string_view PickleGraph::module(NodeId id) const {
  const Node* n = Find(id, Kind::kGlobal);
  return n != nullptr ? Text(globals_[n->index].module) : std::string_view();
}

std::string_view PickleGraph::name(NodeId id) const {
  const Node* n = Find(id, Kind::kGlobal);
  return n != nullptr ? Text(globals_[n->index].name) : std::string_view();
}

std::span<const NodeId> PickleGraph::items(NodeId id) const {
  if (id >= nodes_.size()) return {};
  const Node& n = nodes_[id];
  switch (n.kind) {
    case Kind::kTuple: return {items_.data() + n.payload, n.index};
    case Kind::kList:
    case Kind::kSet: return ItemsOf(n.index);
    default: return {};
  }
}

std::span<const std::pair<NodeId, NodeId>> PickleGraph::dict_items(NodeId id) const {
  const Node* n = Find(id, Kind::kDict);
  return n != nullptr ? PairsOf(n->index) : std::span<const std::pair<NodeId, NodeId>>();
}

bool PickleGraph::ordered(NodeId id) const {
  const Node* n = Find(id, Kind::kDict);
  return n != nullptr && (n->flags & kOrderedFlag) != 0;
}

NodeId PickleGraph::state(NodeId id) const {
  if (id >= nodes_.size()) return kNoNode;
  const Node& n = nodes_[id];
  switch (n.kind) {
    case Kind::kObject: return objects_[n.index].state;
    case Kind::kDict: return static_cast<NodeId>(n.payload);
    case Kind::kTensor: return tensors_[n.index].state;
    case Kind::kStorage: return storages_[n.index].state;
    case Kind::kPersistentId: return n.index;
    default: return kNoNode;
  }
}

NodeId PickleGraph::persistent_id(NodeId id) const {
  const Node* n = Find(id, Kind::kPersistentId);
  return n != nullptr ? static_cast<NodeId>(n->payload) : kNoNode;
}

ObjectInfo PickleGraph::object(NodeId id) const {
  const Node* n = Find(id, Kind::kObject);
  if (n == nullptr) return {};
  const ObjectRecord& o = objects_[n->index];
  ObjectInfo info;
  info.callable = o.callable;
  info.args = o.args;
  info.kwargs = o.kwargs;
  info.state = o.state;
  info.newobj = (n->flags & kNewObjFlag) != 0;
  if (o.list_seq != kNoSeq) info.list_items = ItemsOf(o.list_seq);
  if (o.dict_seq != kNoSeq) info.dict_items = PairsOf(o.dict_seq);
  return info;
}

StorageInfo PickleGraph::storage(NodeId id) const {
  const Node* n = Find(id, Kind::kStorage);
  if (n == nullptr) return {};
  const StorageRecord& s = storages_[n->index];
  return {Text(s.key), Text(s.location), s.dtype, s.untyped, s.numel, s.state};
}

TensorInfo PickleGraph::tensor(NodeId id) const {
  const Node* n = Find(id, Kind::kTensor);
  if (n == nullptr) return {};
  const TensorRecord& t = tensors_[n->index];
  const int64_t* dims = dims_.data() + t.dims_offset;
  return {t.storage,
          t.dtype,
          t.storage_offset,
          {dims, t.ndim},
          {dims + t.ndim, t.ndim},
          t.requires_grad,
          t.is_parameter,
          t.state};
}

NodeId PickleGraph::DictGet(NodeId dict, std::string_view key) const {
  const auto items = dict_items(dict);
  // Later SETITEMs win, as in Python, so search from the back.
  for (auto it = items.rbegin(); it != items.rend(); ++it) {
    if (Find(it->first, Kind::kString) != nullptr && it->second < nodes_.size() &&
        text(it->first) == key) {
      return it->second;
    }
  }
  return kNoNode;
}

bool PickleGraph::IsGlobal(NodeId id, std::string_view module_name,
                           std::string_view global_name) const {
  return Find(id, Kind::kGlobal) != nullptr && module(id) == module_name &&
         name(id) == global_name;
}

std::string_view PickleGraph::ClassName(NodeId id) const {
  const Node* n = Find(id, Kind::kObject);
  if (n == nullptr) return {};
  return name(objects_[n->index].callable);
}

std::optional<int64_t> IntEnumValue(const PickleGraph& g, NodeId id, const IntEnumType& type) {
  if (g.kind(id) != Kind::kObject) return std::nullopt;
  const ObjectInfo o = g.object(id);
  if (o.newobj || g.kind(o.args) != Kind::kTuple || o.state != kNoNode) return std::nullopt;
  const std::span<const NodeId> args = g.items(o.args);
  if (g.IsGlobal(o.callable, type.module, type.name)) {
    // By value: Cls(value).
    if (args.size() != 1 || g.kind(args[0]) != Kind::kInt) return std::nullopt;
    for (const IntEnumMember& m : type.members) {
      if (m.value == g.int_value(args[0])) return m.value;
    }
    return std::nullopt;
  }
  if (g.IsGlobal(o.callable, "builtins", "getattr")) {
    // By name: getattr(Cls, 'NAME'); only the known class and its members, nothing is looked up.
    if (args.size() != 2 || !g.IsGlobal(args[0], type.module, type.name) || g.kind(args[1]) != Kind::kString) {
      return std::nullopt;
    }
    for (const IntEnumMember& m : type.members) {
      if (m.name == g.text(args[1])) return m.value;
    }
  }
  return std::nullopt;
}

size_t PickleGraph::MemoryBytes() const {
  auto bytes = [](const auto& v) { return v.capacity() * sizeof(v[0]); };
  return sizeof(*this) + bytes(nodes_) + bytes(text_) + bytes(items_) + bytes(pairs_) +
         bytes(dims_) + bytes(seqs_) + bytes(globals_) + bytes(objects_) + bytes(storages_) +
         bytes(tensors_);
}

namespace {

// Opcodes (pickletools names).
enum Op : uint8_t {
  kMark = '(', kStop = '.', kPop = '0', kPopMark = '1', kDup = '2', kFloat = 'F', kInt = 'I',
  kBinInt = 'J', kBinInt1 = 'K', kLong = 'L', kBinInt2 = 'M', kNone = 'N', kPersId = 'P',
  kBinPersId = 'Q', kReduce = 'R', kString = 'S', kBinString = 'T', kShortBinString = 'U',
  kUnicode = 'V', kBinUnicode = 'X', kAppend = 'a', kBuild = 'b', kGlobal = 'c', kDict = 'd',
  kEmptyDict = '}', kAppends = 'e', kGet = 'g', kBinGet = 'h', kInst = 'i', kLongBinGet = 'j',
  kList = 'l', kEmptyList = ']', kObj = 'o', kPut = 'p', kBinPut = 'q', kLongBinPut = 'r',
  kSetItem = 's', kTuple = 't', kEmptyTuple = ')', kSetItems = 'u', kBinFloat = 'G',
  kProto = 0x80, kNewObj = 0x81, kExt1 = 0x82, kExt2 = 0x83, kExt4 = 0x84, kTuple1 = 0x85,
  kTuple2 = 0x86, kTuple3 = 0x87, kNewTrue = 0x88, kNewFalse = 0x89, kLong1 = 0x8a,
  kLong4 = 0x8b, kBinBytes = 'B', kShortBinBytes = 'C', kShortBinUnicode = 0x8c,
  kBinUnicode8 = 0x8d, kBinBytes8 = 0x8e, kEmptySet = 0x8f, kAddItems = 0x90,
  kFrozenSet = 0x91, kNewObjEx = 0x92, kStackGlobal = 0x93, kMemoize = 0x94, kFrame = 0x95,
  kByteArray8 = 0x96, kNextBuffer = 0x97, kReadonlyBuffer = 0x98,
};

const char* OpName(uint8_t op) {
  switch (op) {
    case kMark: return "MARK";
    case kStop: return "STOP";
    case kPop: return "POP";
    case kPopMark: return "POP_MARK";
    case kDup: return "DUP";
    case kFloat: return "FLOAT";
    case kInt: return "INT";
    case kBinInt: return "BININT";
    case kBinInt1: return "BININT1";
    case kLong: return "LONG";
    case kBinInt2: return "BININT2";
    case kNone: return "NONE";
    case kPersId: return "PERSID";
    case kBinPersId: return "BINPERSID";
    case kReduce: return "REDUCE";
    case kString: return "STRING";
    case kBinString: return "BINSTRING";
    case kShortBinString: return "SHORT_BINSTRING";
    case kUnicode: return "UNICODE";
    case kBinUnicode: return "BINUNICODE";
    case kAppend: return "APPEND";
    case kBuild: return "BUILD";
    case kGlobal: return "GLOBAL";
    case kDict: return "DICT";
    case kEmptyDict: return "EMPTY_DICT";
    case kAppends: return "APPENDS";
    case kGet: return "GET";
    case kBinGet: return "BINGET";
    case kInst: return "INST";
    case kLongBinGet: return "LONG_BINGET";
    case kList: return "LIST";
    case kEmptyList: return "EMPTY_LIST";
    case kObj: return "OBJ";
    case kPut: return "PUT";
    case kBinPut: return "BINPUT";
    case kLongBinPut: return "LONG_BINPUT";
    case kSetItem: return "SETITEM";
    case kTuple: return "TUPLE";
    case kEmptyTuple: return "EMPTY_TUPLE";
    case kSetItems: return "SETITEMS";
    case kBinFloat: return "BINFLOAT";
    case kProto: return "PROTO";
    case kNewObj: return "NEWOBJ";
    case kExt1: return "EXT1";
    case kExt2: return "EXT2";
    case kExt4: return "EXT4";
    case kTuple1: return "TUPLE1";
    case kTuple2: return "TUPLE2";
    case kTuple3: return "TUPLE3";
    case kNewTrue: return "NEWTRUE";
    case kNewFalse: return "NEWFALSE";
    case kLong1: return "LONG1";
    case kLong4: return "LONG4";
    case kBinBytes: return "BINBYTES";
    case kShortBinBytes: return "SHORT_BINBYTES";
    case kShortBinUnicode: return "SHORT_BINUNICODE";
    case kBinUnicode8: return "BINUNICODE8";
    case kBinBytes8: return "BINBYTES8";
    case kEmptySet: return "EMPTY_SET";
    case kAddItems: return "ADDITEMS";
    case kFrozenSet: return "FROZENSET";
    case kNewObjEx: return "NEWOBJ_EX";
    case kStackGlobal: return "STACK_GLOBAL";
    case kMemoize: return "MEMOIZE";
    case kFrame: return "FRAME";
    case kByteArray8: return "BYTEARRAY8";
    case kNextBuffer: return "NEXT_BUFFER";
    case kReadonlyBuffer: return "READONLY_BUFFER";
    default: return nullptr;
  }
}

// Python 3.11+ refuses int(str) beyond this many digits; a longer decimal is not a real pickle
// and the quadratic conversion below must stay bounded.
constexpr size_t kMaxDecimalDigits = 4300;

// Callables the reader interprets structurally (see pickle.h).
enum class Known {
  kNone, kOrderedDict, kRebuildTensor, kRebuildTensorV2, kRebuildTensorV3, kRebuildParameter,
  kRebuildParameterWithState, kRebuildFromTypeV2, kTorchSize, kCodecsEncode, kByteArray,
  kBytes, kSet, kFrozenSet, kReconstructor,
};

Known Classify(std::string_view m, std::string_view f) {
  if (m == "torch._utils") {
    if (f == "_rebuild_tensor_v2") return Known::kRebuildTensorV2;
    if (f == "_rebuild_tensor_v3") return Known::kRebuildTensorV3;
    if (f == "_rebuild_tensor") return Known::kRebuildTensor;
    if (f == "_rebuild_parameter") return Known::kRebuildParameter;
    if (f == "_rebuild_parameter_with_state") return Known::kRebuildParameterWithState;
  } else if (m == "torch._tensor") {
    if (f == "_rebuild_from_type_v2") return Known::kRebuildFromTypeV2;
  } else if (m == "torch") {
    if (f == "Size") return Known::kTorchSize;
  } else if (m == "collections") {
    if (f == "OrderedDict") return Known::kOrderedDict;
  } else if (m == "_codecs") {
    if (f == "encode") return Known::kCodecsEncode;
  } else if (m == "builtins") {
    if (f == "bytearray") return Known::kByteArray;
    if (f == "bytes") return Known::kBytes;
    if (f == "set") return Known::kSet;
    if (f == "frozenset") return Known::kFrozenSet;
  } else if (m == "copyreg") {
    if (f == "_reconstructor") return Known::kReconstructor;
  }
  return Known::kNone;
}

bool IsTensorRebuild(Known k) {
  return k == Known::kRebuildTensor || k == Known::kRebuildTensorV2 ||
         k == Known::kRebuildTensorV3;
}

// Python 2 -> 3 names (a subset of CPython's _compat_pickle that covers what checkpoints use).
// The replacements are string literals, so a caller can tell a mapped name by its address.
void MapPython2Name(std::string_view& module, std::string_view& name) {
  struct NamePair { std::string_view from_module, from_name, to_module, to_name; };
  static constexpr NamePair kNames[] = {
      {"__builtin__", "xrange", "builtins", "range"},
      {"__builtin__", "reduce", "functools", "reduce"},
      {"__builtin__", "intern", "sys", "intern"},
      {"__builtin__", "unichr", "builtins", "chr"},
      {"__builtin__", "unicode", "builtins", "str"},
      {"__builtin__", "long", "builtins", "int"},
      {"__builtin__", "basestring", "builtins", "str"},
      {"itertools", "izip", "builtins", "zip"},
      {"itertools", "imap", "builtins", "map"},
      {"itertools", "ifilter", "builtins", "filter"},
      {"UserDict", "IterableUserDict", "collections", "UserDict"},
      {"exceptions", "StandardError", "builtins", "Exception"},
  };
  for (const auto& p : kNames) {
    if (module == p.from_module && name == p.from_name) {
      module = p.to_module;
      name = p.to_name;
      return;
    }
  }
  struct ModulePair { std::string_view from, to; };
  static constexpr ModulePair kModules[] = {
      {"__builtin__", "builtins"}, {"copy_reg", "copyreg"}, {"exceptions", "builtins"},
      {"Queue", "queue"},          {"repr", "reprlib"},     {"cPickle", "pickle"},
      {"StringIO", "io"},          {"cStringIO", "io"},     {"UserDict", "collections"},
      {"UserList", "collections"}, {"UserString", "collections"},
      {"_abcoll", "collections.abc"},
  };
  for (const auto& p : kModules) {
    if (module == p.from) {
      module = p.to;
      return;
    }
  }
}

std::string_view Trim(std::string_view s) {
  auto space = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n' ||
                                   c == '\f' || c == '\v'; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

void AppendUtf8(std::string& out, uint32_t cp) {
  // Surrogates are written as their 3-byte form (Python's "surrogatepass"), matching how
  // BINUNICODE stores them.
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Decodes UTF-8 (surrogates allowed) into code points below `max_cp` as bytes. False when the
// text is not UTF-8 or holds a larger code point (Python would raise UnicodeEncodeError).
bool EncodeAsSingleBytes(std::string_view in, uint32_t max_cp, std::string& out) {
  out.clear();
  out.reserve(in.size());
  size_t i = 0;
  while (i < in.size()) {
    const auto b0 = static_cast<uint8_t>(in[i]);
    uint32_t cp;
    size_t len;
    if (b0 < 0x80) {
      cp = b0;
      len = 1;
    } else if ((b0 & 0xE0) == 0xC0) {
      cp = b0 & 0x1Fu;
      len = 2;
    } else if ((b0 & 0xF0) == 0xE0) {
      cp = b0 & 0x0Fu;
      len = 3;
    } else if ((b0 & 0xF8) == 0xF0) {
      cp = b0 & 0x07u;
      len = 4;
    } else {
      return false;
    }
    if (len > in.size() - i) return false;
    for (size_t k = 1; k < len; ++k) {
      const auto b = static_cast<uint8_t>(in[i + k]);
      if ((b & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (b & 0x3Fu);
    }
    if (cp > max_cp) return false;
    out.push_back(static_cast<char>(cp));
    i += len;
  }
  return true;
}

// Python's escape_decode (protocol-0 STRING). False on a malformed escape.
bool EscapeDecode(std::string_view in, std::string& out) {
  out.clear();
  out.reserve(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    char c = in[i];
    if (c != '\\') {
      out.push_back(c);
      continue;
    }
    if (++i >= in.size()) return false;  // trailing backslash
    c = in[i];
    switch (c) {
      case '\n': break;  // line continuation
      case '\\': out.push_back('\\'); break;
      case '\'': out.push_back('\''); break;
      case '"': out.push_back('"'); break;
      case 'a': out.push_back('\a'); break;
      case 'b': out.push_back('\b'); break;
      case 'f': out.push_back('\f'); break;
      case 'n': out.push_back('\n'); break;
      case 'r': out.push_back('\r'); break;
      case 't': out.push_back('\t'); break;
      case 'v': out.push_back('\v'); break;
      case 'x': {
        if (in.size() - i < 3) return false;
        int hi = HexValue(in[i + 1]);
        int lo = HexValue(in[i + 2]);
        if (hi < 0 || lo < 0) return false;
        out.push_back(static_cast<char>(hi * 16 + lo));
        i += 2;
        break;
      }
      default:
        if (c >= '0' && c <= '7') {
          int v = c - '0';
          for (int k = 0; k < 2 && i + 1 < in.size() && in[i + 1] >= '0' && in[i + 1] <= '7';
               ++k) {
            v = v * 8 + (in[++i] - '0');
          }
          out.push_back(static_cast<char>(v & 0xFF));
        } else {
          out.push_back('\\');  // unknown escapes are kept verbatim
          out.push_back(c);
        }
    }
  }
  return true;
}

// Python's raw-unicode-escape decoding (protocol-0 UNICODE), producing UTF-8.
bool RawUnicodeEscapeDecode(std::string_view in, std::string& out) {
  out.clear();
  out.reserve(in.size());
  size_t i = 0;
  while (i < in.size()) {
    const auto c = static_cast<uint8_t>(in[i]);
    if (c != '\\') {
      AppendUtf8(out, c);  // latin-1
      ++i;
      continue;
    }
    // \u and \U escapes count only after an odd number of backslashes.
    size_t run = 0;
    while (i < in.size() && in[i] == '\\') {
      out.push_back('\\');
      ++run;
      ++i;
    }
    if ((run & 1) == 0 || i >= in.size() || (in[i] != 'u' && in[i] != 'U')) continue;
    out.pop_back();
    const size_t digits = in[i] == 'u' ? 4 : 8;
    ++i;
    if (in.size() - i < digits) return false;
    uint32_t cp = 0;
    for (size_t k = 0; k < digits; ++k) {
      int h = HexValue(in[i + k]);
      if (h < 0) return false;
      cp = cp * 16 + static_cast<uint32_t>(h);
    }
    if (cp > 0x10FFFF) return false;
    AppendUtf8(out, cp);
    i += digits;
  }
  return true;
}

// Minimal two's complement little-endian bytes of -(magnitude) or +magnitude, the way Python's
// encode_long writes them. `mag` is little-endian and trimmed (no high zero bytes), non-empty.
std::string TwosComplement(const std::vector<uint8_t>& mag, bool negative) {
  std::string out(mag.size(), '\0');
  if (!negative) {
    for (size_t i = 0; i < mag.size(); ++i) out[i] = static_cast<char>(mag[i]);
    if (mag.back() & 0x80) out.push_back('\0');
    return out;
  }
  unsigned carry = 1;
  for (size_t i = 0; i < mag.size(); ++i) {
    unsigned v = static_cast<uint8_t>(~mag[i]) + carry;
    out[i] = static_cast<char>(v & 0xFF);
    carry = v >> 8;
  }
  if (!(static_cast<uint8_t>(out.back()) & 0x80)) out.push_back('\xff');
  return out;
}

struct Estimate {
  uint64_t nodes = 0;       // opcodes that create a node
  uint64_t text_bytes = 0;  // bytes of strings, bytes and names
};

// A quick pass over the opcodes counting those that create a node (ints and None/True/False
// excluded: they are shared) and the bytes of text they carry. Used only to size the node
// vector and the text arena (both bounded by the input size); it stops at STOP or at the first
// opcode it cannot step over, which the real parse then reports.
Estimate EstimateSizes(const uint8_t* p, size_t size) {
  size_t pos = 0;
  Estimate e;
  uint64_t& count = e.nodes;
  auto skip = [&](uint64_t n) {
    if (n > size - pos) return false;
    pos += static_cast<size_t>(n);
    return true;
  };
  auto line = [&](bool is_text) {
    const void* nl = std::memchr(p + pos, '\n', size - pos);
    if (nl == nullptr) return false;
    const size_t end = static_cast<size_t>(static_cast<const uint8_t*>(nl) - p);
    if (is_text) e.text_bytes += end - pos;
    pos = end + 1;
    return true;
  };
  auto payload = [&](int width, bool is_text) {
    if (static_cast<size_t>(width) > size - pos) return false;
    uint64_t n = 0;
    for (int i = width - 1; i >= 0; --i) n = (n << 8) | p[pos + static_cast<size_t>(i)];
    pos += static_cast<size_t>(width);
    if (!skip(n)) return false;
    if (is_text) e.text_bytes += n;
    return true;
  };
  while (pos < size) {
    const uint8_t op = p[pos++];
    bool ok = true;
    switch (op) {
      case kStop: return e;
      case kMark: case kPop: case kPopMark: case kDup: case kNone: case kNewTrue:
      case kNewFalse: case kAppend: case kAppends: case kSetItem: case kSetItems:
      case kAddItems: case kBuild: case kMemoize:
        break;
      case kEmptyTuple: case kTuple: case kTuple1: case kTuple2: case kTuple3:
      case kEmptyList: case kList: case kEmptyDict: case kDict: case kEmptySet:
      case kFrozenSet: case kStackGlobal: case kReduce: case kNewObj: case kNewObjEx:
      case kBinPersId:
        ++count;
        break;
      case kObj: count += 2; break;
      case kProto: case kBinGet: case kBinPut: case kBinInt1: ok = skip(1); break;
      case kBinInt2: ok = skip(2); break;
      case kBinInt: case kLongBinGet: case kLongBinPut: ok = skip(4); break;
      case kFrame: ok = skip(8); break;
      case kBinFloat: ++count; ok = skip(8); break;
      case kPut: case kGet: ok = line(false); break;
      case kInt: case kLong: case kFloat: ++count; ok = line(false); break;
      case kString: case kUnicode: ++count; ok = line(true); break;
      case kPersId: count += 2; ok = line(true); break;
      case kGlobal: ++count; ok = line(true) && line(true); break;
      case kInst: count += 3; ok = line(true) && line(true); break;
      case kShortBinString: case kShortBinUnicode: case kShortBinBytes:
        ++count;
        ok = payload(1, true);
        break;
      case kLong1: ++count; ok = payload(1, false); break;
      case kBinString: case kBinUnicode: case kBinBytes:
        ++count;
        ok = payload(4, true);
        break;
      case kLong4: ++count; ok = payload(4, false); break;
      case kBinUnicode8: case kBinBytes8: case kByteArray8:
        ++count;
        ok = payload(8, true);
        break;
      default: return e;
    }
    if (!ok) return e;
  }
  return e;
}

}  // namespace

class PickleGraph::Parser {
 public:
  Parser(std::span<const std::byte> data, std::string_view source, const PickleLimits& limits,
         PickleGraph& graph)
      : data_(reinterpret_cast<const uint8_t*>(data.data())),
        size_(data.size()),
        source_(source),
        limits_(limits),
        g_(graph),
        nodes_(graph.nodes_) {
    small_ints_.fill(kNoNode);
    copy_budget_ = 4 * static_cast<uint64_t>(size_) + (uint64_t{1} << 20);
    // NodeIds are 32-bit and kNoNode is reserved; text lengths are 32-bit.
    max_nodes_ = limits_.max_nodes < kNoNode ? limits_.max_nodes : uint64_t{kNoNode};
    max_string_bytes_ = std::min<uint64_t>(limits_.max_string_bytes, kMaxTextBytes);
    // Size the node and text tables once: regrowing a large vector costs time and raises peak
    // memory by half. The estimate counts opcodes that create a node (at most one per input
    // byte, and capped by max_nodes); interned ints are not counted, the 1/8 slack covers them.
    const Estimate e = EstimateSizes(data_, size_);
    uint64_t guess = e.nodes + e.nodes / 8 + 16;
    if (guess > max_nodes_) guess = max_nodes_;
    nodes_.reserve(static_cast<size_t>(guess));
    g_.text_.reserve(static_cast<size_t>(e.text_bytes));
  }

  Status Run();
  // After Run failed: whether it failed because the input ended before STOP (more bytes of the
  // same stream might parse), not on a byte it could read.
  bool ran_out() const { return ran_out_; }

 private:
  bool ran_out_ = false;
  // ---- errors ----
  Status Error(StatusCode code, std::string_view reason) const {
    std::string msg;
    msg.reserve(source_.size() + reason.size() + 48);
    msg.append(source_).append(": pickle offset ").append(std::to_string(op_offset_));
    msg.append(": ");
    const char* name = OpName(op_);
    if (name != nullptr) {
      msg.append(name);
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      msg.append("opcode 0x").push_back(kHex[op_ >> 4]);
      msg.push_back(kHex[op_ & 15]);
    }
    msg.append(": ").append(reason);
    return Status(code, std::move(msg));
  }
  Status Corrupt(std::string_view reason) const { return Error(StatusCode::kCorrupt, reason); }
  Status Exhausted(std::string_view reason) const {
    return Error(StatusCode::kResourceExhausted, reason);
  }

  // ---- input ----
  uint64_t Left() const { return size_ - pos_; }
  Status Truncated(uint64_t need) {
    ran_out_ = true;
    return Corrupt("truncated: needs " + std::to_string(need) + " bytes, " +
                   std::to_string(Left()) + " left");
  }
  Status ReadBytes(uint64_t n, const uint8_t** out) {
    if (n > Left()) return Truncated(n);
    *out = data_ + pos_;
    pos_ += static_cast<size_t>(n);
    return Status::Ok();
  }
  // Little-endian unsigned integer of `n` bytes.
  Status ReadUnsigned(int n, uint64_t* out) {
    const uint8_t* p = nullptr;
    UCPFS_RETURN_IF_ERROR(ReadBytes(static_cast<uint64_t>(n), &p));
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
    *out = v;
    return Status::Ok();
  }
  Status ReadLine(std::string_view* line) {
    const void* nl = std::memchr(data_ + pos_, '\n', size_ - pos_);
    if (nl == nullptr) {
      ran_out_ = true;
      return Corrupt("truncated: line has no newline");
    }
    const auto* end = static_cast<const uint8_t*>(nl);
    if (static_cast<uint64_t>(end - (data_ + pos_)) > max_string_bytes_) {
      return Exhausted("line longer than max_string_bytes");
    }
    *line = std::string_view(reinterpret_cast<const char*>(data_ + pos_),
                             static_cast<size_t>(end - (data_ + pos_)));
    pos_ = static_cast<size_t>(end - data_) + 1;
    return Status::Ok();
  }
  // Length-prefixed payload: the length is checked against the input, then the limit.
  Status ReadPayload(uint64_t n, std::string_view* out) {
    if (n > Left()) return Truncated(n);
    if (n > max_string_bytes_) {
      return Exhausted("string of " + std::to_string(n) + " bytes exceeds max_string_bytes");
    }
    const uint8_t* p = nullptr;
    UCPFS_RETURN_IF_ERROR(ReadBytes(n, &p));
    *out = std::string_view(reinterpret_cast<const char*>(p), static_cast<size_t>(n));
    return Status::Ok();
  }

  // Interpreting a value may copy data that the input holds only once (a memoized tuple used
  // as the shape of many tensors, a string used as many globals' names). Copies are charged
  // against a budget proportional to the input so that they cannot amplify it without bound.
  // (Immutable text is shared rather than copied now, but it is still charged, so the limit
  // reads the same whatever the representation.)
  Status Charge(uint64_t units) {
    const auto total = CheckedAdd(copied_, units);
    copied_ = total ? *total : UINT64_MAX;
    if (copied_ > copy_budget_) {
      return Exhausted("interpreted values copy more than " + std::to_string(copy_budget_) +
                       " elements or bytes");
    }
    return Status::Ok();
  }

  // ---- nodes ----
  Node& At(NodeId id) { return nodes_[id]; }
  Kind KindOf(NodeId id) const { return nodes_[id].kind; }
  Status NewNode(Kind kind, NodeId* id) {
    if (nodes_.size() >= max_nodes_) {
      return Exhausted("more than " + std::to_string(max_nodes_) + " nodes (max_nodes)");
    }
    *id = static_cast<NodeId>(nodes_.size());
    nodes_.emplace_back();
    nodes_.back().kind = kind;
    switch (kind) {
      case Kind::kDict: nodes_.back().payload = kNoNode; break;        // state
      case Kind::kPersistentId: nodes_.back().index = kNoNode; break;  // state
      default: break;
    }
    return Status::Ok();
  }

  // ---- text ----
  // Copies `s` (which must not point into the arena) to the end of the text arena. Every text
  // is at most max_string_bytes_ long, or derived from one that is.
  TextRef AddText(std::string_view s) {
    auto& text = g_.text_;
    TextRef ref{text.size(), s.size()};
    text.insert(text.end(), s.begin(), s.end());
    return ref;
  }
  // The arena range of a kString/kBytes/kBigInt node `id`, to share it: text is immutable.
  TextRef RefOf(NodeId id) const {
    const std::string_view t = g_.text(id);
    return {static_cast<uint64_t>(t.data() - g_.text_.data()), t.size()};
  }
  std::string_view TextOf(NodeId id) const { return g_.text(id); }
  void SetText(NodeId id, TextRef ref) {
    At(id).payload = ref.offset;
    At(id).index = static_cast<uint32_t>(ref.n_bytes);  // <= kMaxTextBytes
  }
  // A text node holding a copy of `text` (which must not point into the arena).
  Status NewTextNode(Kind kind, std::string_view text, NodeId* id) {
    UCPFS_RETURN_IF_ERROR(NewNode(kind, id));
    SetText(*id, AddText(text));
    return Status::Ok();
  }
  // A text node sharing the arena range `ref` of another text node.
  Status NewSharedTextNode(Kind kind, TextRef ref, NodeId* id) {
    UCPFS_RETURN_IF_ERROR(NewNode(kind, id));
    SetText(*id, ref);
    return Status::Ok();
  }

  // ---- items ----
  // One container holds at most 2^32-1 items (counts are 32-bit).
  Status CheckCount(uint64_t n) const {
    if (n > kMaxItems) {
      return Exhausted("more than " + std::to_string(kMaxItems) + " items in one container");
    }
    return Status::Ok();
  }
  // A kTuple of the ids [first, first + n), which must not point into items_.
  Status NewTuple(const NodeId* first, size_t n, NodeId* id) {
    UCPFS_RETURN_IF_ERROR(NewNode(Kind::kTuple, id));
    UCPFS_RETURN_IF_ERROR(CheckCount(n));
    auto& items = g_.items_;
    At(*id).payload = items.size();
    At(*id).index = static_cast<uint32_t>(n);
    items.insert(items.end(), first, first + n);
    return Status::Ok();
  }
  // A kTuple or kSet holding a copy of the items of `from` (a Tuple, List or Set).
  Status NewCopy(Kind kind, NodeId from, NodeId* id) {
    const auto src = g_.items(from);
    const uint64_t src_offset = static_cast<uint64_t>(src.data() - g_.items_.data());
    const size_t n = src.size();
    if (kind == Kind::kTuple) {
      UCPFS_RETURN_IF_ERROR(NewNode(Kind::kTuple, id));
      At(*id).payload = g_.items_.size();
      At(*id).index = static_cast<uint32_t>(n);
      g_.items_.resize(g_.items_.size() + n);
    } else {
      UCPFS_RETURN_IF_ERROR(NewContainer(kind, id));
      UCPFS_RETURN_IF_ERROR(Grow(g_.items_, g_.seqs_[At(*id).index], n));
      g_.seqs_[At(*id).index].count = static_cast<uint32_t>(n);
    }
    // Copy by index: the resize above may have moved the pool.
    const uint64_t dst = kind == Kind::kTuple ? At(*id).payload : g_.seqs_[At(*id).index].offset;
    std::copy_n(g_.items_.begin() + static_cast<std::ptrdiff_t>(src_offset), n,
                g_.items_.begin() + static_cast<std::ptrdiff_t>(dst));
    return Status::Ok();
  }
  Status NewSeq(size_t pool_size, uint32_t* seq) {
    if (g_.seqs_.size() >= kNoSeq) {
      return Exhausted("more than " + std::to_string(kNoSeq) + " growable containers");
    }
    *seq = static_cast<uint32_t>(g_.seqs_.size());
    // Starting at the pool's end lets the first appends extend it in place.
    g_.seqs_.push_back({pool_size, 0, 0});
    return Status::Ok();
  }
  // A kList, kSet or kDict: the node plus its growable range.
  Status NewContainer(Kind kind, NodeId* id) {
    UCPFS_RETURN_IF_ERROR(NewNode(kind, id));
    uint32_t seq = kNoSeq;
    UCPFS_RETURN_IF_ERROR(
        NewSeq(kind == Kind::kDict ? g_.pairs_.size() : g_.items_.size(), &seq));
    At(*id).index = seq;
    return Status::Ok();
  }
  // Makes room in `s` for `add` more entries. Containers are filled after creation (APPEND,
  // SETITEMS in batches of 1000 interleaved with building the values), so a range that is no
  // longer the newest in its pool moves to the end with double the room: appends copy O(n)
  // entries in all, and the space left behind is at most the final capacity.
  template <typename T>
  Status Grow(std::vector<T>& pool, Seq& s, uint64_t add) {
    const uint64_t need = uint64_t{s.count} + add;
    UCPFS_RETURN_IF_ERROR(CheckCount(need));
    if (need <= s.capacity) return Status::Ok();
    if (s.offset + s.capacity == pool.size()) {
      pool.resize(static_cast<size_t>(s.offset + need));  // the newest range grows in place
    } else {
      uint64_t capacity = 2 * uint64_t{s.count};
      if (capacity < need) capacity = need;
      if (capacity > kMaxItems) capacity = kMaxItems;
      const size_t dst = pool.size();
      pool.resize(dst + static_cast<size_t>(capacity));
      std::copy_n(pool.begin() + static_cast<std::ptrdiff_t>(s.offset), s.count,
                  pool.begin() + static_cast<std::ptrdiff_t>(dst));
      s.offset = dst;
      s.capacity = static_cast<uint32_t>(capacity);
      return Status::Ok();
    }
    s.capacity = static_cast<uint32_t>(need);
    return Status::Ok();
  }
  // Appends stack_[from, end) to the item range `seq`.
  Status AppendItems(uint32_t seq, size_t from) {
    const size_t n = stack_.size() - from;
    Seq& s = g_.seqs_[seq];
    UCPFS_RETURN_IF_ERROR(Grow(g_.items_, s, n));
    std::copy(stack_.begin() + static_cast<std::ptrdiff_t>(from), stack_.end(),
              g_.items_.begin() + static_cast<std::ptrdiff_t>(s.offset + s.count));
    s.count += static_cast<uint32_t>(n);
    return Status::Ok();
  }
  // Appends the key/value pairs stack_[from, end) (an even count) to the pair range `seq`.
  Status AppendPairs(uint32_t seq, size_t from) {
    const size_t n = (stack_.size() - from) / 2;
    Seq& s = g_.seqs_[seq];
    UCPFS_RETURN_IF_ERROR(Grow(g_.pairs_, s, n));
    auto out = g_.pairs_.begin() + static_cast<std::ptrdiff_t>(s.offset + s.count);
    for (size_t i = from; i < stack_.size(); i += 2) *out++ = {stack_[i], stack_[i + 1]};
    s.count += static_cast<uint32_t>(n);
    return Status::Ok();
  }
  // The list (APPEND/ADDITEMS) or dict (SETITEM) range of an Object, created on first use.
  Status ObjectSeq(NodeId object, bool dict, uint32_t* seq) {
    const uint32_t rec = At(object).index;
    uint32_t s = dict ? g_.objects_[rec].dict_seq : g_.objects_[rec].list_seq;
    if (s == kNoSeq) {
      UCPFS_RETURN_IF_ERROR(NewSeq(dict ? g_.pairs_.size() : g_.items_.size(), &s));
      (dict ? g_.objects_[rec].dict_seq : g_.objects_[rec].list_seq) = s;
    }
    *seq = s;
    return Status::Ok();
  }
  Status NewObject(NodeId callable, NodeId args, NodeId kwargs, bool newobj, NodeId* id) {
    UCPFS_RETURN_IF_ERROR(NewNode(Kind::kObject, id));
    At(*id).index = static_cast<uint32_t>(g_.objects_.size());
    if (newobj) At(*id).flags = kNewObjFlag;
    ObjectRecord& o = g_.objects_.emplace_back();
    o.callable = callable;
    o.args = args;
    o.kwargs = kwargs;
    return Status::Ok();
  }

  // ---- stack ----
  size_t Fence() const { return marks_.empty() ? 0 : marks_.back(); }
  size_t Avail() const { return stack_.size() - Fence(); }
  Status NeedStack(size_t n) const {
    if (Avail() < n) return Corrupt("stack underflow");
    return Status::Ok();
  }
  Status Push(NodeId id) {
    if (stack_.size() >= limits_.max_stack) {
      return Exhausted("more than " + std::to_string(limits_.max_stack) +
                       " values on the stack (max_stack)");
    }
    stack_.push_back(id);
    return Status::Ok();
  }
  NodeId Pop() {
    NodeId id = stack_.back();
    stack_.pop_back();
    return id;
  }
  Status PushNew(Kind kind, NodeId* id) {
    UCPFS_RETURN_IF_ERROR(NewNode(kind, id));
    return Push(*id);
  }
  Status PushNewContainer(Kind kind) {
    NodeId id = kNoNode;
    UCPFS_RETURN_IF_ERROR(NewContainer(kind, &id));
    return Push(id);
  }
  // Pops the newest MARK; the values above it are stack_[*mark, end).
  Status PopMark(size_t* mark) {
    if (marks_.empty()) return Corrupt("no MARK on the stack");
    *mark = marks_.back();
    marks_.pop_back();
    return Status::Ok();
  }
  // None/True/False are immutable singletons in Python too; sharing them keeps node counts low.
  Status PushSingleton(NodeId* slot, Kind kind, bool value) {
    if (*slot == kNoNode) {
      NodeId id = kNoNode;
      UCPFS_RETURN_IF_ERROR(NewNode(kind, &id));
      At(id).payload = value ? 1 : 0;
      *slot = id;
    }
    return Push(*slot);
  }
  // Ints are immutable and pickles never memoize them, so equal ints share one node: in DCP
  // metadata (shapes, offsets, lengths) this removes about a third of all nodes.
  Status PushInt(int64_t v) {
    NodeId* slot;
    if (v >= 0 && v < static_cast<int64_t>(kSmallInts)) {
      slot = &small_ints_[static_cast<size_t>(v)];
    } else {
      slot = &ints_.try_emplace(v, kNoNode).first->second;
    }
    if (*slot == kNoNode) {
      NodeId id = kNoNode;
      UCPFS_RETURN_IF_ERROR(NewNode(Kind::kInt, &id));
      At(id).payload = static_cast<uint64_t>(v);
      *slot = id;
    }
    return Push(*slot);
  }
  Status PushFloat(double v) {
    NodeId id = kNoNode;
    UCPFS_RETURN_IF_ERROR(PushNew(Kind::kFloat, &id));
    At(id).payload = std::bit_cast<uint64_t>(v);
    return Status::Ok();
  }
  // `text` must not point into the arena.
  Status PushText(Kind kind, std::string_view text) {
    NodeId id = kNoNode;
    UCPFS_RETURN_IF_ERROR(NewTextNode(kind, text, &id));
    return Push(id);
  }
  Status PushDecodedText(Kind kind, const std::string& text) {
    if (text.size() > max_string_bytes_) {
      return Exhausted("string of " + std::to_string(text.size()) +
                       " bytes exceeds max_string_bytes");
    }
    return PushText(kind, text);
  }
  // Two's complement little-endian integer bytes (LONG1/LONG4).
  Status PushLongBytes(std::string_view bytes) {
    const size_t n = bytes.size();
    if (n == 0) return PushInt(0);
    const auto b = [&](size_t i) { return static_cast<uint8_t>(bytes[i]); };
    const size_t low = n < 8 ? n : 8;
    const uint8_t sign = (b(low - 1) & 0x80) ? 0xFF : 0x00;
    bool fits = true;
    for (size_t i = 8; i < n; ++i) {
      if (b(i) != sign) {
        fits = false;
        break;
      }
    }
    if (fits) {
      uint64_t v = sign ? ~uint64_t{0} : 0;
      for (size_t i = 0; i < low; ++i) {
        v &= ~(uint64_t{0xFF} << (8 * i));
        v |= uint64_t{b(i)} << (8 * i);
      }
      return PushInt(static_cast<int64_t>(v));
    }
    return PushText(Kind::kBigInt, bytes);
  }
  // Decimal text (INT/LONG of protocol 0).
  Status PushDecimal(std::string_view s) {
    s = Trim(s);
    bool negative = false;
    if (!s.empty() && (s[0] == '-' || s[0] == '+')) {
      negative = s[0] == '-';
      s.remove_prefix(1);
    }
    if (s.empty()) return Corrupt("integer has no digits");
    if (s.size() > kMaxDecimalDigits) {
      return Exhausted("integer longer than " + std::to_string(kMaxDecimalDigits) + " digits");
    }
    // Base-1e9 chunks into 32-bit little-endian limbs (digits are bounded above, so this
    // quadratic loop is too).
    std::vector<uint32_t> limbs;
    uint32_t chunk = 0;
    uint32_t scale = 1;
    size_t digits = 0;
    auto flush = [&]() {
      uint64_t carry = chunk;
      for (auto& limb : limbs) {
        const uint64_t v = uint64_t{limb} * scale + carry;
        limb = static_cast<uint32_t>(v);
        carry = v >> 32;
      }
      if (carry != 0) limbs.push_back(static_cast<uint32_t>(carry));
      chunk = 0;
      scale = 1;
    };
    for (char c : s) {
      if (c == '_') continue;
      if (c < '0' || c > '9') return Corrupt("invalid decimal integer");
      chunk = chunk * 10 + static_cast<uint32_t>(c - '0');
      scale *= 10;
      ++digits;
      if (scale == 1000000000u) flush();
    }
    if (digits == 0) return Corrupt("integer has no digits");
    if (scale != 1) flush();
    std::vector<uint8_t> mag;  // little-endian magnitude, trimmed
    for (uint32_t limb : limbs) {
      for (int i = 0; i < 4; ++i) mag.push_back(static_cast<uint8_t>(limb >> (8 * i)));
    }
    while (!mag.empty() && mag.back() == 0) mag.pop_back();
    if (mag.size() <= 8) {
      uint64_t small = 0;
      for (size_t i = mag.size(); i-- > 0;) small = (small << 8) | mag[i];
      constexpr uint64_t kMaxPos = 0x7FFFFFFFFFFFFFFFull;
      if (!negative && small <= kMaxPos) return PushInt(static_cast<int64_t>(small));
      if (negative && small <= kMaxPos + 1) {
        return PushInt(static_cast<int64_t>(~small + 1));  // two's complement negation
      }
    }
    return PushText(Kind::kBigInt, TwosComplement(mag, negative));
  }
  Status ParseIndexLine(std::string_view line, uint64_t* out) {
    line = Trim(line);
    uint64_t v = 0;
    auto [end, ec] = std::from_chars(line.data(), line.data() + line.size(), v);
    if (line.empty() || ec != std::errc() || end != line.data() + line.size()) {
      return Corrupt("invalid memo index");
    }
    *out = v;
    return Status::Ok();
  }

  // ---- memo ----
  Status MemoPut(uint64_t index) {
    UCPFS_RETURN_IF_ERROR(NeedStack(1));
    if (index >= limits_.max_memo) {
      return Exhausted("memo index " + std::to_string(index) + " exceeds max_memo");
    }
    const NodeId value = stack_.back();
    if (index < memo_dense_.size()) {
      if (memo_dense_[index] == kNoNode) {
        if (!memo_sparse_.empty() && memo_sparse_.erase(index) > 0) {
          --memo_count_;
        }
        UCPFS_RETURN_IF_ERROR(CountMemoEntry());
      }
      memo_dense_[index] = value;
      return Status::Ok();
    }
    // Dense storage grows only in proportion to the entries actually stored, so a huge index
    // costs one hash-map slot, never a huge allocation.
    if (index < 2 * memo_count_ + 1024) {
      uint64_t new_size = memo_dense_.size() * 2;
      if (new_size < index + 1) new_size = index + 1;
      if (new_size > limits_.max_memo) new_size = limits_.max_memo;
      memo_dense_.resize(static_cast<size_t>(new_size), kNoNode);
      if (!memo_sparse_.empty() && memo_sparse_.erase(index) > 0) --memo_count_;
      UCPFS_RETURN_IF_ERROR(CountMemoEntry());
      memo_dense_[index] = value;
      return Status::Ok();
    }
    auto [it, inserted] = memo_sparse_.try_emplace(index, value);
    if (inserted) {
      Status st = CountMemoEntry();
      if (!st.ok()) {
        memo_sparse_.erase(it);
        return st;
      }
    } else {
      it->second = value;
    }
    return Status::Ok();
  }
  Status CountMemoEntry() {
    if (memo_count_ >= limits_.max_memo) return Exhausted("more memo entries than max_memo");
    ++memo_count_;
    return Status::Ok();
  }
  Status MemoGet(uint64_t index) {
    NodeId id = kNoNode;
    if (index < memo_dense_.size()) id = memo_dense_[index];
    if (id == kNoNode && !memo_sparse_.empty()) {
      auto it = memo_sparse_.find(index);
      if (it != memo_sparse_.end()) id = it->second;
    }
    if (id == kNoNode) return Corrupt("memo index " + std::to_string(index) + " was never set");
    return Push(id);
  }


  // ---- containers ----
  // Builds a container of `kind` from the values above the newest MARK.
  Status FromMark(Kind kind) {
    size_t mark = 0;
    UCPFS_RETURN_IF_ERROR(PopMark(&mark));
    NodeId id = kNoNode;
    if (kind == Kind::kTuple) {
      UCPFS_RETURN_IF_ERROR(NewTuple(stack_.data() + mark, stack_.size() - mark, &id));
    } else {
      UCPFS_RETURN_IF_ERROR(NewContainer(kind, &id));
      if (kind == Kind::kDict) {
        if ((stack_.size() - mark) % 2 != 0) return Corrupt("odd number of items for a dict");
        UCPFS_RETURN_IF_ERROR(AppendPairs(At(id).index, mark));
      } else {
        UCPFS_RETURN_IF_ERROR(AppendItems(At(id).index, mark));
      }
    }
    stack_.resize(mark);
    return Push(id);
  }
  Status TupleN(size_t n) {
    UCPFS_RETURN_IF_ERROR(NeedStack(n));
    NodeId id = kNoNode;
    const size_t first = stack_.size() - n;
    UCPFS_RETURN_IF_ERROR(NewTuple(stack_.data() + first, n, &id));
    stack_.resize(first);
    return Push(id);
  }
  // Appends stack_[from, end) to `target` and drops them from the stack.
  Status AppendTo(NodeId target, size_t from) {
    uint32_t seq = kNoSeq;
    const Kind k = KindOf(target);
    if (k == Kind::kList) {
      seq = At(target).index;
    } else if (k == Kind::kObject) {
      UCPFS_RETURN_IF_ERROR(ObjectSeq(target, false, &seq));
    } else {
      return Corrupt(std::string("cannot append to a ") + KindName(k));
    }
    UCPFS_RETURN_IF_ERROR(AppendItems(seq, from));
    stack_.resize(from);
    return Status::Ok();
  }
  Status SetItemsOn(NodeId target, size_t from) {
    const Kind k = KindOf(target);
    if (k != Kind::kDict && k != Kind::kObject) {
      return Corrupt(std::string("cannot set items on a ") + KindName(k));
    }
    if ((stack_.size() - from) % 2 != 0) return Corrupt("odd number of items for SETITEMS");
    uint32_t seq = At(target).index;
    if (k == Kind::kObject) UCPFS_RETURN_IF_ERROR(ObjectSeq(target, true, &seq));
    UCPFS_RETURN_IF_ERROR(AppendPairs(seq, from));
    stack_.resize(from);
    return Status::Ok();
  }
  Status AddItemsTo(NodeId target, size_t from) {
    uint32_t seq = kNoSeq;
    const Kind k = KindOf(target);
    if (k == Kind::kSet) {
      seq = At(target).index;
    } else if (k == Kind::kObject) {
      UCPFS_RETURN_IF_ERROR(ObjectSeq(target, false, &seq));
    } else {
      return Corrupt(std::string("cannot add items to a ") + KindName(k));
    }
    UCPFS_RETURN_IF_ERROR(AppendItems(seq, from));
    stack_.resize(from);
    return Status::Ok();
  }
  // For APPENDS/SETITEMS/ADDITEMS: pops the MARK; the target sits just below it and must not
  // be fenced off by an older MARK.
  Status MarkTarget(size_t* mark, NodeId* target) {
    UCPFS_RETURN_IF_ERROR(PopMark(mark));
    if (*mark <= Fence()) return Corrupt("stack underflow");
    *target = stack_[*mark - 1];
    return Status::Ok();
  }
  // BUILD: the kinds that carry a state.
  Status SetState(NodeId target, NodeId state) {
    Node& n = At(target);
    switch (n.kind) {
      case Kind::kObject: g_.objects_[n.index].state = state; break;
      case Kind::kDict: n.payload = state; break;
      case Kind::kTensor: g_.tensors_[n.index].state = state; break;
      case Kind::kStorage: g_.storages_[n.index].state = state; break;
      case Kind::kPersistentId: n.index = state; break;
      default: return Corrupt(std::string("cannot set the state of a ") + KindName(n.kind));
    }
    return Status::Ok();
  }

  // ---- globals, calls, persistent ids ----
  // `module` and `name` are the pickled names; each is shared with `*_ref` when given (the
  // STACK_GLOBAL strings) unless the Python 2 mapping replaces it, else copied.
  Status NewGlobal(std::string_view module, std::string_view name, const TextRef* module_ref,
                   const TextRef* name_ref, NodeId* id) {
    std::string_view mapped_module = module, mapped_name = name;
    MapPython2Name(mapped_module, mapped_name);
    UCPFS_RETURN_IF_ERROR(NewNode(Kind::kGlobal, id));
    GlobalRecord rec;
    if (module_ref != nullptr && mapped_module.data() == module.data()) {
      rec.module = *module_ref;
    } else {
      rec.module = AddText(mapped_module);
    }
    if (name_ref != nullptr && mapped_name.data() == name.data()) {
      rec.name = *name_ref;
    } else {
      rec.name = AddText(mapped_name);
    }
    At(*id).index = static_cast<uint32_t>(g_.globals_.size());
    g_.globals_.push_back(rec);
    return Status::Ok();
  }
  Status CheckCallable(NodeId id, const char* what) const {
    const Kind k = KindOf(id);
    if (k != Kind::kGlobal && k != Kind::kObject) {
      return Corrupt(std::string(what) + " is a " + KindName(k) + ", not a class or function");
    }
    return Status::Ok();
  }
  Known ClassifyNode(NodeId id) const {
    if (KindOf(id) != Kind::kGlobal) return Known::kNone;
    return Classify(g_.module(id), g_.name(id));
  }
  // Calls `callable(*args, **kwargs)` inertly: whitelisted callables are interpreted, anything
  // else becomes a generic Object. Pushes the result.
  Status Call(NodeId callable, NodeId args, NodeId kwargs, bool newobj) {
    NodeId result = kNoNode;
    const Known known = ClassifyNode(callable);
    if (known != Known::kNone && kwargs == kNoNode) {
      if (newobj) {
        // cls.__new__(cls): only OrderedDict has a structural meaning.
        if (known == Known::kOrderedDict && g_.items(args).empty()) {
          UCPFS_RETURN_IF_ERROR(NewOrderedDict(&result));
        }
      } else {
        UCPFS_RETURN_IF_ERROR(Interpret(known, args, &result));
      }
    }
    if (result == kNoNode) {
      UCPFS_RETURN_IF_ERROR(NewObject(callable, args, kwargs, newobj, &result));
    }
    return Push(result);
  }

  // The argument tuple's first few items, copied out because creating nodes moves the pools.
  struct Args {
    static constexpr size_t kMax = 8;
    NodeId v[kMax] = {};
    size_t n = 0;
    bool too_many = false;
  };
  Args GetArgs(NodeId tuple) const {
    Args a;
    const auto items = g_.items(tuple);
    if (items.size() > Args::kMax) {
      a.too_many = true;
      return a;
    }
    a.n = items.size();
    for (size_t i = 0; i < a.n; ++i) a.v[i] = items[i];
    return a;
  }
  TensorRecord& TensorOf(NodeId id) { return g_.tensors_[At(id).index]; }

  // Sets *out to the interpreted value, or leaves it kNoNode for a generic Object.
  Status Interpret(Known known, NodeId args_id, NodeId* out) {
    const Args a = GetArgs(args_id);
    if (a.too_many) return Status::Ok();
    switch (known) {
      case Known::kOrderedDict: return MakeOrderedDict(a, out);
      case Known::kRebuildTensor:
      case Known::kRebuildTensorV2:
      case Known::kRebuildTensorV3: return RebuildTensor(known, a, out);
      case Known::kRebuildParameter:
      case Known::kRebuildParameterWithState: {
        const size_t want = known == Known::kRebuildParameter ? 3 : 4;
        if (a.n != want || KindOf(a.v[0]) != Kind::kTensor) return Status::Ok();
        const Kind rg = KindOf(a.v[1]);
        if (rg != Kind::kBool && rg != Kind::kInt) return Status::Ok();
        TensorRecord& t = TensorOf(a.v[0]);
        t.is_parameter = true;
        t.requires_grad = At(a.v[1]).payload != 0;  // the bool, or int != 0
        if (known == Known::kRebuildParameterWithState) t.state = a.v[3];
        *out = a.v[0];
        return Status::Ok();
      }
      case Known::kRebuildFromTypeV2: {
        // (func, new_type, args, state): interpret (func, args) when func is a tensor rebuild.
        if (a.n != 4 || KindOf(a.v[2]) != Kind::kTuple) return Status::Ok();
        const Known inner = ClassifyNode(a.v[0]);
        if (!IsTensorRebuild(inner)) return Status::Ok();
        const Args inner_args = GetArgs(a.v[2]);
        if (inner_args.too_many) return Status::Ok();
        UCPFS_RETURN_IF_ERROR(RebuildTensor(inner, inner_args, out));
        if (*out == kNoNode) return Status::Ok();
        TensorRecord& t = TensorOf(*out);
        if (g_.IsGlobal(a.v[1], "torch.nn.parameter", "Parameter")) t.is_parameter = true;
        t.state = a.v[3];
        return Status::Ok();
      }
      case Known::kTorchSize: {
        if (a.n != 1) return Status::Ok();
        const Kind k = KindOf(a.v[0]);
        if (k == Kind::kTuple) {
          *out = a.v[0];
        } else if (k == Kind::kList) {
          UCPFS_RETURN_IF_ERROR(Charge(g_.items(a.v[0]).size()));
          UCPFS_RETURN_IF_ERROR(NewCopy(Kind::kTuple, a.v[0], out));
        }
        return Status::Ok();
      }
      case Known::kCodecsEncode: {
        if (a.n < 1 || a.n > 2 || KindOf(a.v[0]) != Kind::kString) return Status::Ok();
        if (a.n == 2 && KindOf(a.v[1]) != Kind::kString) return Status::Ok();
        const std::string_view encoding = a.n == 2 ? TextOf(a.v[1]) : std::string_view("utf-8");
        return EncodeString(a.v[0], encoding, out);
      }
      case Known::kByteArray:
      case Known::kBytes: {
        if (a.n == 0) return NewNode(Kind::kBytes, out);
        if (a.n == 1 && KindOf(a.v[0]) == Kind::kBytes) {
          UCPFS_RETURN_IF_ERROR(Charge(TextOf(a.v[0]).size()));
          return NewSharedTextNode(Kind::kBytes, RefOf(a.v[0]), out);
        }
        if (a.n == 2 && KindOf(a.v[0]) == Kind::kString && KindOf(a.v[1]) == Kind::kString) {
          return EncodeString(a.v[0], TextOf(a.v[1]), out);
        }
        return Status::Ok();
      }
      case Known::kSet:
      case Known::kFrozenSet: {
        if (a.n == 0) return NewContainer(Kind::kSet, out);
        const Kind k = a.n == 1 ? KindOf(a.v[0]) : Kind::kNone;
        if (k != Kind::kList && k != Kind::kTuple && k != Kind::kSet) return Status::Ok();
        UCPFS_RETURN_IF_ERROR(Charge(g_.items(a.v[0]).size()));
        return NewCopy(Kind::kSet, a.v[0], out);
      }
      case Known::kReconstructor: {
        // copyreg._reconstructor(cls, base, state): protocol 0/1 form of cls.__new__(cls).
        if (a.n != 3 || KindOf(a.v[0]) != Kind::kGlobal) return Status::Ok();
        return NewObject(a.v[0], args_id, kNoNode, false, out);
      }
      case Known::kNone: return Status::Ok();
    }
    return Status::Ok();
  }

  Status NewOrderedDict(NodeId* out) {
    UCPFS_RETURN_IF_ERROR(NewContainer(Kind::kDict, out));
    At(*out).flags = kOrderedFlag;
    return Status::Ok();
  }
  Status MakeOrderedDict(const Args& a, NodeId* out) {
    if (a.n == 0) return NewOrderedDict(out);
    // OrderedDict([(k, v), ...]) (old pickles).
    if (a.n != 1) return Status::Ok();
    const Kind k = KindOf(a.v[0]);
    if (k != Kind::kList && k != Kind::kTuple) return Status::Ok();
    UCPFS_RETURN_IF_ERROR(Charge(g_.items(a.v[0]).size()));
    for (NodeId pair : g_.items(a.v[0])) {
      const Kind pk = KindOf(pair);
      if ((pk != Kind::kTuple && pk != Kind::kList) || g_.items(pair).size() != 2) {
        return Status::Ok();
      }
    }
    NodeId id = kNoNode;
    UCPFS_RETURN_IF_ERROR(NewOrderedDict(&id));
    Seq& s = g_.seqs_[At(id).index];
    const auto pairs = g_.items(a.v[0]);  // items_ is not touched below: spans stay valid
    UCPFS_RETURN_IF_ERROR(Grow(g_.pairs_, s, pairs.size()));
    for (NodeId pair : pairs) {
      const auto kv = g_.items(pair);
      g_.pairs_[s.offset + s.count++] = {kv[0], kv[1]};
    }
    *out = id;
    return Status::Ok();
  }

  // str.encode(encoding) for the encodings pickles use; other encodings stay generic.
  Status EncodeString(NodeId str, std::string_view encoding, NodeId* out) {
    if (encoding.size() > 16) return Status::Ok();  // no encoding name pickles use is longer
    UCPFS_RETURN_IF_ERROR(Charge(TextOf(str).size()));
    std::string enc;
    for (char c : encoding) {
      enc.push_back(c == '_' ? '-' : (c >= 'A' && c <= 'Z') ? static_cast<char>(c + 32) : c);
    }
    std::string bytes;
    if (enc == "latin1" || enc == "latin-1" || enc == "iso-8859-1" || enc == "iso8859-1" ||
        enc == "l1") {
      if (!EncodeAsSingleBytes(TextOf(str), 0xFF, bytes)) return Status::Ok();
    } else if (enc == "ascii" || enc == "us-ascii") {
      if (!EncodeAsSingleBytes(TextOf(str), 0x7F, bytes)) return Status::Ok();
    } else if (enc == "utf-8" || enc == "utf8") {
      return NewSharedTextNode(Kind::kBytes, RefOf(str), out);  // the same bytes: share them
    } else {
      return Status::Ok();
    }
    return NewTextNode(Kind::kBytes, bytes, out);
  }

  // Reads a tuple/list of ints into `out`; false when the shape does not match.
  bool IntTuple(NodeId id, std::vector<int64_t>& out) const {
    const Kind k = KindOf(id);
    if (k != Kind::kTuple && k != Kind::kList) return false;
    const auto items = g_.items(id);
    out.clear();
    out.reserve(items.size());
    for (NodeId item : items) {
      if (KindOf(item) != Kind::kInt) return false;
      out.push_back(g_.int_value(item));
    }
    return true;
  }

  // _rebuild_tensor(storage, offset, size, stride)
  // _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])
  // _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype[, metadata])
  Status RebuildTensor(Known known, const Args& a, NodeId* out) {
    const char* fn = known == Known::kRebuildTensor     ? "_rebuild_tensor"
                     : known == Known::kRebuildTensorV2 ? "_rebuild_tensor_v2"
                                                        : "_rebuild_tensor_v3";
    size_t min_n = 4, max_n = 4;
    if (known == Known::kRebuildTensorV2) min_n = 6, max_n = 7;
    if (known == Known::kRebuildTensorV3) min_n = 7, max_n = 8;
    if (a.n < min_n || a.n > max_n) return Status::Ok();
    if (KindOf(a.v[0]) != Kind::kStorage || KindOf(a.v[1]) != Kind::kInt) return Status::Ok();
    UCPFS_RETURN_IF_ERROR(Charge(g_.items(a.v[2]).size() + g_.items(a.v[3]).size()));
    if (!IntTuple(a.v[2], shape_) || !IntTuple(a.v[3], stride_)) return Status::Ok();
    bool requires_grad = false;
    if (known != Known::kRebuildTensor) {
      const Kind rg = KindOf(a.v[4]);
      if (rg != Kind::kBool && rg != Kind::kInt) return Status::Ok();
      requires_grad = At(a.v[4]).payload != 0;  // the bool, or int != 0
    }
    DType dtype = g_.storage(a.v[0]).dtype;
    if (known == Known::kRebuildTensorV3) {
      const NodeId d = a.v[6];
      if (KindOf(d) != Kind::kGlobal || g_.module(d) != "torch") return Status::Ok();
      auto parsed = DTypeFromTorchName(g_.name(d));
      if (!parsed) return Status::Ok();
      dtype = *parsed;
    }
    // The shape matches; values a tensor cannot have mean the file is corrupt.
    const int64_t offset = g_.int_value(a.v[1]);
    if (offset < 0) {
      return Corrupt(std::string(fn) + ": negative storage offset " + std::to_string(offset));
    }
    if (shape_.size() != stride_.size()) {
      return Corrupt(std::string(fn) + ": size has " + std::to_string(shape_.size()) +
                     " dims but stride has " + std::to_string(stride_.size()));
    }
    for (size_t i = 0; i < shape_.size(); ++i) {
      if (shape_[i] < 0) {
        return Corrupt(std::string(fn) + ": negative size " + std::to_string(shape_[i]));
      }
      if (stride_[i] < 0) {
        return Corrupt(std::string(fn) + ": negative stride " + std::to_string(stride_[i]));
      }
    }
    NodeId id = kNoNode;
    UCPFS_RETURN_IF_ERROR(NewNode(Kind::kTensor, &id));
    At(id).index = static_cast<uint32_t>(g_.tensors_.size());
    TensorRecord& t = g_.tensors_.emplace_back();
    t.dims_offset = g_.dims_.size();
    t.ndim = static_cast<uint32_t>(shape_.size());  // a tuple's count: 32-bit
    g_.dims_.insert(g_.dims_.end(), shape_.begin(), shape_.end());
    g_.dims_.insert(g_.dims_.end(), stride_.begin(), stride_.end());
    t.storage = a.v[0];
    t.dtype = dtype;
    t.storage_offset = offset;
    t.requires_grad = requires_grad;
    *out = id;
    return Status::Ok();
  }

  // BINPERSID: ('storage', <storage class>, key, location, numel) becomes a Storage node, as
  // does torch's legacy format's ('storage', <storage class>, key, location, numel, None) (its
  // sixth item, a view of another storage when not None, is not served); anything else a
  // PersistentId node.
  Status PersistentLoad(NodeId pid) {
    bool untyped = false;
    DType dtype = DType::kUInt8;
    bool is_storage = false;
    NodeId key = kNoNode, loc = kNoNode, numel = kNoNode;
    const size_t n_items = KindOf(pid) == Kind::kTuple ? g_.items(pid).size() : 0;
    if (n_items == 5 || (n_items == 6 && KindOf(g_.items(pid)[5]) == Kind::kNone)) {
      const auto p = g_.items(pid);
      const NodeId tag = p[0], cls = p[1];
      key = p[2];
      loc = p[3];
      numel = p[4];
      if (KindOf(tag) == Kind::kString && TextOf(tag) == "storage" &&
          KindOf(cls) == Kind::kGlobal && g_.module(cls).starts_with("torch") &&
          (KindOf(key) == Kind::kString || KindOf(key) == Kind::kInt) &&
          KindOf(loc) == Kind::kString && KindOf(numel) == Kind::kInt) {
        const std::string_view cls_name = g_.name(cls);
        if (cls_name == "UntypedStorage" || cls_name == "TypedStorage" ||
            cls_name == "_UntypedStorage") {
          untyped = true;
          is_storage = true;
        } else if (auto d = DTypeFromStorageClassName(cls_name)) {
          dtype = *d;
          is_storage = true;
        }
        if (is_storage && g_.int_value(numel) < 0) {
          return Corrupt("storage numel " + std::to_string(g_.int_value(numel)) +
                         " is negative");
        }
      }
    }
    if (is_storage) {
      UCPFS_RETURN_IF_ERROR(Charge(TextOf(key).size() + TextOf(loc).size()));
    }
    NodeId id = kNoNode;
    if (!is_storage) {
      UCPFS_RETURN_IF_ERROR(PushNew(Kind::kPersistentId, &id));
      At(id).payload = pid;
      return Status::Ok();
    }
    UCPFS_RETURN_IF_ERROR(PushNew(Kind::kStorage, &id));
    StorageRecord s;
    if (KindOf(key) == Kind::kString) {
      s.key = RefOf(key);
    } else {
      s.key = AddText(std::to_string(g_.int_value(key)));
    }
    s.location = RefOf(loc);
    s.dtype = dtype;
    s.untyped = untyped;
    s.numel = static_cast<uint64_t>(g_.int_value(numel));
    At(id).index = static_cast<uint32_t>(g_.storages_.size());
    g_.storages_.push_back(s);
    return Status::Ok();
  }

  Status Step();

  static constexpr uint64_t kMaxItems = 0xFFFFFFFFu;      // Node::index and Seq counts
  static constexpr uint64_t kMaxTextBytes = 0xFFFFFFFFu;  // Node::index

  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  size_t op_offset_ = 0;
  uint8_t op_ = 0;
  std::string_view source_;
  PickleLimits limits_;
  uint64_t max_nodes_;
  uint64_t max_string_bytes_;
  PickleGraph& g_;
  std::vector<Node>& nodes_;
  std::vector<NodeId> stack_;
  std::vector<size_t> marks_;
  std::vector<NodeId> memo_dense_;
  std::unordered_map<uint64_t, NodeId> memo_sparse_;
  uint64_t memo_count_ = 0;
  NodeId none_ = kNoNode;
  NodeId true_ = kNoNode;
  NodeId false_ = kNoNode;
  static constexpr size_t kSmallInts = 1024;
  std::array<NodeId, kSmallInts> small_ints_;
  std::unordered_map<int64_t, NodeId> ints_;
  std::vector<int64_t> shape_, stride_;  // scratch for RebuildTensor
  bool done_ = false;
  uint64_t copied_ = 0;
  uint64_t copy_budget_ = 0;
};

Status PickleGraph::Parser::Run() {
  while (!done_) {
    if (pos_ >= size_) {
      op_offset_ = pos_;
      ran_out_ = true;
      return Status(StatusCode::kCorrupt, std::string(source_) + ": pickle offset " +
                                              std::to_string(pos_) + ": truncated: no STOP");
    }
    op_offset_ = pos_;
    op_ = data_[pos_++];
    UCPFS_RETURN_IF_ERROR(Step());
  }
  return Status::Ok();
}

Status PickleGraph::Parser::Step() {
  switch (op_) {
    // ---- framing and stack manipulation ----
    case kProto: {
      uint64_t v = 0;
      UCPFS_RETURN_IF_ERROR(ReadUnsigned(1, &v));
      if (v > 5) {
        return Error(StatusCode::kUnsupported,
                     "protocol " + std::to_string(v) + " is newer than 5");
      }
      return Status::Ok();
    }
    case kFrame: {
      // Frames only group opcodes for buffered reading; the opcodes inside are parsed as usual.
      const uint8_t* p = nullptr;
      return ReadBytes(8, &p);
    }
    case kStop:
      UCPFS_RETURN_IF_ERROR(NeedStack(1));
      g_.root_ = stack_.back();
      g_.end_offset_ = pos_;
      done_ = true;
      return Status::Ok();
    case kMark:
      if (marks_.size() >= limits_.max_mark_depth) {
        return Exhausted("MARKs nested deeper than " + std::to_string(limits_.max_mark_depth) +
                         " (max_mark_depth)");
      }
      marks_.push_back(stack_.size());
      return Status::Ok();
    case kPop:
      // With nothing above the newest MARK, POP discards the MARK (as CPython does).
      if (!marks_.empty() && marks_.back() == stack_.size()) {
        marks_.pop_back();
        return Status::Ok();
      }
      UCPFS_RETURN_IF_ERROR(NeedStack(1));
      stack_.pop_back();
      return Status::Ok();
    case kPopMark: {
      size_t mark = 0;
      UCPFS_RETURN_IF_ERROR(PopMark(&mark));
      stack_.resize(mark);
      return Status::Ok();
    }
    case kDup:
      UCPFS_RETURN_IF_ERROR(NeedStack(1));
      return Push(stack_.back());

    // ---- scalars ----
    case kNone: return PushSingleton(&none_, Kind::kNone, false);
    case kNewTrue: return PushSingleton(&true_, Kind::kBool, true);
    case kNewFalse: return PushSingleton(&false_, Kind::kBool, false);
    case kInt: {
      std::string_view line;
      UCPFS_RETURN_IF_ERROR(ReadLine(&line));
      if (line == "01") return PushSingleton(&true_, Kind::kBool, true);
      if (line == "00") return PushSingleton(&false_, Kind::kBool, false);
      return PushDecimal(line);
    }
    case kLong: {
      std::string_view line;
      UCPFS_RETURN_IF_ERROR(ReadLine(&line));
      if (!line.empty() && line.back() == 'L') line.remove_suffix(1);
      return PushDecimal(line);
    }
    case kBinInt: {
      uint64_t v = 0;
      UCPFS_RETURN_IF_ERROR(ReadUnsigned(4, &v));
      return PushInt(static_cast<int32_t>(static_cast<uint32_t>(v)));
    }
    case kBinInt1:
    case kBinInt2: {
      uint64_t v = 0;
      UCPFS_RETURN_IF_ERROR(ReadUnsigned(op_ == kBinInt1 ? 1 : 2, &v));
      return PushInt(static_cast<int64_t>(v));
    }
    case kLong1:
    case kLong4: {
      uint64_t n = 0;
      UCPFS_RETURN_IF_ERROR(ReadUnsigned(op_ == kLong1 ? 1 : 4, &n));
      if (op_ == kLong4 && (n & 0x80000000u) != 0) return Corrupt("negative byte count");
      std::string_view bytes;
      UCPFS_RETURN_IF_ERROR(ReadPayload(n, &bytes));
      return PushLongBytes(bytes);
    }
    case kFloat: {
      std::string_view line;
      UCPFS_RETURN_IF_ERROR(ReadLine(&line));
      line = Trim(line);
      if (!line.empty() && line[0] == '+') line.remove_prefix(1);
      double v = 0;
      auto [end, ec] = std::from_chars(line.data(), line.data() + line.size(), v);
      if (line.empty() || ec != std::errc() || end != line.data() + line.size()) {
        return Corrupt("invalid float literal");
      }
      return PushFloat(v);
    }
    case kBinFloat: {
      const uint8_t* p = nullptr;
      UCPFS_RETURN_IF_ERROR(ReadBytes(8, &p));
      uint64_t bits = 0;
      for (int i = 0; i < 8; ++i) bits = (bits << 8) | p[i];  // big-endian
      double v;
      std::memcpy(&v, &bits, sizeof v);
      return PushFloat(v);
    }

    // ---- strings and bytes ----
    case kString: {
      std::string_view line;
      UCPFS_RETURN_IF_ERROR(ReadLine(&line));
      if (line.size() < 2 || line.front() != line.back() ||
          (line.front() != '\'' && line.front() != '"')) {
        return Corrupt("argument must be quoted");
      }
      std::string decoded;
      if (!EscapeDecode(line.substr(1, line.size() - 2), decoded)) {
        return Corrupt("invalid escape sequence");
      }
      return PushDecodedText(Kind::kString, decoded);
    }
    case kUnicode: {
      std::string_view line;
      UCPFS_RETURN_IF_ERROR(ReadLine(&line));
      std::string decoded;
      if (!RawUnicodeEscapeDecode(line, decoded)) return Corrupt("invalid \\u escape");
      return PushDecodedText(Kind::kString, decoded);
    }
    case kBinString:
    case kShortBinString:
    case kBinUnicode:
    case kShortBinUnicode:
    case kBinUnicode8:
    case kBinBytes:
    case kShortBinBytes:
    case kBinBytes8:
    case kByteArray8: {
      int width = 4;
      if (op_ == kShortBinString || op_ == kShortBinUnicode || op_ == kShortBinBytes) width = 1;
      if (op_ == kBinUnicode8 || op_ == kBinBytes8 || op_ == kByteArray8) width = 8;
      uint64_t n = 0;
      UCPFS_RETURN_IF_ERROR(ReadUnsigned(width, &n));
      if (op_ == kBinString && (n & 0x80000000u) != 0) return Corrupt("negative length");
      std::string_view payload;
      UCPFS_RETURN_IF_ERROR(ReadPayload(n, &payload));
      const bool is_bytes = op_ == kBinBytes || op_ == kShortBinBytes || op_ == kBinBytes8 ||
                            op_ == kByteArray8;
      return PushText(is_bytes ? Kind::kBytes : Kind::kString, payload);
    }

    // ---- containers ----
    case kEmptyTuple: {
      NodeId id = kNoNode;
      UCPFS_RETURN_IF_ERROR(NewTuple(nullptr, 0, &id));
      return Push(id);
    }
    case kTuple: return FromMark(Kind::kTuple);
    case kTuple1: return TupleN(1);
    case kTuple2: return TupleN(2);
    case kTuple3: return TupleN(3);
    case kEmptyList: return PushNewContainer(Kind::kList);
    case kList: return FromMark(Kind::kList);
    case kAppend: {
      UCPFS_RETURN_IF_ERROR(NeedStack(2));
      return AppendTo(stack_[stack_.size() - 2], stack_.size() - 1);
    }
    case kAppends: {
      size_t mark = 0;
      NodeId target = kNoNode;
      UCPFS_RETURN_IF_ERROR(MarkTarget(&mark, &target));
      return AppendTo(target, mark);
    }
    case kEmptyDict: return PushNewContainer(Kind::kDict);
    case kDict: return FromMark(Kind::kDict);
    case kSetItem: {
      UCPFS_RETURN_IF_ERROR(NeedStack(3));
      return SetItemsOn(stack_[stack_.size() - 3], stack_.size() - 2);
    }
    case kSetItems: {
      size_t mark = 0;
      NodeId target = kNoNode;
      UCPFS_RETURN_IF_ERROR(MarkTarget(&mark, &target));
      return SetItemsOn(target, mark);
    }
    case kEmptySet: return PushNewContainer(Kind::kSet);
    case kAddItems: {
      size_t mark = 0;
      NodeId target = kNoNode;
      UCPFS_RETURN_IF_ERROR(MarkTarget(&mark, &target));
      return AddItemsTo(target, mark);
    }
    case kFrozenSet: return FromMark(Kind::kSet);

    // ---- memo ----
    case kPut:
    case kGet: {
      std::string_view line;
      UCPFS_RETURN_IF_ERROR(ReadLine(&line));
      uint64_t index = 0;
      UCPFS_RETURN_IF_ERROR(ParseIndexLine(line, &index));
      return op_ == kPut ? MemoPut(index) : MemoGet(index);
    }
    case kBinPut:
    case kLongBinPut:
    case kBinGet:
    case kLongBinGet: {
      uint64_t index = 0;
      UCPFS_RETURN_IF_ERROR(ReadUnsigned(op_ == kBinPut || op_ == kBinGet ? 1 : 4, &index));
      return op_ == kBinPut || op_ == kLongBinPut ? MemoPut(index) : MemoGet(index);
    }
    case kMemoize: return MemoPut(memo_count_);

    // ---- globals and objects ----
    case kGlobal: {
      std::string_view module, name;
      UCPFS_RETURN_IF_ERROR(ReadLine(&module));
      UCPFS_RETURN_IF_ERROR(ReadLine(&name));
      NodeId id = kNoNode;
      UCPFS_RETURN_IF_ERROR(NewGlobal(module, name, nullptr, nullptr, &id));
      return Push(id);
    }
    case kStackGlobal: {
      UCPFS_RETURN_IF_ERROR(NeedStack(2));
      const NodeId name = stack_[stack_.size() - 1];
      const NodeId module = stack_[stack_.size() - 2];
      if (KindOf(name) != Kind::kString || KindOf(module) != Kind::kString) {
        return Corrupt("module and name must be str");
      }
      UCPFS_RETURN_IF_ERROR(Charge(TextOf(module).size() + TextOf(name).size()));
      stack_.resize(stack_.size() - 2);
      // The global shares the strings' text (unless a Python 2 name is mapped).
      const TextRef module_ref = RefOf(module), name_ref = RefOf(name);
      NodeId id = kNoNode;
      UCPFS_RETURN_IF_ERROR(
          NewGlobal(TextOf(module), TextOf(name), &module_ref, &name_ref, &id));
      return Push(id);
    }
    case kInst: {
      std::string_view module, name;
      UCPFS_RETURN_IF_ERROR(ReadLine(&module));
      UCPFS_RETURN_IF_ERROR(ReadLine(&name));
      NodeId callable = kNoNode;
      UCPFS_RETURN_IF_ERROR(NewGlobal(module, name, nullptr, nullptr, &callable));
      UCPFS_RETURN_IF_ERROR(FromMark(Kind::kTuple));
      const NodeId args = Pop();
      return Call(callable, args, kNoNode, false);
    }
    case kObj: {
      size_t mark = 0;
      UCPFS_RETURN_IF_ERROR(PopMark(&mark));
      if (stack_.size() - mark < 1) return Corrupt("no class after MARK");
      const NodeId callable = stack_[mark];
      UCPFS_RETURN_IF_ERROR(CheckCallable(callable, "class"));
      NodeId args = kNoNode;
      UCPFS_RETURN_IF_ERROR(
          NewTuple(stack_.data() + mark + 1, stack_.size() - mark - 1, &args));
      stack_.resize(mark);
      return Call(callable, args, kNoNode, false);
    }
    case kReduce:
    case kNewObj: {
      UCPFS_RETURN_IF_ERROR(NeedStack(2));
      const NodeId args = stack_[stack_.size() - 1];
      const NodeId callable = stack_[stack_.size() - 2];
      if (KindOf(args) != Kind::kTuple) {
        return Corrupt(std::string("arguments are a ") + KindName(KindOf(args)) +
                       ", not a tuple");
      }
      UCPFS_RETURN_IF_ERROR(CheckCallable(callable, op_ == kReduce ? "callable" : "class"));
      stack_.resize(stack_.size() - 2);
      return Call(callable, args, kNoNode, op_ == kNewObj);
    }
    case kNewObjEx: {
      UCPFS_RETURN_IF_ERROR(NeedStack(3));
      const NodeId kwargs = stack_[stack_.size() - 1];
      const NodeId args = stack_[stack_.size() - 2];
      const NodeId cls = stack_[stack_.size() - 3];
      if (KindOf(args) != Kind::kTuple) {
        return Corrupt(std::string("arguments are a ") + KindName(KindOf(args)) +
                       ", not a tuple");
      }
      if (KindOf(kwargs) != Kind::kDict) {
        return Corrupt(std::string("keyword arguments are a ") + KindName(KindOf(kwargs)) +
                       ", not a dict");
      }
      UCPFS_RETURN_IF_ERROR(CheckCallable(cls, "class"));
      stack_.resize(stack_.size() - 3);
      return Call(cls, args, kwargs, true);
    }
    case kBuild: {
      UCPFS_RETURN_IF_ERROR(NeedStack(2));
      const NodeId state = stack_[stack_.size() - 1];
      UCPFS_RETURN_IF_ERROR(SetState(stack_[stack_.size() - 2], state));
      stack_.pop_back();
      return Status::Ok();
    }
    case kBinPersId: {
      UCPFS_RETURN_IF_ERROR(NeedStack(1));
      return PersistentLoad(Pop());
    }
    case kPersId: {
      std::string_view line;
      UCPFS_RETURN_IF_ERROR(ReadLine(&line));
      NodeId pid = kNoNode;
      UCPFS_RETURN_IF_ERROR(NewTextNode(Kind::kString, line, &pid));
      NodeId id = kNoNode;
      UCPFS_RETURN_IF_ERROR(PushNew(Kind::kPersistentId, &id));
      At(id).payload = pid;
      return Status::Ok();
    }

    // ---- valid but unsupported ----
    case kExt1:
    case kExt2:
    case kExt4:
      return Error(StatusCode::kUnsupported, "copyreg extension codes are not supported");
    case kNextBuffer:
    case kReadonlyBuffer:
      return Error(StatusCode::kUnsupported, "out-of-band buffers are not supported in files");

    default: {
      return Corrupt("unknown opcode");
    }
  }
}

Result<PickleGraph> ParsePickle(std::span<const std::byte> data, std::string_view source_name,
                                const PickleLimits& limits, bool* ran_out) {
  PickleGraph graph;
  if (ran_out != nullptr) *ran_out = false;
  try {
    PickleGraph::Parser parser(data, source_name, limits, graph);
    Status st = parser.Run();
    if (!st.ok()) {
      if (ran_out != nullptr) *ran_out = parser.ran_out();
      return st;
    }
  } catch (const std::bad_alloc&) {
    // Limits bound every structure, but generous limits on a small machine can still run out.
    return ResourceExhaustedError(std::string(source_name) + ": pickle: out of memory");
  }
  return graph;
}

}  // namespace ucpfs::pickle
