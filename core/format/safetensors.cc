// safetensors reader and lazy writer (see safetensors.h for the format and the rules).
//
// The reader reads the 8-byte length, checks it against the file and the limit, reads the header
// once, and streams it through nlohmann's SAX parser (iterative: no recursion; it validates
// UTF-8, refuses lone surrogates, numbers that overflow a double, and trailing bytes) into a
// handler that checks the schema event by event and refuses the first thing out of place. No
// document tree is built, so a hostile header cannot make the parse allocate more than the
// records it describes, nor nest deeper than the schema's three levels. Sizes and offsets are
// then checked with overflow-checked arithmetic, and the tensors' ranges must tile the data
// buffer exactly.
//
// The writer's JSON is written by hand, byte for byte as the library's serde_json does.
#include "core/format/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string_view>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "core/checked.h"

namespace ucpfs::format {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kLengthNBytes = 8;
constexpr std::string_view kMetadataKey = "__metadata__";
// Longest piece of a name or of a parser message quoted in an error.
constexpr size_t kMaxQuotedNBytes = 200;

struct LibraryDType {
  std::string_view name;
  std::optional<DType> dtype;  // nullopt: ucpfs has no DType for it
};

// The library's `Dtype` enum in declaration order, which is also its derived `Ord`: the writer
// orders tensors by this index, largest first (verified against safetensors 0.8.0's save_file).
constexpr LibraryDType kLibraryDTypes[] = {
    {"BOOL", DType::kBool},
    {"F4", std::nullopt},
    {"F6_E2M3", std::nullopt},
    {"F6_E3M2", std::nullopt},
    {"U8", DType::kUInt8},
    {"I8", DType::kInt8},
    {"F8_E5M2", DType::kFloat8E5M2},
    {"F8_E4M3", DType::kFloat8E4M3FN},
    {"F8_E8M0", DType::kFloat8E8M0Fnu},
    {"F8_E4M3FNUZ", DType::kFloat8E4M3Fnuz},
    {"F8_E5M2FNUZ", DType::kFloat8E5M2Fnuz},
    {"I16", DType::kInt16},
    {"U16", DType::kUInt16},
    {"F16", DType::kFloat16},
    {"BF16", DType::kBFloat16},
    {"I32", DType::kInt32},
    {"U32", DType::kUInt32},
    {"F32", DType::kFloat32},
    {"C64", DType::kComplex64},
    {"F64", DType::kFloat64},
    {"I64", DType::kInt64},
    {"U64", DType::kUInt64},
};
constexpr int kNumLibraryDTypes = static_cast<int>(std::size(kLibraryDTypes));

int LibraryIndexOfName(std::string_view name) {
  for (int i = 0; i < kNumLibraryDTypes; ++i) {
    if (kLibraryDTypes[i].name == name) return i;
  }
  return -1;
}

int LibraryIndexOfDType(DType dtype) {
  for (int i = 0; i < kNumLibraryDTypes; ++i) {
    if (kLibraryDTypes[i].dtype == dtype) return i;
  }
  return -1;
}

// One UTF-8 sequence at s[i]: its code point (advancing i past it), or nullopt (advancing i by
// one byte). Strict, as Python and Rust decode: no overlongs, no surrogates, <= U+10FFFF.
std::optional<uint32_t> NextCodePoint(std::string_view s, size_t& i) {
  const auto lead = static_cast<uint8_t>(s[i]);
  size_t n_bytes = 1;
  uint32_t cp = lead;
  if (lead >= 0xC2 && lead <= 0xDF) {
    n_bytes = 2;
    cp = lead & 0x1Fu;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    n_bytes = 3;
    cp = lead & 0x0Fu;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    n_bytes = 4;
    cp = lead & 0x07u;
  } else if (lead >= 0x80) {
    ++i;
    return std::nullopt;
  }
  if (s.size() - i < n_bytes) {
    ++i;
    return std::nullopt;
  }
  for (size_t k = 1; k < n_bytes; ++k) {
    const auto c = static_cast<uint8_t>(s[i + k]);
    if ((c & 0xC0) != 0x80) {
      ++i;
      return std::nullopt;
    }
    cp = (cp << 6) | (c & 0x3Fu);
  }
  const uint32_t min_cp = n_bytes == 3 ? 0x800 : n_bytes == 4 ? 0x10000 : 0;
  if (cp < min_cp || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
    ++i;
    return std::nullopt;
  }
  i += n_bytes;
  return cp;
}

bool ValidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    if (!NextCodePoint(s, i)) return false;
  }
  return true;
}

void AppendHex4(std::string& out, uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(v & 0xFFFF));
  out += buf;
}

// The escape both JSON writers use for `"`, `\` and the five characters with a short form, or
// nullptr.
const char* ShortEscape(uint32_t c) {
  switch (c) {
    case '"': return "\\\"";
    case '\\': return "\\\\";
    case '\b': return "\\b";
    case '\f': return "\\f";
    case '\n': return "\\n";
    case '\r': return "\\r";
    case '\t': return "\\t";
    default: return nullptr;
  }
}

// s in double quotes, escaped as serde_json (the library's writer) does: the short escapes,
// other control characters as \u00xx (lowercase); everything else raw.
void AppendSerdeString(std::string& out, std::string_view s) {
  out += '"';
  for (char ch : s) {
    const auto c = static_cast<uint8_t>(ch);
    if (const char* e = ShortEscape(c)) {
      out += e;
    } else if (c < 0x20) {
      AppendHex4(out, c);
    } else {
      out += ch;
    }
  }
  out += '"';
}

// s in double quotes, escaped as Python's json.dumps with ensure_ascii=True: the short escapes,
// the rest of printable ASCII (0x20..0x7e) raw, everything else \uxxxx (lowercase), code points
// above U+FFFF as a surrogate pair. Bytes that are not UTF-8 become U+FFFD (core/json_text.h's
// rule).
void AppendPythonAsciiString(std::string& out, std::string_view s) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    const uint32_t cp = NextCodePoint(s, i).value_or(0xFFFD);
    if (const char* e = ShortEscape(cp)) {
      out += e;
    } else if (cp >= 0x20 && cp <= 0x7e) {
      out += static_cast<char>(cp);
    } else if (cp <= 0xFFFF) {
      AppendHex4(out, cp);
    } else {
      const uint32_t v = cp - 0x10000;
      AppendHex4(out, 0xD800 + (v >> 10));
      AppendHex4(out, 0xDC00 + (v & 0x3FF));
    }
  }
  out += '"';
}

// A name (or parser text) fit for an error message: quoted, bytes outside printable ASCII as
// \xNN, cut after kMaxQuotedNBytes.
std::string Quoted(std::string_view s) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size() && i < kMaxQuotedNBytes; ++i) {
    const auto c = static_cast<uint8_t>(s[i]);
    if (c < 0x20 || c >= 0x7f || c == '"' || c == '\\') {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > kMaxQuotedNBytes) out += "...";
  return out + "\"";
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

// numel * item size of a shape whose dims are non-negative, or nullopt on 64-bit overflow. The
// product is taken left to right, as the library does, so [2^40, 2^40, 0] overflows.
std::optional<uint64_t> ShapeNBytes(const std::vector<int64_t>& shape, uint32_t item_n_bytes) {
  uint64_t n_elems = 1;
  for (int64_t d : shape) {
    const auto next = CheckedMul(n_elems, static_cast<uint64_t>(d));
    if (!next) return std::nullopt;
    n_elems = *next;
  }
  return CheckedMul(n_elems, item_n_bytes);
}

// What a JSON value turned out to be, for the handlers and their messages.
enum class JsonKind { kNull, kBool, kNegative, kUnsigned, kFloat, kString, kObject, kArray };

const char* KindName(JsonKind kind) {
  switch (kind) {
    case JsonKind::kNull: return "null";
    case JsonKind::kBool: return "a boolean";
    case JsonKind::kNegative: return "a negative integer";
    case JsonKind::kUnsigned: return "an integer";
    case JsonKind::kFloat: return "a number that is not an integer";
    case JsonKind::kString: return "a string";
    case JsonKind::kObject: return "an object";
    case JsonKind::kArray: return "an array";
  }
  return "?";
}

// The part of nlohmann's SAX interface every handler shares: each value event becomes one
// Value(kind, ...) call, and a refusal is a recorded Status plus `false`, which stops the parse.
// Derived handlers provide Value, Key, EndObject and EndArray.
template <typename Derived>
class SaxHandler {
 public:
  explicit SaxHandler(std::string context) : context_(std::move(context)) {}

  bool null() { return Self().Value(JsonKind::kNull, 0, nullptr); }
  bool boolean(bool) { return Self().Value(JsonKind::kBool, 0, nullptr); }
  // nlohmann reports non-negative integers as unsigned; "-0" comes here and counts as 0.
  bool number_integer(Json::number_integer_t v) {
    return v < 0 ? Self().Value(JsonKind::kNegative, 0, nullptr)
                 : Self().Value(JsonKind::kUnsigned, static_cast<uint64_t>(v), nullptr);
  }
  bool number_unsigned(Json::number_unsigned_t v) { return Self().Value(JsonKind::kUnsigned, v, nullptr); }
  bool number_float(Json::number_float_t, const std::string&) {
    return Self().Value(JsonKind::kFloat, 0, nullptr);
  }
  bool string(std::string& v) { return Self().Value(JsonKind::kString, 0, &v); }
  bool binary(Json::binary_t&) { return Fail(InternalError(context_ + ": binary value in JSON text")); }
  bool start_object(std::size_t) { return Self().Value(JsonKind::kObject, 0, nullptr); }
  bool start_array(std::size_t) { return Self().Value(JsonKind::kArray, 0, nullptr); }
  bool key(std::string& k) { return Self().Key(k); }
  bool end_object() { return Self().EndObject(); }
  bool end_array() { return Self().EndArray(); }
  bool parse_error(std::size_t position, const std::string&, const Json::exception& ex) {
    // what() is "[json.exception.parse_error.101] parse error at line 1, column 7: ...".
    std::string_view what = ex.what();
    if (const size_t at = what.find("] "); at != std::string_view::npos) what.remove_prefix(at + 2);
    std::string text = Quoted(what);
    return Fail(CorruptError(context_ + " byte " + std::to_string(position) + ": invalid JSON: " +
                             text.substr(1, text.size() - 2)));
  }

  // Runs the parse; the first refusal (ours or the parser's) comes back.
  Status Parse(std::string_view text) {
    // nlohmann's lexer takes a NUL byte for the end of the input, so "{}\0<anything>" would
    // parse; JSON text cannot hold a raw NUL anywhere (inside strings it must be escaped).
    if (const size_t at = text.find('\0'); at != std::string_view::npos) {
      Fail(CorruptError(context_ + " byte " + std::to_string(at) + ": invalid JSON: a NUL byte"));
      return status_;
    }
    bool ok = false;
    try {
      ok = Json::sax_parse(text.begin(), text.end(), &Self());
    } catch (const std::exception& e) {  // nlohmann should not throw here; bad_alloc might
      Fail(CorruptError(context_ + ": JSON parse failed: " + e.what()));
      return status_;
    }
    if (!ok && status_.ok()) status_ = CorruptError(context_ + ": invalid JSON");
    return status_;
  }

 protected:
  bool Fail(Status status) {
    if (status_.ok()) status_ = std::move(status);
    return false;
  }
  bool Corrupt(const std::string& what) { return Fail(CorruptError(context_ + ": " + what)); }
  bool Refuse(const std::optional<std::string>& what) { return what ? Corrupt(*what) : true; }
  // The document's first value: it must be an object.
  bool TopValue(JsonKind kind) {
    return kind == JsonKind::kObject ? true : Corrupt(std::string("is ") + KindName(kind) + ", not a JSON object");
  }
  bool Exhausted(const std::string& what) { return Fail(ResourceExhaustedError(context_ + ": " + what)); }

  std::string context_;  // "<file>: safetensors header" and the like

 private:
  Derived& Self() { return static_cast<Derived&>(*this); }
  Status status_;
};

// An object of strings, {key: "value", ...}, as its events arrive: __metadata__ and weight_map.
// Key and Value return the reason for a refusal, or nullopt.
class StringMapReader {
 public:
  explicit StringMapReader(std::string label) : label_(std::move(label)) {}

  std::optional<std::string> Key(std::string& key) {
    if (!keys_.insert(key).second) return label_ + ": duplicate key " + Quoted(key);
    items_.emplace_back(std::move(key), std::string());
    return std::nullopt;
  }
  std::optional<std::string> Value(JsonKind kind, std::string* text) {
    if (kind != JsonKind::kString) {
      return label_ + " value of key " + Quoted(items_.back().first) + " is " + KindName(kind) + ", not a string";
    }
    items_.back().second = std::move(*text);
    return std::nullopt;
  }
  size_t size() const { return items_.size(); }
  std::vector<std::pair<std::string, std::string>>& items() { return items_; }

 private:
  std::string label_;
  std::unordered_set<std::string> keys_;
  std::vector<std::pair<std::string, std::string>> items_;
};

// One tensor entry as the header states it, before its numbers are checked.
struct RawTensor {
  std::string name;
  int dtype_index = -1;
  std::vector<int64_t> shape;
  std::vector<uint64_t> data_offsets;
  uint8_t fields_seen = 0;  // bits: kFieldDType, kFieldShape, kFieldOffsets
};

constexpr uint8_t kFieldDType = 1, kFieldShape = 2, kFieldOffsets = 4;

// The header's schema: {"__metadata__": {str: str} | null, name: {"dtype": str,
// "shape": [uint...], "data_offsets": [uint, uint]}, ...}.
class HeaderHandler final : public SaxHandler<HeaderHandler> {
 public:
  HeaderHandler(std::string context, const SafetensorsLimits& limits)
      : SaxHandler(std::move(context)), limits_(limits) {}

  bool Value(JsonKind kind, uint64_t number, std::string* text) {
    switch (at_) {
      case At::kStart:
        at_ = At::kTop;
        return TopValue(kind);
      case At::kTop:
        if (in_metadata_key_) {
          if (kind == JsonKind::kNull) return true;  // the library reads null as no metadata
          if (kind != JsonKind::kObject) {
            return Corrupt("__metadata__ is " + std::string(KindName(kind)) + ", not an object");
          }
          at_ = At::kMetadata;
          return true;
        }
        if (kind != JsonKind::kObject) {
          return Corrupt(TensorContext() + "entry is " + KindName(kind) + ", not an object");
        }
        at_ = At::kTensor;
        return true;
      case At::kTensor: return FieldValue(kind, text);
      case At::kShape: return ShapeValue(kind, number);
      case At::kOffsets: return OffsetValue(kind, number);
      case At::kMetadata: return Refuse(metadata_.Value(kind, text));
      case At::kEnd: break;
    }
    return Corrupt("value after the end");  // the parser stops before this
  }

  bool Key(std::string& key) {
    if (at_ == At::kTop) {
      if (!names_.insert(key).second) return Corrupt("duplicate name " + Quoted(key));
      in_metadata_key_ = key == kMetadataKey;
      if (in_metadata_key_) return true;
      if (tensors_.size() >= limits_.max_tensors) {
        return Exhausted("more than " + std::to_string(limits_.max_tensors) + " tensors");
      }
      tensors_.emplace_back();
      tensors_.back().name = std::move(key);
      return true;
    }
    if (at_ == At::kMetadata) return Refuse(metadata_.Key(key));
    // At::kTensor.
    RawTensor& t = tensors_.back();
    uint8_t bit = 0;
    if (key == "dtype") bit = kFieldDType;
    if (key == "shape") bit = kFieldShape;
    if (key == "data_offsets") bit = kFieldOffsets;
    if (bit == 0) return Corrupt(TensorContext() + "unexpected field " + Quoted(key));
    if ((t.fields_seen & bit) != 0) return Corrupt(TensorContext() + "duplicate field " + Quoted(key));
    t.fields_seen |= bit;
    field_ = bit;
    return true;
  }

  bool EndObject() {
    if (at_ == At::kMetadata) {
      at_ = At::kTop;
    } else if (at_ == At::kTensor) {
      const uint8_t seen = tensors_.back().fields_seen;
      if ((seen & kFieldDType) == 0) return Corrupt(TensorContext() + "no dtype");
      if ((seen & kFieldShape) == 0) return Corrupt(TensorContext() + "no shape");
      if ((seen & kFieldOffsets) == 0) return Corrupt(TensorContext() + "no data_offsets");
      at_ = At::kTop;
    } else {
      at_ = At::kEnd;
    }
    return true;
  }

  bool EndArray() {
    if (at_ == At::kOffsets && tensors_.back().data_offsets.size() != 2) {
      return Corrupt(TensorContext() + "data_offsets has " +
                     std::to_string(tensors_.back().data_offsets.size()) + " entries, not 2");
    }
    at_ = At::kTensor;  // arrays only open inside a tensor entry
    return true;
  }

  std::vector<RawTensor>& tensors() { return tensors_; }
  std::vector<std::pair<std::string, std::string>>& metadata() { return metadata_.items(); }

 private:
  // Where the parse is: which container the next event belongs to.
  enum class At { kStart, kTop, kTensor, kShape, kOffsets, kMetadata, kEnd };

  std::string TensorContext() const { return "tensor " + Quoted(tensors_.back().name) + ": "; }

  bool FieldValue(JsonKind kind, std::string* text) {
    RawTensor& t = tensors_.back();
    if (field_ == kFieldDType) {
      if (kind != JsonKind::kString) return Corrupt(TensorContext() + "dtype is " + KindName(kind) + ", not a string");
      t.dtype_index = LibraryIndexOfName(*text);
      if (t.dtype_index < 0) return Corrupt(TensorContext() + "unknown dtype " + Quoted(*text));
      return true;
    }
    const char* field = field_ == kFieldShape ? "shape" : "data_offsets";
    if (kind != JsonKind::kArray) return Corrupt(TensorContext() + field + " is " + KindName(kind) + ", not an array");
    at_ = field_ == kFieldShape ? At::kShape : At::kOffsets;
    return true;
  }

  bool ShapeValue(JsonKind kind, uint64_t number) {
    RawTensor& t = tensors_.back();
    if (kind == JsonKind::kNegative) return Corrupt(TensorContext() + "negative dimension in shape");
    if (kind != JsonKind::kUnsigned) return Corrupt(TensorContext() + "shape holds " + KindName(kind));
    if (number > static_cast<uint64_t>(INT64_MAX)) {
      return Corrupt(TensorContext() + "dimension " + std::to_string(number) + " is above 2^63 - 1");
    }
    if (t.shape.size() >= limits_.max_rank) {
      return Exhausted(TensorContext() + "rank above " + std::to_string(limits_.max_rank));
    }
    t.shape.push_back(static_cast<int64_t>(number));
    return true;
  }

  bool OffsetValue(JsonKind kind, uint64_t number) {
    RawTensor& t = tensors_.back();
    if (kind != JsonKind::kUnsigned) return Corrupt(TensorContext() + "data_offsets holds " + KindName(kind));
    if (t.data_offsets.size() >= 2) return Corrupt(TensorContext() + "data_offsets has more than 2 entries");
    t.data_offsets.push_back(number);
    return true;
  }

  const SafetensorsLimits& limits_;
  At at_ = At::kStart;
  bool in_metadata_key_ = false;  // kTop: the pending value is __metadata__'s
  uint8_t field_ = 0;             // kTensor: the field whose value is pending
  std::unordered_set<std::string> names_;
  std::vector<RawTensor> tensors_;
  StringMapReader metadata_{std::string(kMetadataKey)};
};

// model.safetensors.index.json: {"weight_map": {str: str}, anything else skipped}.
class IndexHandler final : public SaxHandler<IndexHandler> {
 public:
  IndexHandler(std::string context, const SafetensorsLimits& limits)
      : SaxHandler(std::move(context)), limits_(limits) {}

  bool Value(JsonKind kind, uint64_t, std::string* text) {
    if (!skipped_.empty()) return SkipValue(kind);
    switch (at_) {
      case At::kStart:
        at_ = At::kTop;
        return TopValue(kind);
      case At::kTop:
        if (!in_weight_map_key_) return SkipValue(kind);
        if (kind != JsonKind::kObject) return Corrupt(std::string("weight_map is ") + KindName(kind) + ", not an object");
        at_ = At::kWeightMap;
        return true;
      case At::kWeightMap: return Refuse(weight_map_.Value(kind, text));
      case At::kEnd: break;
    }
    return Corrupt("value after the end");  // the parser stops before this
  }

  bool Key(std::string& key) {
    if (!skipped_.empty()) {
      if (!skipped_.back().insert(key).second) return Corrupt("duplicate key " + Quoted(key));
      return true;
    }
    if (at_ == At::kTop) {
      if (!top_keys_.insert(key).second) return Corrupt("duplicate key " + Quoted(key));
      in_weight_map_key_ = key == "weight_map";
      return true;
    }
    if (weight_map_.size() >= limits_.max_tensors) {
      return Exhausted("weight_map has more than " + std::to_string(limits_.max_tensors) + " entries");
    }
    return Refuse(weight_map_.Key(key));
  }

  bool EndObject() {
    if (!skipped_.empty()) {
      skipped_.pop_back();
    } else if (at_ == At::kWeightMap) {
      at_ = At::kTop;
      has_weight_map_ = true;
    } else {
      at_ = At::kEnd;
    }
    return true;
  }

  bool EndArray() {
    skipped_.pop_back();  // arrays only open while skipping
    return true;
  }

  bool has_weight_map() const { return has_weight_map_; }
  std::vector<std::pair<std::string, std::string>>& weight_map() { return weight_map_.items(); }

 private:
  enum class At { kStart, kTop, kWeightMap, kEnd };

  // A value nobody reads: only its nesting (bounded) and duplicate keys are checked. One key set
  // per open container (empty for arrays).
  bool SkipValue(JsonKind kind) {
    if (kind != JsonKind::kObject && kind != JsonKind::kArray) return true;
    if (skipped_.size() + 1 >= static_cast<size_t>(kMaxIndexJsonDepth)) {
      return Exhausted("nested deeper than " + std::to_string(kMaxIndexJsonDepth) + " levels");
    }
    skipped_.emplace_back();
    return true;
  }

  const SafetensorsLimits& limits_;
  At at_ = At::kStart;
  bool in_weight_map_key_ = false;
  bool has_weight_map_ = false;
  std::unordered_set<std::string> top_keys_;
  std::vector<std::unordered_set<std::string>> skipped_;
  StringMapReader weight_map_{"weight_map"};
};

uint64_t LoadLe64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | std::to_integer<uint64_t>(p[i]);
  return v;
}

// Checks one tensor's dtype, shape and offsets on their own; the tiling check comes after.
Result<SafetensorsTensor> CheckTensor(const std::string& context, RawTensor& raw,
                                      uint64_t data_byte_offset, uint64_t buffer_n_bytes) {
  const std::string where = context + ": tensor " + Quoted(raw.name) + ": ";
  const LibraryDType& lib = kLibraryDTypes[raw.dtype_index];
  if (!lib.dtype) {
    return UnsupportedError(where + "dtype " + std::string(lib.name) + " has no ucpfs dtype");
  }
  const auto n_bytes = ShapeNBytes(raw.shape, ItemSize(*lib.dtype));
  if (!n_bytes) return CorruptError(where + "shape " + ShapeText(raw.shape) + " of " + std::string(lib.name) + " has more than 2^64 bytes");
  const uint64_t begin = raw.data_offsets[0];
  const uint64_t end = raw.data_offsets[1];
  const std::string offsets = "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "]";
  if (begin > end) return CorruptError(where + offsets + " are reversed");
  if (end - begin != *n_bytes) {
    return CorruptError(where + offsets + " hold " + std::to_string(end - begin) + " bytes, but shape " +
                        ShapeText(raw.shape) + " of " + std::string(lib.name) + " needs " + std::to_string(*n_bytes));
  }
  if (end > buffer_n_bytes) {
    return CorruptError(where + offsets + " run past the end of the data buffer (" +
                        std::to_string(buffer_n_bytes) + " bytes, at file offset " +
                        std::to_string(data_byte_offset) + ")");
  }
  return SafetensorsTensor{.name = std::move(raw.name),
                           .dtype = *lib.dtype,
                           .shape = std::move(raw.shape),
                           .byte_offset = data_byte_offset + begin,
                           .n_bytes = *n_bytes};
}

}  // namespace

std::string_view SafetensorsDTypeName(DType dtype) {
  const int i = LibraryIndexOfDType(dtype);
  return i < 0 ? std::string_view() : kLibraryDTypes[i].name;
}

Result<SafetensorsHeader> ReadSafetensors(const ByteSource& src, const SafetensorsLimits& limits) {
  const std::string& file = src.Name();
  const uint64_t file_n_bytes = src.Size();
  if (file_n_bytes < kLengthNBytes) {
    return CorruptError(file + ": offset 0: file of " + std::to_string(file_n_bytes) +
                        " bytes is shorter than the 8-byte header length");
  }
  std::byte length_bytes[kLengthNBytes];
  UCPFS_RETURN_IF_ERROR(src.ReadAt(0, length_bytes));
  SafetensorsHeader header;
  header.header_n_bytes = LoadLe64(length_bytes);
  const std::string length_text = "header length " + std::to_string(header.header_n_bytes);
  if (header.header_n_bytes < 2) {
    return CorruptError(file + ": offset 0: " + length_text + " is below 2, the shortest JSON object");
  }
  if (!RangeInside(kLengthNBytes, header.header_n_bytes, file_n_bytes)) {
    return CorruptError(file + ": offset 0: " + length_text + " runs past the end of the file (" +
                        std::to_string(file_n_bytes) + " bytes)");
  }
  if (header.header_n_bytes > limits.max_header_bytes) {
    return ResourceExhaustedError(file + ": offset 0: " + length_text + " is above the limit of " +
                                  std::to_string(limits.max_header_bytes) + " bytes");
  }
  header.data_byte_offset = kLengthNBytes + header.header_n_bytes;  // inside the file: no overflow
  UCPFS_ASSIGN_OR_RETURN(std::vector<std::byte> text,
                         ReadRange(src, kLengthNBytes, header.header_n_bytes, limits.max_header_bytes));

  const std::string context = file + ": safetensors header";
  HeaderHandler handler(context, limits);
  UCPFS_RETURN_IF_ERROR(
      handler.Parse(std::string_view(reinterpret_cast<const char*>(text.data()), text.size())));
  text = {};

  const uint64_t buffer_n_bytes = file_n_bytes - header.data_byte_offset;
  header.tensors.reserve(handler.tensors().size());
  for (RawTensor& raw : handler.tensors()) {
    UCPFS_ASSIGN_OR_RETURN(SafetensorsTensor t, CheckTensor(context, raw, header.data_byte_offset, buffer_n_bytes));
    header.tensors.push_back(std::move(t));
  }
  // The ranges must tile [0, buffer_n_bytes): sorted by (begin, end), each begins where the
  // previous ended. Empty tensors sort before a tensor at the same offset, so they fit anywhere
  // on a boundary.
  std::sort(header.tensors.begin(), header.tensors.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    if (a.byte_offset != b.byte_offset) return a.byte_offset < b.byte_offset;
    if (a.n_bytes != b.n_bytes) return a.n_bytes < b.n_bytes;
    return a.name < b.name;
  });
  uint64_t covered = header.data_byte_offset;  // file offset up to which the buffer is tiled
  const SafetensorsTensor* previous = nullptr;
  for (const SafetensorsTensor& t : header.tensors) {
    const std::string range = "[" + std::to_string(t.byte_offset - header.data_byte_offset) + ", " +
                              std::to_string(t.byte_offset - header.data_byte_offset + t.n_bytes) + ")";
    if (t.byte_offset < covered) {
      return CorruptError(context + ": tensor " + Quoted(t.name) + ": data " + range + " overlaps tensor " +
                          Quoted(previous->name));
    }
    if (t.byte_offset > covered) {
      return CorruptError(context + ": tensor " + Quoted(t.name) + ": data " + range + " leaves a hole of " +
                          std::to_string(t.byte_offset - covered) + " bytes at file offset " + std::to_string(covered));
    }
    covered = t.byte_offset + t.n_bytes;
    previous = &t;
  }
  if (covered != file_n_bytes) {
    return CorruptError(context + ": the tensors cover " + std::to_string(covered - header.data_byte_offset) +
                        " bytes of the " + std::to_string(buffer_n_bytes) +
                        "-byte data buffer: the file has bytes that belong to no tensor from offset " +
                        std::to_string(covered));
  }
  header.metadata = std::move(handler.metadata());
  return header;
}

Result<std::vector<std::pair<std::string, std::string>>> ParseSafetensorsIndex(
    std::string_view json_text, const std::string& source_name, const SafetensorsLimits& limits) {
  if (json_text.size() > limits.max_header_bytes) {
    return ResourceExhaustedError(source_name + ": index of " + std::to_string(json_text.size()) +
                                  " bytes is above the limit of " + std::to_string(limits.max_header_bytes));
  }
  IndexHandler handler(source_name, limits);
  UCPFS_RETURN_IF_ERROR(handler.Parse(json_text));
  if (!handler.has_weight_map()) return CorruptError(source_name + ": no weight_map");
  return std::move(handler.weight_map());
}

Result<std::shared_ptr<const LazySafetensorsFile>> LazySafetensorsFile::Build(
    std::vector<std::pair<std::string, SaveTensor>> tensors,
    std::vector<std::pair<std::string, std::string>> metadata, std::string name) {
  struct Planned {
    std::string name;
    SaveTensor tensor;
    int dtype_index;
    uint64_t n_bytes;
  };
  std::vector<Planned> planned;
  planned.reserve(tensors.size());
  for (auto& [tensor_name, t] : tensors) {
    const std::string where = name + ": tensor " + Quoted(tensor_name) + ": ";
    if (tensor_name.empty() || tensor_name == kMetadataKey || !ValidUtf8(tensor_name)) {
      return InvalidArgumentError(where + "the name must be non-empty UTF-8 other than __metadata__");
    }
    const int dtype_index = LibraryIndexOfDType(t.dtype);
    if (dtype_index < 0) {
      return InvalidArgumentError(where + "safetensors has no dtype for " + std::string(TorchName(t.dtype)));
    }
    if (std::any_of(t.shape.begin(), t.shape.end(), [](int64_t d) { return d < 0; })) {
      return InvalidArgumentError(where + "negative dimension in shape " + ShapeText(t.shape));
    }
    const auto n_bytes = ShapeNBytes(t.shape, ItemSize(t.dtype));
    if (!n_bytes) return InvalidArgumentError(where + "shape " + ShapeText(t.shape) + " has more than 2^64 bytes");
    if (*n_bytes > 0 && t.provider == nullptr) return InvalidArgumentError(where + "no provider for its bytes");
    planned.push_back(Planned{std::move(tensor_name), std::move(t), dtype_index, *n_bytes});
  }
  // The library's order: dtype (its enum order) descending, then name ascending, bytewise.
  std::sort(planned.begin(), planned.end(), [](const Planned& a, const Planned& b) {
    if (a.dtype_index != b.dtype_index) return a.dtype_index > b.dtype_index;
    return a.name < b.name;
  });
  std::vector<const std::string*> names;
  for (const Planned& p : planned) names.push_back(&p.name);
  std::sort(names.begin(), names.end(), [](const std::string* a, const std::string* b) { return *a < *b; });
  for (size_t i = 1; i < names.size(); ++i) {
    if (*names[i] == *names[i - 1]) return InvalidArgumentError(name + ": duplicate tensor name " + Quoted(*names[i]));
  }
  std::unordered_set<std::string_view> metadata_keys;
  for (const auto& [key, value] : metadata) {
    if (!ValidUtf8(key) || !ValidUtf8(value)) {
      return InvalidArgumentError(name + ": metadata " + Quoted(key) + ": key and value must be UTF-8");
    }
    if (!metadata_keys.insert(key).second) return InvalidArgumentError(name + ": duplicate metadata key " + Quoted(key));
  }

  // serde_json's compact form of the library's header: __metadata__ first, then every tensor
  // in data order, fields in declaration order.
  std::string json = "{";
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    for (size_t i = 0; i < metadata.size(); ++i) {
      if (i > 0) json += ',';
      AppendSerdeString(json, metadata[i].first);
      json += ':';
      AppendSerdeString(json, metadata[i].second);
    }
    json += '}';
  }
  auto file = std::shared_ptr<LazySafetensorsFile>(new LazySafetensorsFile());
  uint64_t data_n_bytes = 0;
  for (const Planned& p : planned) {
    const auto end = CheckedAdd(data_n_bytes, p.n_bytes);
    if (!end) return InvalidArgumentError(name + ": the data is larger than 2^64 bytes");
    if (json.size() > 1) json += ',';
    AppendSerdeString(json, p.name);
    json += ":{\"dtype\":\"";
    json += kLibraryDTypes[p.dtype_index].name;
    json += "\",\"shape\":[";
    for (size_t i = 0; i < p.tensor.shape.size(); ++i) {
      if (i > 0) json += ',';
      json += std::to_string(p.tensor.shape[i]);
    }
    json += "],\"data_offsets\":[" + std::to_string(data_n_bytes) + "," + std::to_string(*end) + "]}";
    if (p.n_bytes > 0) file->entries_.push_back(Entry{p.name, data_n_bytes, p.n_bytes, p.tensor.provider});
    data_n_bytes = *end;
  }
  json += '}';
  // The library pads the JSON with spaces so that the data starts at a multiple of 8.
  json.append((8 - json.size() % 8) % 8, ' ');

  file->header_.reserve(kLengthNBytes + json.size());
  for (size_t i = 0; i < kLengthNBytes; ++i) file->header_ += static_cast<char>((json.size() >> (8 * i)) & 0xFF);
  file->header_ += json;
  for (Entry& e : file->entries_) e.byte_offset += file->header_.size();
  const auto size = CheckedAdd(file->header_.size(), data_n_bytes);
  if (!size) return InvalidArgumentError(name + ": the file is larger than 2^64 bytes");
  file->size_ = *size;
  file->name_ = std::move(name);
  return std::shared_ptr<const LazySafetensorsFile>(std::move(file));
}

uint64_t LazySafetensorsFile::Size() const { return size_; }

const std::string& LazySafetensorsFile::Name() const { return name_; }

Status LazySafetensorsFile::ReadAt(uint64_t byte_offset, std::span<std::byte> out) const {
  if (!RangeInside(byte_offset, out.size(), size_)) {
    return OutOfRangeError(name_ + ": read of " + std::to_string(out.size()) + " bytes at offset " +
                           std::to_string(byte_offset) + " past end (" + std::to_string(size_) + " bytes)");
  }
  if (out.empty()) return Status::Ok();  // out.data() may be null: no memcpy from it
  size_t done = 0;
  if (byte_offset < header_.size()) {
    done = static_cast<size_t>(std::min<uint64_t>(header_.size() - byte_offset, out.size()));
    std::memcpy(out.data(), header_.data() + byte_offset, done);
  }
  if (done == out.size()) return Status::Ok();
  // The data is the entries back to back from header_.size(): start at the last entry that
  // begins at or before the first data byte wanted.
  auto it = std::upper_bound(entries_.begin(), entries_.end(), byte_offset + done,
                             [](uint64_t off, const Entry& e) { return off < e.byte_offset; });
  --it;
  // The tensors' plain source reads go out together when the read ends: one batch per source file.
  std::optional<ReadBatch> batch;
  if (!LegacyReadPath()) batch.emplace();
  while (done < out.size()) {
    const Entry& e = *it++;
    const uint64_t within = byte_offset + done - e.byte_offset;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(e.n_bytes - within, out.size() - done));
    const Status st = e.provider->Read(within, out.subspan(done, n));
    if (!st.ok()) {
      return st.WithContext(name_ + ": tensor " + Quoted(e.name) + " at tensor byte offset " + std::to_string(within));
    }
    done += n;
  }
  if (batch) UCPFS_RETURN_IF_ERROR(batch->Finish().WithContext(name_));
  return Status::Ok();
}

Status LazySafetensorsFile::DescribeReads(uint64_t byte_offset, uint64_t n_bytes, const SourceRunSink& sink) const {
  if (!RangeInside(byte_offset, n_bytes, size_)) {
    return OutOfRangeError(name_ + ": range of " + std::to_string(n_bytes) + " bytes at offset " +
                           std::to_string(byte_offset) + " past end (" + std::to_string(size_) + " bytes)");
  }
  const uint64_t end = byte_offset + n_bytes;
  for (const Entry& e : entries_) {
    const uint64_t lo = std::max(byte_offset, e.byte_offset), hi = std::min(end, e.byte_offset + e.n_bytes);
    if (lo >= hi) continue;
    const Status st = e.provider->DescribeReads(lo - e.byte_offset, hi - lo, sink);
    if (!st.ok()) return st.WithContext(name_ + ": tensor " + Quoted(e.name));
  }
  return Status::Ok();
}

std::string SafetensorsIndexJson(uint64_t total_n_bytes,
                                 const std::vector<std::pair<std::string, std::string>>& weight_map) {
  // sort_keys: Python orders str by code point, which is UTF-8's byte order; bytes that are not
  // UTF-8 become U+FFFD before sorting, as they are written.
  std::vector<std::pair<std::string, const std::string*>> sorted;
  sorted.reserve(weight_map.size());
  for (const auto& [name, file] : weight_map) {
    std::string clean;
    for (size_t i = 0; i < name.size();) {
      const size_t at = i;
      if (NextCodePoint(name, i)) {
        clean.append(name, at, i - at);
      } else {
        clean += "\xEF\xBF\xBD";
      }
    }
    sorted.emplace_back(std::move(clean), &file);
  }
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string out = "{\n  \"metadata\": {\n    \"total_size\": " + std::to_string(total_n_bytes) +
                    "\n  },\n  \"weight_map\": {";
  for (size_t i = 0; i < sorted.size(); ++i) {
    out += i == 0 ? "\n    " : ",\n    ";
    AppendPythonAsciiString(out, sorted[i].first);
    out += ": ";
    AppendPythonAsciiString(out, *sorted[i].second);
  }
  out += sorted.empty() ? "}\n}\n" : "\n  }\n}\n";
  return out;
}

}  // namespace ucpfs::format
