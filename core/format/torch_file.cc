#include "core/format/torch_file.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <span>
#include <unordered_map>
#include <utility>

#include "core/checked.h"

namespace ucpfs::format {
namespace {

using pickle::Kind;
using pickle::NodeId;
using pickle::PickleGraph;

// A dict key as it appears in a dot-joined path.
std::string KeyText(const PickleGraph& g, NodeId id) {
  switch (g.kind(id)) {
    case Kind::kString: return std::string(g.text(id));
    case Kind::kInt: return std::to_string(g.int_value(id));
    case Kind::kBool: return g.bool_value(id) ? "True" : "False";
    case Kind::kNone: return "None";
    case Kind::kFloat: {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%g", g.float_value(id));
      return buf;
    }
    case Kind::kTuple: {
      const auto items = g.items(id);
      std::string s = "(";
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) s += ",";
        s += KeyText(g, items[i]);
      }
      return s + ")";
    }
    default: return std::string("<") + pickle::KindName(g.kind(id)) + ">";
  }
}

std::string Join(const std::string& parent, const std::string& part) {
  return parent.empty() ? part : parent + "." + part;
}

// Collects tensors in pickle-graph order. Depth is bounded (so recursion is bounded), nodes on
// the current path are skipped (cycles), and the total number of visits is bounded (a
// memo-shared diamond chain would otherwise have exponentially many paths).
class Walker {
 public:
  Walker(const ByteSource& src, const ZipArchive& archive, const PickleGraph& graph,
         const TorchFileLimits& limits)
      : src_(src), archive_(archive), graph_(graph), limits_(limits),
        on_path_(graph.size(), false) {}

  Status Walk(NodeId id, const std::string& path, uint32_t depth) {
    if (id == pickle::kNoNode || id >= graph_.size()) return Status::Ok();
    if (depth > limits_.max_walk_depth) {
      return ResourceExhaustedError(src_.Name() + ": object graph deeper than " +
                                    std::to_string(limits_.max_walk_depth) + " at key '" + path +
                                    "'");
    }
    if (++visits_ > max_visits_) {
      return ResourceExhaustedError(src_.Name() + ": object graph has more than " +
                                    std::to_string(max_visits_) + " paths");
    }
    if (on_path_[id]) return Status::Ok();
    if (graph_.kind(id) == Kind::kTensor) {
      UCPFS_ASSIGN_OR_RETURN(TensorRecord rec, ResolveTensor(src_, archive_, graph_, id, path));
      tensors_.push_back(std::move(rec));
      return Status::Ok();
    }
    on_path_[id] = true;
    Status st = WalkChildren(id, path, depth);
    on_path_[id] = false;
    return st;
  }

  std::vector<TensorRecord> take() { return std::move(tensors_); }

 private:
  Status WalkChildren(NodeId id, const std::string& path, uint32_t depth) {
    switch (graph_.kind(id)) {
      case Kind::kDict:
        return WalkPairs(graph_.dict_items(id), path, depth);
      case Kind::kList:
      case Kind::kTuple:
      case Kind::kSet:
        return WalkSeq(graph_.items(id), path, depth);
      case Kind::kObject: {
        const pickle::ObjectInfo o = graph_.object(id);
        UCPFS_RETURN_IF_ERROR(WalkSeq(graph_.items(o.args), path, depth));  // args: a tuple
        UCPFS_RETURN_IF_ERROR(WalkState(o.state, path, depth));
        UCPFS_RETURN_IF_ERROR(WalkSeq(o.list_items, path, depth));
        return WalkPairs(o.dict_items, path, depth);
      }
      default:
        return Status::Ok();
    }
  }

  // BUILD state: a dict of attributes, or (dict, slotstate), or anything else.
  Status WalkState(NodeId state, const std::string& path, uint32_t depth) {
    if (state == pickle::kNoNode) return Status::Ok();
    if (graph_.kind(state) == Kind::kTuple) {
      for (NodeId part : graph_.items(state)) {
        UCPFS_RETURN_IF_ERROR(WalkPairs(graph_.dict_items(part), path, depth));  // dicts only
      }
      return Status::Ok();
    }
    return Walk(state, path, depth + 1);
  }

  Status WalkPairs(std::span<const std::pair<NodeId, NodeId>> pairs, const std::string& path,
                   uint32_t depth) {
    for (const auto& [k, v] : pairs) {
      UCPFS_RETURN_IF_ERROR(Walk(v, Join(path, KeyText(graph_, k)), depth + 1));
    }
    return Status::Ok();
  }

  Status WalkSeq(std::span<const NodeId> items, const std::string& path, uint32_t depth) {
    for (size_t i = 0; i < items.size(); ++i) {
      UCPFS_RETURN_IF_ERROR(Walk(items[i], Join(path, std::to_string(i)), depth + 1));
    }
    return Status::Ok();
  }

  const ByteSource& src_;
  const ZipArchive& archive_;
  const PickleGraph& graph_;
  const TorchFileLimits& limits_;
  std::vector<bool> on_path_;
  std::vector<TensorRecord> tensors_;
  uint64_t visits_ = 0;
  uint64_t max_visits_ = 1u << 24;
};

bool IsRowMajorContiguous(const std::vector<int64_t>& shape, const std::vector<int64_t>& stride) {
  int64_t expected = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] == 0) return true;
    if (shape[i] != 1 && stride[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

// torch's legacy format (torch.save(..., _use_new_zipfile_serialization=False), and every save of
// torch before 1.6): five pickles, then each storage in the order of the fifth's keys as a
// little-endian int64 element count and its bytes. The first pickle is the magic number
// 0x1950a86a20f9469cfc6c as LONG1: PROTO n, an optional FRAME, the LONG1, STOP.
constexpr uint8_t kLegacyMagicLong1[] = {0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19};
constexpr int64_t kLegacyProtocolVersion = 1001;
constexpr uint64_t kLegacyFirstRead = uint64_t{1} << 20;  // read again 4x larger while the pickles go on

// The offset just past the magic number's pickle, or 0 when `head` does not begin with it.
uint64_t LegacyMagicEnd(std::span<const std::byte> head) {
  const auto* b = reinterpret_cast<const uint8_t*>(head.data());
  size_t at = 0;
  if (head.size() < 2 || b[0] != 0x80 || b[1] < 2) return 0;
  at = 2;
  if (head.size() > at && b[at] == 0x95) at += 9;  // FRAME: 8-byte length
  if (head.size() < at + sizeof(kLegacyMagicLong1) + 1) return 0;
  if (std::memcmp(b + at, kLegacyMagicLong1, sizeof(kLegacyMagicLong1)) != 0) return 0;
  at += sizeof(kLegacyMagicLong1);
  return b[at] == '.' ? at + 1 : 0;
}

struct LegacyPickles {
  PickleGraph object;
  std::vector<std::string> keys;  // the storages, in the order their bytes follow
  uint64_t data_offset = 0;       // where the first storage's count begins
};

// The four pickles after the magic number, from `head` (the file's first bytes). On failure
// *ran_out says whether `head` ended inside them (more of the file might parse).
Result<LegacyPickles> ParseLegacyPickles(std::span<const std::byte> head, uint64_t at, const std::string& name,
                                         const TorchFileLimits& limits, bool* ran_out) {
  *ran_out = false;
  auto next = [&](const char* what) -> Result<PickleGraph> {
    Result<PickleGraph> g = pickle::ParsePickle(head.subspan(at), name + ": " + what, limits.pickle, ran_out);
    if (g.ok()) at += g->end_offset();
    return g;
  };
  UCPFS_ASSIGN_OR_RETURN(PickleGraph version, next("legacy protocol version"));
  if (version.kind(version.root()) != Kind::kInt || version.int_value(version.root()) != kLegacyProtocolVersion) {
    return UnsupportedError(name + ": a legacy torch.save file of protocol version other than 1001");
  }
  UCPFS_ASSIGN_OR_RETURN(PickleGraph sys_info, next("legacy sys_info"));
  for (const auto& [k, v] : sys_info.dict_items(sys_info.root())) {
    if (sys_info.text(k) == "little_endian" && sys_info.kind(v) == Kind::kBool && !sys_info.bool_value(v)) {
      return UnsupportedError(name + ": saved on a big-endian machine (legacy format)");
    }
  }
  LegacyPickles out;
  UCPFS_ASSIGN_OR_RETURN(out.object, next("data"));
  UCPFS_ASSIGN_OR_RETURN(PickleGraph keys, next("legacy storage keys"));
  if (keys.kind(keys.root()) != Kind::kList) return CorruptError(name + ": legacy storage keys are not a list");
  for (NodeId k : keys.items(keys.root())) {
    if (keys.kind(k) != Kind::kString) return CorruptError(name + ": a legacy storage key is not a string");
    out.keys.emplace_back(keys.text(k));
  }
  out.data_offset = at;
  return out;
}

// The legacy file's storages as records "data/<key>" at their exact offsets, each count checked.
Result<ZipArchive> LegacyRecords(const ByteSource& s, const LegacyPickles& p) {
  struct Declared {
    uint64_t n_bytes = 0, item = 0;  // the storage's bytes and element size
  };
  std::unordered_map<std::string, Declared> declared;  // by key, from the object's persistent ids
  const PickleGraph& g = p.object;
  for (NodeId id = 0; id < g.size(); ++id) {
    if (g.kind(id) != Kind::kStorage) continue;
    const pickle::StorageInfo st = g.storage(id);
    const uint64_t size = st.untyped ? 1 : ItemSize(st.dtype);
    auto total = CheckedMul(st.numel, size);
    if (!total) return CorruptError(s.Name() + ": storage '" + std::string(st.key) + "' size overflows");
    auto [it, fresh] = declared.emplace(std::string(st.key), Declared{*total, size});
    if (!fresh && it->second.n_bytes != *total) {
      return CorruptError(s.Name() + ": storage '" + std::string(st.key) + "' is declared with two sizes");
    }
  }
  std::vector<ZipEntry> entries;
  std::vector<ReadPiece> counts;
  std::vector<int64_t> count_values(p.keys.size());
  uint64_t at = p.data_offset;
  for (size_t i = 0; i < p.keys.size(); ++i) {
    const std::string& key = p.keys[i];
    auto found = declared.find(key);
    if (found == declared.end()) {
      return CorruptError(s.Name() + ": legacy storage key '" + key + "' is not a storage of the object");
    }
    ZipEntry e;
    e.name = "data/" + key;
    e.local_header_offset = at;
    e.data_offset = at + 8;
    e.n_bytes = e.compressed_n_bytes = found->second.n_bytes;
    auto end = CheckedAdd(e.data_offset, e.n_bytes);
    if (!end || *end > s.Size()) {
      return CorruptError(s.Name() + ": legacy storage '" + key + "' (" + std::to_string(e.n_bytes) +
                          " bytes at offset " + std::to_string(e.data_offset) + ") runs past the end of the file (" +
                          std::to_string(s.Size()) + " bytes)");
    }
    counts.push_back({at, std::as_writable_bytes(std::span(&count_values[i], 1))});
    at = *end;
    entries.push_back(std::move(e));
  }
  if (!counts.empty()) UCPFS_RETURN_IF_ERROR(s.ReadPieces(counts));
  for (size_t i = 0; i < p.keys.size(); ++i) {
    const uint64_t want = entries[i].n_bytes / declared.at(p.keys[i]).item;
    if (count_values[i] < 0 || static_cast<uint64_t>(count_values[i]) != want) {
      return CorruptError(s.Name() + ": legacy storage '" + p.keys[i] + "' holds " + std::to_string(count_values[i]) +
                          " elements at offset " + std::to_string(entries[i].local_header_offset) +
                          " but the pickle declares " + std::to_string(want));
    }
  }
  return ZipArchive::FromRecords(std::move(entries));
}

// A legacy file's pickles. Their length is not written anywhere: the file's start is read again
// 4x larger while they end past what was read (up to the limit); a pickle wrong in the bytes read
// is refused at once.
Result<LegacyPickles> ReadLegacyPickles(const ByteSource& s, const TorchFileLimits& limits) {
  uint64_t want = std::min(s.Size(), kLegacyFirstRead);
  for (;;) {
    UCPFS_ASSIGN_OR_RETURN(std::vector<std::byte> head, ReadRange(s, 0, want, limits.max_pickle_bytes));
    bool ran_out = false;
    Result<LegacyPickles> parsed = ParseLegacyPickles(head, LegacyMagicEnd(head), s.Name(), limits, &ran_out);
    if (parsed.ok() || !ran_out || want >= s.Size()) return parsed;
    if (want >= limits.max_pickle_bytes) {
      return ResourceExhaustedError(s.Name() + ": the pickles of a legacy torch.save file are over " +
                                    std::to_string(limits.max_pickle_bytes) + " bytes, the limit");
    }
    want = std::min({s.Size(), want * 4, limits.max_pickle_bytes});
  }
}

// The file's first bytes, enough for the legacy magic number's pickle (empty when unreadable).
std::vector<std::byte> Head(const ByteSource& src) {
  std::vector<std::byte> head(std::min<uint64_t>(32, src.Size()));
  if (!src.ReadAt(0, head).ok()) head.clear();
  return head;
}

}  // namespace

bool IsLegacyTorchFile(const ByteSource& src) { return LegacyMagicEnd(Head(src)) != 0; }

bool LooksLikeTorchFile(const ByteSource& src) {
  const std::vector<std::byte> head = Head(src);
  return (head.size() >= 4 && std::memcmp(head.data(), "PK\x03\x04", 4) == 0) || LegacyMagicEnd(head) != 0;
}

Result<TensorRecord> ResolveTensor(const ByteSource& src, const ZipArchive& archive,
                                   const PickleGraph& graph, NodeId tensor, std::string key) {
  const std::string where = src.Name() + ": tensor '" + key + "'";
  if (tensor >= graph.size() || graph.kind(tensor) != Kind::kTensor) {
    return InternalError(where + ": not a tensor node");
  }
  const pickle::TensorInfo t = graph.tensor(tensor);
  if (t.storage == pickle::kNoNode || graph.kind(t.storage) != Kind::kStorage) {
    return UnsupportedError(where + ": storage is not a torch 'storage' persistent id");
  }
  const pickle::StorageInfo s = graph.storage(t.storage);
  if (t.shape.size() != t.stride.size()) {
    return CorruptError(where + ": shape has " + std::to_string(t.shape.size()) +
                        " dims but stride has " + std::to_string(t.stride.size()));
  }

  TensorRecord rec;
  rec.key = std::move(key);
  rec.dtype = t.dtype;
  rec.shape.assign(t.shape.begin(), t.shape.end());
  rec.stride.assign(t.stride.begin(), t.stride.end());
  rec.storage_offset = t.storage_offset;
  rec.storage_key = std::string(s.key);
  rec.is_parameter = t.is_parameter;

  const ZipEntry* entry = archive.FindRecord("data/" + rec.storage_key);
  if (entry == nullptr) {
    return CorruptError(where + ": storage record 'data/" + rec.storage_key + "' is missing");
  }
  rec.record_name = entry->name;
  if (entry->method != 0) {
    return UnsupportedError(where + ": storage record '" + entry->name +
                            "' is compressed (method " + std::to_string(entry->method) +
                            "); only stored records can be served");
  }
  rec.record_offset = entry->data_offset;
  rec.record_n_bytes = entry->n_bytes;

  // The pickled numel counts elements of a typed storage, bytes of an untyped one.
  auto storage_n_bytes = s.untyped ? std::optional<uint64_t>(s.numel)
                                    : CheckedMul(s.numel, ItemSize(s.dtype));
  if (!storage_n_bytes || *storage_n_bytes != entry->n_bytes) {
    return CorruptError(where + ": storage record '" + entry->name + "' holds " +
                        std::to_string(entry->n_bytes) + " bytes but the pickle declares " +
                        std::to_string(s.numel) +
                        (s.untyped ? " bytes" : " elements of " + std::string(TorchName(s.dtype))));
  }

  const uint64_t item = ItemSize(rec.dtype);
  uint64_t n_elems = 1;
  uint64_t max_index = 0;  // largest element index touched, relative to storage_offset
  for (size_t i = 0; i < rec.shape.size(); ++i) {
    if (rec.shape[i] < 0) return CorruptError(where + ": negative size in dim " + std::to_string(i));
    if (rec.stride[i] < 0) {
      return UnsupportedError(where + ": negative stride in dim " + std::to_string(i));
    }
    auto ne = CheckedMul(n_elems, static_cast<uint64_t>(rec.shape[i]));
    if (!ne) return CorruptError(where + ": element count overflows");
    n_elems = *ne;
  }
  if (rec.storage_offset < 0) return CorruptError(where + ": negative storage offset");
  auto offset_bytes = CheckedMul(static_cast<uint64_t>(rec.storage_offset), item);
  if (!offset_bytes) return CorruptError(where + ": storage offset overflows");
  uint64_t extent_bytes = 0;  // bytes from the first element to the end of the last one
  if (n_elems > 0) {
    for (size_t i = 0; i < rec.shape.size(); ++i) {
      auto span = CheckedMul(static_cast<uint64_t>(rec.shape[i] - 1), static_cast<uint64_t>(rec.stride[i]));
      auto sum = span ? CheckedAdd(max_index, *span) : std::nullopt;
      if (!sum) return CorruptError(where + ": strided extent overflows");
      max_index = *sum;
    }
    auto e = CheckedAdd(max_index, 1);
    auto eb = e ? CheckedMul(*e, item) : std::nullopt;
    if (!eb) return CorruptError(where + ": strided extent overflows");
    extent_bytes = *eb;
  }
  if (!RangeInside(*offset_bytes, extent_bytes, entry->n_bytes)) {
    return CorruptError(where + ": elements at storage offset " + std::to_string(rec.storage_offset) +
                        " span " + std::to_string(extent_bytes) + " bytes, past the end of '" +
                        entry->name + "' (" + std::to_string(entry->n_bytes) + " bytes)");
  }
  rec.data_offset = entry->data_offset + *offset_bytes;
  rec.n_elems = n_elems;
  rec.n_bytes = n_elems * item;  // <= extent_bytes, so no overflow
  rec.contiguous = IsRowMajorContiguous(rec.shape, rec.stride);
  return rec;
}

Result<TorchFile> TorchFile::Open(std::shared_ptr<const ByteSource> src,
                                  const TorchFileLimits& limits) {
  TorchFile file;
  file.src_ = std::move(src);
  const ByteSource& s = *file.src_;
  Result<ZipArchive> zip = ZipArchive::Open(s, limits.zip);
  // Not a zip: torch's legacy format, looked at only then (a zip, the common case, reads no more).
  if (!zip.ok() && IsLegacyTorchFile(s)) {
    UCPFS_ASSIGN_OR_RETURN(LegacyPickles parsed, ReadLegacyPickles(s, limits));
    UCPFS_ASSIGN_OR_RETURN(file.archive_, LegacyRecords(s, parsed));
    file.graph_ = std::move(parsed.object);
    file.legacy_ = true;
  } else {
    if (!zip.ok()) return zip.error();
    file.archive_ = std::move(*zip);
    const ZipEntry* pkl = file.archive_.FindRecord("data.pkl");
    if (pkl == nullptr) {
      return CorruptError(s.Name() + ": not a torch.save file: no '" +
                          (file.archive_.prefix().empty() ? std::string() : file.archive_.prefix() + "/") +
                          "data.pkl' record");
    }
    if (pkl->method != 0) {
      return UnsupportedError(s.Name() + ": record '" + pkl->name + "' is compressed (method " +
                              std::to_string(pkl->method) + ")");
    }
    if (pkl->n_bytes > limits.max_pickle_bytes) {
      return ResourceExhaustedError(s.Name() + ": '" + pkl->name + "' is " + std::to_string(pkl->n_bytes) +
                                    " bytes, over the limit of " + std::to_string(limits.max_pickle_bytes));
    }
    UCPFS_ASSIGN_OR_RETURN(std::vector<std::byte> bytes,
                           ReadRange(s, pkl->data_offset, pkl->n_bytes, limits.max_pickle_bytes));
    UCPFS_ASSIGN_OR_RETURN(file.graph_, pickle::ParsePickle(bytes, s.Name() + ": " + pkl->name, limits.pickle));
  }
  Walker walker(s, file.archive_, file.graph_, limits);
  UCPFS_RETURN_IF_ERROR(walker.Walk(file.graph_.root(), "", 0));
  file.tensors_ = walker.take();
  return file;
}

}  // namespace ucpfs::format
