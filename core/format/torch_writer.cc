#include "core/format/torch_writer.h"

#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cassert>
#include <cstring>
#include <limits>
#include <optional>
#include <string_view>
#include <unordered_set>

#include "core/checked.h"

namespace ucpfs::format {

// ------------------------------------------------------------------------------- SaveValue

SaveValue SaveValue::Bool(bool v) {
  SaveValue s;
  s.kind_ = Kind::kBool;
  s.bool_ = v;
  return s;
}

SaveValue SaveValue::Int(int64_t v) {
  SaveValue s;
  s.kind_ = Kind::kInt;
  s.int_ = v;
  return s;
}

SaveValue SaveValue::Float(double v) {
  SaveValue s;
  s.kind_ = Kind::kFloat;
  s.float_ = v;
  return s;
}

SaveValue SaveValue::Str(std::string v) {
  SaveValue s;
  s.kind_ = Kind::kString;
  s.string_ = std::move(v);
  return s;
}

bool SaveValue::SameAs(const SaveValue& o) const {
  if (kind_ != o.kind_ || ordered_ != o.ordered_) return false;
  switch (kind_) {
    case Kind::kNone: return true;
    case Kind::kBool: return bool_ == o.bool_;
    case Kind::kInt: return int_ == o.int_;
    case Kind::kFloat: return std::bit_cast<uint64_t>(float_) == std::bit_cast<uint64_t>(o.float_);
    case Kind::kString:
    case Kind::kBytes: return string_ == o.string_;
    case Kind::kList:
    case Kind::kTuple:
      if (items_.size() != o.items_.size()) return false;
      for (size_t i = 0; i < items_.size(); ++i) {
        if (!items_[i].SameAs(o.items_[i])) return false;
      }
      return true;
    case Kind::kDict:
      if (dict_items_.size() != o.dict_items_.size()) return false;
      for (size_t i = 0; i < dict_items_.size(); ++i) {
        if (!dict_items_[i].first.SameAs(o.dict_items_[i].first) ||
            !dict_items_[i].second.SameAs(o.dict_items_[i].second)) {
          return false;
        }
      }
      return true;
    case Kind::kTensor:
      return tensor_.dtype == o.tensor_.dtype && tensor_.shape == o.tensor_.shape &&
             tensor_.provider == o.tensor_.provider && tensor_.requires_grad == o.tensor_.requires_grad;
    case Kind::kGlobal: return string_ == o.string_ && name_ == o.name_;
    case Kind::kObject: {
      auto same = [](const std::vector<SaveValue>& a, const std::vector<SaveValue>& b) {
        if (a.size() != b.size()) return false;
        for (size_t i = 0; i < a.size(); ++i) {
          if (!a[i].SameAs(b[i])) return false;
        }
        return true;
      };
      if (newobj_ != o.newobj_ || !same(parts_, o.parts_) || !same(items_, o.items_) ||
          dict_items_.size() != o.dict_items_.size()) {
        return false;
      }
      for (size_t i = 0; i < dict_items_.size(); ++i) {
        if (!dict_items_[i].first.SameAs(o.dict_items_[i].first) ||
            !dict_items_[i].second.SameAs(o.dict_items_[i].second)) {
          return false;
        }
      }
      return true;
    }
  }
  return false;
}

SaveValue SaveValue::Bytes(std::string v) {
  SaveValue s;
  s.kind_ = Kind::kBytes;
  s.string_ = std::move(v);
  return s;
}

SaveValue SaveValue::List(std::vector<SaveValue> items) {
  SaveValue s;
  s.kind_ = Kind::kList;
  s.items_ = std::move(items);
  return s;
}

SaveValue SaveValue::Tuple(std::vector<SaveValue> items) {
  SaveValue s;
  s.kind_ = Kind::kTuple;
  s.items_ = std::move(items);
  return s;
}

SaveValue SaveValue::Dict(DictItems items) {
  SaveValue s;
  s.kind_ = Kind::kDict;
  s.dict_items_ = std::move(items);
  return s;
}

SaveValue SaveValue::OrderedDict(DictItems items) {
  SaveValue s = Dict(std::move(items));
  s.ordered_ = true;
  return s;
}

SaveValue SaveValue::Tensor(SaveTensor tensor) {
  SaveValue s;
  s.kind_ = Kind::kTensor;
  s.tensor_ = std::move(tensor);
  return s;
}

SaveValue SaveValue::Tensor(DType dtype, std::vector<int64_t> shape,
                            std::shared_ptr<const TensorBytesProvider> provider) {
  return Tensor(SaveTensor{dtype, std::move(shape), std::move(provider)});
}

SaveValue SaveValue::Global(std::string module, std::string name) {
  SaveValue s;
  s.kind_ = Kind::kGlobal;
  s.string_ = std::move(module);
  s.name_ = std::move(name);
  return s;
}

SaveValue SaveValue::Object(SaveValue callable, SaveValue args, bool newobj, std::optional<SaveValue> state,
                            std::vector<SaveValue> list_items, DictItems dict_items) {
  SaveValue s;
  s.kind_ = Kind::kObject;
  s.parts_.push_back(std::move(callable));
  s.parts_.push_back(std::move(args));
  if (state) s.parts_.push_back(std::move(*state));
  s.newobj_ = newobj;
  s.items_ = std::move(list_items);
  s.dict_items_ = std::move(dict_items);
  return s;
}

SaveValue& SaveValue::Append(SaveValue item) {
  assert(kind_ == Kind::kList || kind_ == Kind::kTuple);
  if (kind_ == Kind::kList || kind_ == Kind::kTuple) items_.push_back(std::move(item));
  return *this;
}

SaveValue& SaveValue::Set(SaveValue key, SaveValue value) {
  assert(kind_ == Kind::kDict);
  if (kind_ == Kind::kDict) dict_items_.emplace_back(std::move(key), std::move(value));
  return *this;
}

namespace {

constexpr uint64_t kU32Max = 0xFFFFFFFFu;
constexpr int kMaxDepth = 1000;
constexpr size_t kBatch = 1000;  // items per MARK ... SETITEMS / APPENDS, as CPython's pickler
constexpr size_t kMaxPrefixBytes = 1024;
constexpr uint32_t kMaxAlignment = 32768;  // keeps the FB extra field below 64 KiB

constexpr uint64_t kLocalHeaderBytes = 30;
constexpr uint64_t kCentralHeaderBytes = 46;
constexpr uint64_t kZip64EocdBytes = 56;
constexpr uint64_t kZip64LocatorBytes = 20;
constexpr uint64_t kEocdBytes = 22;

// Pickle opcodes (protocol 2), only those both weights_only unpicklers accept (+ BINFLOAT, and
// NEWOBJ/BUILD for SaveValue::Object).
namespace op {
constexpr uint8_t kProto = 0x80, kStop = '.', kMark = '(', kGlobal = 'c', kReduce = 'R',
                  kBinPersId = 'Q', kTuple = 't', kEmptyTuple = ')', kTuple1 = 0x85, kTuple2 = 0x86,
                  kTuple3 = 0x87, kEmptyDict = '}', kSetItems = 'u', kEmptyList = ']',
                  kAppends = 'e', kBinUnicode = 'X', kBinInt1 = 'K', kBinInt2 = 'M', kBinInt = 'J',
                  kLong1 = 0x8a, kNone = 'N', kNewTrue = 0x88, kNewFalse = 0x89, kBinFloat = 'G',
                  kNewObj = 0x81, kBuild = 'b';
}  // namespace op

bool IsQuantized(DType dtype) {
  return dtype == DType::kQInt8 || dtype == DType::kQUInt8 || dtype == DType::kQInt32;
}

// Strict UTF-8 (no overlongs, no surrogates, <= U+10FFFF): what Python decodes without error.
bool ValidUtf8(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    const auto c = static_cast<uint8_t>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
      cp = c & 0x1Fu;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      cp = c & 0x0Fu;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      cp = c & 0x07u;
    } else {
      return false;
    }
    if (n - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      const auto cc = static_cast<uint8_t>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3Fu);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += len;
  }
  return true;
}

void PutLe(std::vector<std::byte>& out, uint64_t v, int n_bytes) {
  for (int i = 0; i < n_bytes; ++i) out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xFF));
}

void PutBytes(std::vector<std::byte>& out, std::string_view s) {
  for (char c : s) out.push_back(static_cast<std::byte>(c));
}

// 20 decimal digits of a 64-bit value, zero-padded (2^64 - 1 has exactly 20 digits).
std::string Digits20(uint64_t v) {
  std::string s(20, '0');
  for (int i = 19; i >= 0 && v != 0; --i) {
    s[static_cast<size_t>(i)] = static_cast<char>('0' + v % 10);
    v /= 10;
  }
  return s;
}

uint64_t Fnv1a(uint64_t h, std::span<const std::byte> data) {
  for (std::byte b : data) {
    h ^= static_cast<uint8_t>(b);
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t Fnv1a(uint64_t h, std::string_view s) {
  return Fnv1a(h, std::as_bytes(std::span<const char>(s.data(), s.size())));
}

uint32_t Crc32(std::span<const std::byte> data) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* p = reinterpret_cast<const Bytef*>(data.data());
  size_t left = data.size();
  while (left > 0) {  // zlib's length is a uInt
    const auto n = static_cast<uInt>(std::min<size_t>(left, 1u << 30));
    crc = crc32(crc, p, n);
    p += n;
    left -= n;
  }
  return static_cast<uint32_t>(crc);
}

// A tensor checked and measured before it is pickled.
struct TensorShape {
  uint64_t numel = 1;
  uint64_t n_bytes = 0;
  std::vector<int64_t> strides;  // contiguous row-major, in elements
};

// Errors: kUnsupported (quantized), kInvalidArgument (negative dim, overflow, no provider).
Result<TensorShape> MeasureTensor(const SaveTensor& t) {
  if (static_cast<int>(t.dtype) >= kNumDTypes) {
    return InvalidArgumentError("tensor has an unknown dtype " +
                                std::to_string(static_cast<int>(t.dtype)));
  }
  if (IsQuantized(t.dtype)) {
    return UnsupportedError("quantized dtype " + std::string(TorchName(t.dtype)) +
                            " cannot be written (needs _rebuild_qtensor)");
  }
  constexpr auto kI64Max = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  TensorShape m;
  m.strides.assign(t.shape.size(), 1);
  uint64_t stride = 1;  // torch's contiguous strides: product of max(dim, 1) of later dims
  for (size_t i = t.shape.size(); i-- > 0;) {
    const int64_t dim = t.shape[i];
    if (dim < 0) {
      return InvalidArgumentError("tensor shape has a negative dimension " + std::to_string(dim));
    }
    m.strides[i] = static_cast<int64_t>(stride);
    auto numel = CheckedMul(m.numel, static_cast<uint64_t>(dim));
    auto next_stride = CheckedMul(stride, std::max<uint64_t>(static_cast<uint64_t>(dim), 1));
    if (!numel || *numel > kI64Max || !next_stride || (i > 0 && *next_stride > kI64Max)) {
      return InvalidArgumentError("tensor shape overflows 64 bits");
    }
    m.numel = *numel;
    stride = *next_stride;
  }
  auto n_bytes = CheckedMul(m.numel, ItemSize(t.dtype));
  if (!n_bytes || *n_bytes > kI64Max) {
    return InvalidArgumentError("tensor byte size overflows 64 bits");
  }
  m.n_bytes = *n_bytes;
  if (m.n_bytes > 0 && t.provider == nullptr) {
    return InvalidArgumentError("non-empty tensor has no bytes provider");
  }
  return m;
}

// Where a value sits in the description, rendered ("root['opt'][1]") only for error messages,
// so encoding a million-entry dict builds no strings.
struct Path {
  const Path* parent = nullptr;
  const std::string* key = nullptr;  // a string dict key
  int64_t index = 0;                 // a list/tuple index or an int dict key
  int depth = 0;

  Path Child(const std::string& k) const { return Path{this, &k, 0, depth + 1}; }
  Path Child(int64_t i) const { return Path{this, nullptr, i, depth + 1}; }

  std::string ToString() const {
    if (parent == nullptr) return "root";
    return parent->ToString() +
           (key != nullptr ? "['" + *key + "']" : "[" + std::to_string(index) + "]");
  }
};

// Protocol-2 pickle writer for SaveValue. Tensors are appended to `tensors` in first-use
// order; the storage key of a tensor is its index there.
class PickleEncoder {
 public:
  PickleEncoder(const SaveOptions& options, std::vector<SaveTensor>* tensors,
                std::vector<uint64_t>* tensor_n_bytes)
      : options_(options), tensors_(tensors), tensor_n_bytes_(tensor_n_bytes) {}

  Result<std::vector<std::byte>> Encode(const SaveValue& root) {
    Op(op::kProto);
    Op(2);
    UCPFS_RETURN_IF_ERROR(Value(root, Path{}));
    Op(op::kStop);
    return std::move(out_);
  }

 private:
  void Op(uint8_t b) { out_.push_back(static_cast<std::byte>(b)); }

  void Global(std::string_view module, std::string_view name) {
    Op(op::kGlobal);
    PutBytes(out_, module);
    Op('\n');
    PutBytes(out_, name);
    Op('\n');
  }

  void Str(std::string_view s) {  // BINUNICODE (SHORT_BINUNICODE is protocol 4)
    Op(op::kBinUnicode);
    PutLe(out_, s.size(), 4);
    PutBytes(out_, s);
  }

  void Int(int64_t v) {
    if (v >= 0 && v < 256) {
      Op(op::kBinInt1);
      PutLe(out_, static_cast<uint64_t>(v), 1);
    } else if (v >= 0 && v < 65536) {
      Op(op::kBinInt2);
      PutLe(out_, static_cast<uint64_t>(v), 2);
    } else if (v >= std::numeric_limits<int32_t>::min() &&
               v <= std::numeric_limits<int32_t>::max()) {
      Op(op::kBinInt);
      PutLe(out_, static_cast<uint64_t>(v), 4);
    } else {
      // LONG1: the shortest two's complement little-endian form (what CPython writes).
      const auto u = static_cast<uint64_t>(v);
      int n = 8;
      while (n > 1) {
        const auto top = static_cast<uint8_t>(u >> (8 * (n - 1)));
        const bool next_high = ((u >> (8 * (n - 2) + 7)) & 1) != 0;
        if ((top == 0x00 && !next_high) || (top == 0xFF && next_high)) {
          --n;
        } else {
          break;
        }
      }
      Op(op::kLong1);
      Op(static_cast<uint8_t>(n));
      PutLe(out_, u, n);
    }
  }

  void EmptyOrderedDict() {
    Global("collections", "OrderedDict");
    Op(op::kEmptyTuple);
    Op(op::kReduce);
  }

  void IntTuple(const std::vector<int64_t>& v) {
    if (v.size() > 3) Op(op::kMark);
    for (int64_t x : v) Int(x);
    static constexpr uint8_t kSmall[] = {op::kEmptyTuple, op::kTuple1, op::kTuple2, op::kTuple3};
    Op(v.size() <= 3 ? kSmall[v.size()] : op::kTuple);
  }

  Status Tensor(const SaveTensor& t, const Path& path) {
    auto measured = MeasureTensor(t);
    if (!measured.ok()) return measured.error().WithContext(path.ToString());
    const TensorShape& m = *measured;
    const std::string key = std::to_string(tensors_->size());
    tensors_->push_back(t);
    tensor_n_bytes_->push_back(m.n_bytes);
    const std::string_view storage_class = StorageClassName(t.dtype);
    const bool legacy = !storage_class.empty();
    // _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks)
    // or _rebuild_tensor_v3(..., backward_hooks, dtype) for dtypes with no typed storage.
    Global("torch._utils", legacy ? "_rebuild_tensor_v2" : "_rebuild_tensor_v3");
    Op(op::kMark);
    Op(op::kMark);  // persistent id ('storage', class, key, 'cpu', numel)
    Str("storage");
    if (legacy) {
      Global("torch", storage_class);
    } else {
      Global("torch.storage", "UntypedStorage");
    }
    Str(key);
    Str("cpu");
    // Typed storages count elements, UntypedStorage counts bytes.
    Int(static_cast<int64_t>(legacy ? m.numel : m.n_bytes));
    Op(op::kTuple);
    Op(op::kBinPersId);
    Int(0);  // storage_offset
    IntTuple(t.shape);
    IntTuple(m.strides);
    Op(t.requires_grad ? op::kNewTrue : op::kNewFalse);
    EmptyOrderedDict();  // backward_hooks
    if (!legacy) Global("torch", TorchName(t.dtype));
    Op(op::kTuple);
    Op(op::kReduce);
    return Status::Ok();
  }

  Status Value(const SaveValue& v, const Path& path) {
    if (path.depth > kMaxDepth) {
      return ResourceExhaustedError(path.ToString() + ": nesting deeper than " +
                                    std::to_string(kMaxDepth));
    }
    switch (v.kind()) {
      case SaveValue::Kind::kNone:
        Op(op::kNone);
        return Status::Ok();
      case SaveValue::Kind::kBool:
        Op(v.bool_value() ? op::kNewTrue : op::kNewFalse);
        return Status::Ok();
      case SaveValue::Kind::kInt:
        Int(v.int_value());
        return Status::Ok();
      case SaveValue::Kind::kFloat: {
        if (!options_.allow_floats) {
          return InvalidArgumentError(
              path.ToString() +
              ": float value with allow_floats = false (BINFLOAT is rejected by "
              "torch 1.13's weights_only=True unpickler)");
        }
        Op(op::kBinFloat);  // big-endian IEEE double
        const auto bits = std::bit_cast<uint64_t>(v.float_value());
        for (int i = 7; i >= 0; --i) Op(static_cast<uint8_t>(bits >> (8 * i)));
        return Status::Ok();
      }
      case SaveValue::Kind::kString:
        if (!ValidUtf8(v.string_value())) {
          return InvalidArgumentError(path.ToString() + ": string is not valid UTF-8");
        }
        Str(v.string_value());
        return Status::Ok();
      case SaveValue::Kind::kBytes: {
        // What CPython's protocol 2 writes for bytes: _codecs.encode(text, 'latin1'), where
        // text holds one code point per byte (UTF-8 encoded in BINUNICODE).
        std::string latin1;
        latin1.reserve(v.string_value().size() * 2);
        for (char c : v.string_value()) {
          const auto b = static_cast<uint8_t>(c);
          if (b < 0x80) {
            latin1.push_back(c);
          } else {
            latin1.push_back(static_cast<char>(0xC0 | (b >> 6)));
            latin1.push_back(static_cast<char>(0x80 | (b & 0x3F)));
          }
        }
        Global("_codecs", "encode");
        Str(latin1);
        Str("latin1");
        Op(op::kTuple2);
        Op(op::kReduce);
        return Status::Ok();
      }
      case SaveValue::Kind::kTuple: {
        const auto& items = v.items();
        if (items.size() > 3) Op(op::kMark);
        for (size_t i = 0; i < items.size(); ++i) {
          UCPFS_RETURN_IF_ERROR(Value(items[i], path.Child(static_cast<int64_t>(i))));
        }
        static constexpr uint8_t kSmall[] = {op::kEmptyTuple, op::kTuple1, op::kTuple2,
                                             op::kTuple3};
        Op(items.size() <= 3 ? kSmall[items.size()] : op::kTuple);
        return Status::Ok();
      }
      case SaveValue::Kind::kList: {
        const auto& items = v.items();
        Op(op::kEmptyList);
        for (size_t i = 0; i < items.size(); ++i) {
          if (i % kBatch == 0) Op(op::kMark);
          UCPFS_RETURN_IF_ERROR(Value(items[i], path.Child(static_cast<int64_t>(i))));
          if (i % kBatch == kBatch - 1 || i + 1 == items.size()) Op(op::kAppends);
        }
        return Status::Ok();
      }
      case SaveValue::Kind::kDict:
        return Dict(v, path);
      case SaveValue::Kind::kTensor:
        return Tensor(v.tensor(), path);
      case SaveValue::Kind::kGlobal:
        if (v.string_value().empty() || v.global_name().empty() ||
            v.string_value().find('\n') != std::string::npos || v.global_name().find('\n') != std::string::npos) {
          return InvalidArgumentError(path.ToString() + ": a global needs a module and a name without newlines");
        }
        Global(v.string_value(), v.global_name());
        return Status::Ok();
      case SaveValue::Kind::kObject:
        return Object(v, path);
    }
    return InternalError(path.ToString() + ": unknown SaveValue kind");
  }

  Status Object(const SaveValue& v, const Path& path) {
    const auto& parts = v.object_parts();
    if (parts.size() < 2 || parts[1].kind() != SaveValue::Kind::kTuple) {
      return InvalidArgumentError(path.ToString() + ": an object needs a callable and an argument tuple");
    }
    UCPFS_RETURN_IF_ERROR(Value(parts[0], path.Child("<callable>")));
    UCPFS_RETURN_IF_ERROR(Value(parts[1], path.Child("<args>")));
    Op(v.newobj() ? op::kNewObj : op::kReduce);
    const auto& items = v.items();
    for (size_t i = 0; i < items.size(); ++i) {
      if (i % kBatch == 0) Op(op::kMark);
      UCPFS_RETURN_IF_ERROR(Value(items[i], path.Child(static_cast<int64_t>(i))));
      if (i % kBatch == kBatch - 1 || i + 1 == items.size()) Op(op::kAppends);
    }
    const auto& dict = v.dict_items();
    for (size_t i = 0; i < dict.size(); ++i) {
      if (i % kBatch == 0) Op(op::kMark);
      UCPFS_RETURN_IF_ERROR(Value(dict[i].first, path.Child("<key>")));
      UCPFS_RETURN_IF_ERROR(Value(dict[i].second, path.Child("<value>")));
      if (i % kBatch == kBatch - 1 || i + 1 == dict.size()) Op(op::kSetItems);
    }
    if (v.has_state()) {
      UCPFS_RETURN_IF_ERROR(Value(parts[2], path.Child("<state>")));
      Op(op::kBuild);
    }
    return Status::Ok();
  }

  Status Dict(const SaveValue& v, const Path& path) {
    if (v.ordered()) {
      EmptyOrderedDict();
    } else {
      Op(op::kEmptyDict);
    }
    // Duplicate keys would silently collapse on load; views into `v` live through the call.
    std::unordered_set<std::string_view> string_keys;
    std::unordered_set<int64_t> int_keys;
    const auto& items = v.dict_items();
    for (size_t i = 0; i < items.size(); ++i) {
      const SaveValue& key = items[i].first;
      Path child;
      if (key.kind() == SaveValue::Kind::kString) {
        if (!string_keys.insert(key.string_value()).second) {
          return InvalidArgumentError(path.ToString() + ": duplicate dict key '" +
                                      key.string_value() + "'");
        }
        child = path.Child(key.string_value());
      } else if (key.kind() == SaveValue::Kind::kInt) {
        if (!int_keys.insert(key.int_value()).second) {
          return InvalidArgumentError(path.ToString() + ": duplicate dict key " +
                                      std::to_string(key.int_value()));
        }
        child = path.Child(key.int_value());
      } else {
        return InvalidArgumentError(path.ToString() + ": dict key #" + std::to_string(i) +
                                    " is neither a string nor an int");
      }
      if (i % kBatch == 0) Op(op::kMark);
      UCPFS_RETURN_IF_ERROR(Value(key, child));
      UCPFS_RETURN_IF_ERROR(Value(items[i].second, child));
      if (i % kBatch == kBatch - 1 || i + 1 == items.size()) Op(op::kSetItems);
    }
    return Status::Ok();
  }

  const SaveOptions& options_;
  std::vector<SaveTensor>* tensors_;
  std::vector<uint64_t>* tensor_n_bytes_;
  std::vector<std::byte> out_;
};

// One record before layout: its bytes in memory or a tensor's size.
struct PlannedRecord {
  std::string name;
  std::vector<std::byte> bytes;  // in-memory records
  int64_t tensor_index = -1;
  uint64_t n_bytes = 0;
};

std::vector<std::byte> BytesOf(std::string_view s) {
  std::vector<std::byte> out;
  PutBytes(out, s);
  return out;
}

}  // namespace

// --------------------------------------------------------------------------- LazyTorchFile

// Appends the file front to back: header bytes go to memory_ (merged into the current
// in-memory segment), tensor data becomes its own segment. Offsets were already checked for
// overflow by the planner, so plain additions are safe here.
class LazyTorchFile::Emitter {
 public:
  explicit Emitter(LazyTorchFile* file) : f_(file) {}

  uint64_t offset() const { return offset_; }
  std::vector<std::byte>& scratch() { return scratch_; }

  // Moves the scratch bytes into the file.
  void Flush() {
    if (scratch_.empty()) return;
    if (f_->segments_.empty() || f_->segments_.back().tensor_index >= 0) {
      f_->segments_.push_back(Segment{offset_, 0, f_->memory_.size(), -1});
    }
    f_->segments_.back().n_bytes += scratch_.size();
    f_->memory_.insert(f_->memory_.end(), scratch_.begin(), scratch_.end());
    offset_ += scratch_.size();
    scratch_.clear();
  }

  void Tensor(int64_t index, uint64_t n_bytes) {
    Flush();
    if (n_bytes == 0) return;
    f_->segments_.push_back(Segment{offset_, n_bytes, 0, index});
    offset_ += n_bytes;
  }

 private:
  LazyTorchFile* f_;
  uint64_t offset_ = 0;
  std::vector<std::byte> scratch_;
};

Result<std::shared_ptr<LazyTorchFile>> LazyTorchFile::Build(const SaveValue& root, std::string name,
                                                            const SaveOptions& options) {
  const std::string& prefix = options.prefix;
  if (prefix.empty() || prefix.size() > kMaxPrefixBytes || prefix.find('/') != std::string::npos ||
      prefix.find('\0') != std::string::npos || !ValidUtf8(prefix)) {
    return InvalidArgumentError(name +
                                ": archive prefix must be one non-empty UTF-8 path "
                                "component without '/' of at most 1024 bytes, got '" +
                                prefix + "'");
  }
  const uint32_t alignment = options.alignment;
  if (alignment == 0 || alignment > kMaxAlignment || !std::has_single_bit(alignment)) {
    return InvalidArgumentError(name + ": alignment must be a power of two in [1, 32768], got " +
                                std::to_string(alignment));
  }

  std::shared_ptr<LazyTorchFile> file(new LazyTorchFile());
  file->name_ = std::move(name);
  const std::string& fname = file->name_;

  // ---- the pickle, collecting tensors in first-use order (= storage key order)
  std::vector<uint64_t> tensor_n_bytes;  // checked numel * ItemSize, per storage key
  PickleEncoder encoder(options, &file->tensors_, &tensor_n_bytes);
  auto pickle = encoder.Encode(root);
  if (!pickle.ok()) return pickle.error().WithContext(fname);

  // ---- the record list, in torch 2.x order
  std::vector<PlannedRecord> recs;
  recs.reserve(file->tensors_.size() + 7);
  recs.push_back({"data.pkl", std::move(*pickle), -1, 0});
  recs.push_back({".format_version", BytesOf("1"), -1, 0});
  recs.push_back({".storage_alignment", BytesOf(std::to_string(alignment)), -1, 0});
  recs.push_back({"byteorder", BytesOf("little"), -1, 0});
  for (size_t k = 0; k < file->tensors_.size(); ++k) {
    recs.push_back({"data/" + std::to_string(k), {}, static_cast<int64_t>(k), tensor_n_bytes[k]});
  }
  recs.push_back({"version", BytesOf("3\n"), -1, 0});
  {
    // Deterministic stand-in for torch's serialization id: a hash of the record names and
    // sizes, then a hash of the pickle (torch only logs this value).
    uint64_t h1 = 0xcbf29ce484222325ull;
    for (auto& r : recs) {
      if (r.tensor_index < 0) r.n_bytes = r.bytes.size();
      h1 = Fnv1a(h1, r.name);
      h1 = Fnv1a(h1, std::string_view("\0", 1));
      h1 = Fnv1a(h1, std::to_string(r.n_bytes));
      h1 = Fnv1a(h1, std::string_view("\0", 1));
    }
    const uint64_t h2 = Fnv1a(h1 ^ 0x9e3779b97f4a7c15ull, recs[0].bytes);
    recs.push_back({".data/serialization_id", BytesOf(Digits20(h1) + Digits20(h2)), -1, 0});
    recs.back().n_bytes = recs.back().bytes.size();
  }

  // ---- plan: offsets from names and sizes only (the getPadding formula of torch's writer)
  const Status overflow = InvalidArgumentError(fname + ": file size overflows 64 bits");
  auto& layout = file->records_;
  layout.reserve(recs.size());
  uint64_t cursor = 0;
  for (const PlannedRecord& r : recs) {
    RecordLayout l;
    l.name = r.name;
    l.n_bytes = r.n_bytes;
    l.tensor_index = r.tensor_index;
    l.local_header_offset = cursor;
    const uint64_t full_name_bytes = prefix.size() + 1 + r.name.size();
    const bool big = r.n_bytes >= kU32Max;
    const bool far = cursor >= kU32Max;
    l.zip64 = big || far;
    const uint64_t zip64_extra = l.zip64 ? 4 + (big ? 16 : 0) + (far ? 8 : 0) : 0;
    // start = where the data would begin with no padding; pad to the alignment from there.
    auto start = CheckedAdd(cursor, kLocalHeaderBytes + full_name_bytes + zip64_extra + 4);
    if (!start) return overflow;
    const uint64_t pad = (alignment - *start % alignment) % alignment;
    l.local_extra_n_bytes = static_cast<uint16_t>(zip64_extra + 4 + pad);
    auto data_offset = CheckedAdd(*start, pad);
    if (!data_offset) return overflow;
    l.data_offset = *data_offset;
    l.descriptor_n_bytes = r.n_bytes == 0 ? 0 : (l.zip64 ? 24 : 16);
    auto end = CheckedAdd(l.data_offset, r.n_bytes);
    if (!end) return overflow;
    auto next = CheckedAdd(*end, l.descriptor_n_bytes);
    if (!next) return overflow;
    cursor = *next;
    const uint64_t cd_fields = (big ? 16 : 0) + (far ? 8 : 0);
    l.central_extra_n_bytes = static_cast<uint16_t>(cd_fields == 0 ? 0 : 4 + cd_fields);
    l.crc32 = r.tensor_index < 0 ? Crc32(r.bytes) : 0;  // tensors: 0, torch never checks
    layout.push_back(std::move(l));
  }
  file->cd_offset_ = cursor;
  uint64_t cd_n_bytes = 0;
  for (const RecordLayout& l : layout) {
    cd_n_bytes += kCentralHeaderBytes + prefix.size() + 1 + l.name.size() + l.central_extra_n_bytes;
  }
  file->cd_n_bytes_ = cd_n_bytes;  // small: bounded by the record count, which fits memory
  auto z64_eocd = CheckedAdd(file->cd_offset_, cd_n_bytes);
  if (!z64_eocd) return overflow;
  file->zip64_eocd_offset_ = *z64_eocd;
  auto total = CheckedAdd(*z64_eocd, kZip64EocdBytes + kZip64LocatorBytes + kEocdBytes);
  if (!total) return overflow;
  file->size_ = *total;

  // ---- emit: header bytes into memory, tensor data as provider segments
  Emitter em(file.get());
  auto& b = em.scratch();
  for (size_t i = 0; i < recs.size(); ++i) {
    const PlannedRecord& r = recs[i];
    const RecordLayout& l = layout[i];
    const std::string full_name = prefix + "/" + r.name;
    const bool big = l.n_bytes >= kU32Max;
    const bool far = l.local_header_offset >= kU32Max;
    const uint16_t flags = l.n_bytes == 0 ? 0x0800 : 0x0808;  // bit 3: descriptor; 11: UTF-8
    if (em.offset() + b.size() != l.local_header_offset) {
      return InternalError(fname + ": layout mismatch at local header of " + r.name);
    }
    PutLe(b, 0x04034b50, 4);
    PutLe(b, 0, 2);  // version needed
    PutLe(b, flags, 2);
    PutLe(b, 0, 2);  // method: stored
    PutLe(b, 0, 4);  // time, date
    PutLe(b, 0, 4);  // crc (in the descriptor)
    PutLe(b, 0, 4);  // compressed size (in the descriptor)
    PutLe(b, 0, 4);  // uncompressed size (in the descriptor)
    PutLe(b, full_name.size(), 2);
    PutLe(b, l.local_extra_n_bytes, 2);
    PutBytes(b, full_name);
    if (l.zip64) {
      PutLe(b, 0x0001, 2);
      PutLe(b, (big ? 16 : 0) + (far ? 8 : 0), 2);
      if (big) {
        PutLe(b, l.n_bytes, 8);
        PutLe(b, 0, 8);  // compressed size: 0 here, as miniz writes it
      }
      if (far) PutLe(b, l.local_header_offset, 8);
    }
    const uint64_t pad =
        l.local_extra_n_bytes - 4u - (l.zip64 ? 4u + (big ? 16u : 0u) + (far ? 8u : 0u) : 0u);
    PutBytes(b, "FB");
    PutLe(b, pad, 2);
    b.insert(b.end(), pad, std::byte{'Z'});
    if (em.offset() + b.size() != l.data_offset) {
      return InternalError(fname + ": layout mismatch at data of " + r.name);
    }
    if (r.tensor_index >= 0) {
      em.Tensor(r.tensor_index, r.n_bytes);
    } else {
      if (r.name == "data.pkl") {
        file->pickle_memory_offset_ = file->memory_.size() + b.size();
        file->pickle_n_bytes_ = r.bytes.size();
      }
      b.insert(b.end(), r.bytes.begin(), r.bytes.end());
    }
    if (l.descriptor_n_bytes != 0) {
      PutLe(b, 0x08074b50, 4);
      PutLe(b, l.crc32, 4);
      const int width = l.descriptor_n_bytes == 24 ? 8 : 4;
      PutLe(b, l.n_bytes, width);  // compressed == uncompressed (stored)
      PutLe(b, l.n_bytes, width);
    }
  }
  if (em.offset() + b.size() != file->cd_offset_) {
    return InternalError(fname + ": layout mismatch at the central directory");
  }
  for (const RecordLayout& l : layout) {
    const std::string full_name = prefix + "/" + l.name;
    const bool big = l.n_bytes >= kU32Max;
    const bool far = l.local_header_offset >= kU32Max;
    PutLe(b, 0x02014b50, 4);
    PutLe(b, 0, 2);  // made by
    PutLe(b, 0, 2);  // version needed
    PutLe(b, l.n_bytes == 0 ? 0x0800 : 0x0808, 2);
    PutLe(b, 0, 2);  // method
    PutLe(b, 0, 4);  // time, date
    PutLe(b, l.crc32, 4);
    PutLe(b, big ? kU32Max : l.n_bytes, 4);
    PutLe(b, big ? kU32Max : l.n_bytes, 4);
    PutLe(b, full_name.size(), 2);
    PutLe(b, l.central_extra_n_bytes, 2);
    PutLe(b, 0, 2);  // comment length
    PutLe(b, 0, 2);  // disk
    PutLe(b, 0, 2);  // internal attributes
    PutLe(b, 0, 4);  // external attributes
    PutLe(b, far ? kU32Max : l.local_header_offset, 4);
    PutBytes(b, full_name);
    if (l.central_extra_n_bytes != 0) {
      PutLe(b, 0x0001, 2);
      PutLe(b, l.central_extra_n_bytes - 4u, 2);
      if (big) {
        PutLe(b, l.n_bytes, 8);
        PutLe(b, l.n_bytes, 8);
      }
      if (far) PutLe(b, l.local_header_offset, 8);
    }
  }
  if (em.offset() + b.size() != file->zip64_eocd_offset_) {
    return InternalError(fname + ": layout mismatch at the ZIP64 end of central directory");
  }
  const uint64_t n = layout.size();
  PutLe(b, 0x06064b50, 4);  // ZIP64 EOCD: torch always writes one (MZ_ZIP_FLAG_WRITE_ZIP64)
  PutLe(b, kZip64EocdBytes - 12, 8);
  PutLe(b, 0x031e, 2);  // made by
  PutLe(b, 45, 2);      // version needed
  PutLe(b, 0, 4);       // this disk
  PutLe(b, 0, 4);       // disk with the CD
  PutLe(b, n, 8);
  PutLe(b, n, 8);
  PutLe(b, file->cd_n_bytes_, 8);
  PutLe(b, file->cd_offset_, 8);
  PutLe(b, 0x07064b50, 4);  // ZIP64 EOCD locator
  PutLe(b, 0, 4);
  PutLe(b, file->zip64_eocd_offset_, 8);
  PutLe(b, 1, 4);           // total disks
  PutLe(b, 0x06054b50, 4);  // EOCD
  PutLe(b, 0, 2);
  PutLe(b, 0, 2);
  PutLe(b, std::min<uint64_t>(n, 0xFFFF), 2);
  PutLe(b, std::min<uint64_t>(n, 0xFFFF), 2);
  PutLe(b, std::min(file->cd_n_bytes_, kU32Max), 4);
  PutLe(b, std::min(file->cd_offset_, kU32Max), 4);
  PutLe(b, 0, 2);  // comment length
  em.Flush();
  if (em.offset() != file->size_) {
    return InternalError(fname + ": layout mismatch at the end of the file");
  }
  return file;
}

void LazyTorchFile::Prefetch(uint64_t byte_offset, uint64_t n_bytes) const {
  if (byte_offset >= size_ || n_bytes == 0) return;
  const uint64_t end = byte_offset + std::min(n_bytes, size_ - byte_offset);
  auto it = std::upper_bound(segments_.begin(), segments_.end(), byte_offset,
                             [](uint64_t off, const Segment& s) { return off < s.file_offset; });
  --it;
  for (; it != segments_.end() && it->file_offset < end; ++it) {
    if (it->tensor_index < 0) continue;
    const uint64_t lo = std::max(byte_offset, it->file_offset);
    const uint64_t hi = std::min(end, it->file_offset + it->n_bytes);
    if (lo < hi) tensors_[static_cast<size_t>(it->tensor_index)].provider->Prefetch(lo - it->file_offset, hi - lo);
  }
}

Status TensorBytesProvider::DescribeReads(uint64_t byte_offset, uint64_t n_bytes, const SourceRunSink& sink) const {
  (void)byte_offset;
  (void)n_bytes;
  (void)sink;
  return UnsupportedError("this tensor's bytes provider cannot describe what it reads");
}

Status LazyTorchFile::DescribeReads(uint64_t byte_offset, uint64_t n_bytes, const SourceRunSink& sink) const {
  if (!RangeInside(byte_offset, n_bytes, size_)) {
    return OutOfRangeError(name_ + ": range of " + std::to_string(n_bytes) + " bytes at offset " +
                           std::to_string(byte_offset) + " past end (" + std::to_string(size_) + " bytes)");
  }
  if (n_bytes == 0) return Status::Ok();
  const uint64_t end = byte_offset + n_bytes;
  auto it = std::upper_bound(segments_.begin(), segments_.end(), byte_offset,
                             [](uint64_t off, const Segment& s) { return off < s.file_offset; });
  --it;  // segments_ starts at offset 0
  for (; it != segments_.end() && it->file_offset < end; ++it) {
    if (it->tensor_index < 0) continue;
    const uint64_t lo = std::max(byte_offset, it->file_offset);
    const uint64_t hi = std::min(end, it->file_offset + it->n_bytes);
    if (lo >= hi) continue;
    const Status st =
        tensors_[static_cast<size_t>(it->tensor_index)].provider->DescribeReads(lo - it->file_offset, hi - lo, sink);
    if (!st.ok()) return st.WithContext(name_ + ": data/" + std::to_string(it->tensor_index));
  }
  return Status::Ok();
}

Status LazyTorchFile::ReadAt(uint64_t byte_offset, std::span<std::byte> out) const {
  if (!RangeInside(byte_offset, out.size(), size_)) {
    return OutOfRangeError(name_ + ": read of " + std::to_string(out.size()) + " bytes at offset " +
                           std::to_string(byte_offset) + " past end (" + std::to_string(size_) +
                           " bytes)");
  }
  if (out.empty()) return Status::Ok();
  // The last segment starting at or before byte_offset.
  auto it = std::upper_bound(segments_.begin(), segments_.end(), byte_offset,
                             [](uint64_t off, const Segment& s) { return off < s.file_offset; });
  --it;  // segments_ starts at offset 0, so `it` was never begin()
  // The tensors' plain source reads go out together when the read ends: one batch per source file.
  std::optional<ReadBatch> batch;
  if (!LegacyReadPath()) batch.emplace();
  size_t done = 0;
  while (done < out.size()) {
    const Segment& s = *it++;
    const uint64_t pos = byte_offset + done;
    const uint64_t within = pos - s.file_offset;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(s.n_bytes - within, out.size() - done));
    std::span<std::byte> dst = out.subspan(done, n);
    if (s.tensor_index < 0) {
      std::memcpy(dst.data(), memory_.data() + s.memory_offset + within, n);
    } else {
      const Status st = tensors_[static_cast<size_t>(s.tensor_index)].provider->Read(within, dst);
      if (!st.ok()) {
        return st.WithContext(name_ + ": data/" + std::to_string(s.tensor_index) +
                              " at tensor byte offset " + std::to_string(within));
      }
    }
    done += n;
  }
  if (batch) UCPFS_RETURN_IF_ERROR(batch->Finish().WithContext(name_));
  return Status::Ok();
}

}  // namespace ucpfs::format
