#include "core/format/torch_file.h"

#include <cstdio>
#include <span>
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

}  // namespace

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
  UCPFS_ASSIGN_OR_RETURN(file.archive_, ZipArchive::Open(s, limits.zip));
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
    return ResourceExhaustedError(s.Name() + ": '" + pkl->name + "' is " +
                                  std::to_string(pkl->n_bytes) + " bytes, over the limit of " +
                                  std::to_string(limits.max_pickle_bytes));
  }
  UCPFS_ASSIGN_OR_RETURN(std::vector<std::byte> bytes,
                         ReadRange(s, pkl->data_offset, pkl->n_bytes, limits.max_pickle_bytes));
  UCPFS_ASSIGN_OR_RETURN(file.graph_,
                         pickle::ParsePickle(bytes, s.Name() + ": " + pkl->name, limits.pickle));
  Walker walker(s, file.archive_, file.graph_, limits);
  UCPFS_RETURN_IF_ERROR(walker.Walk(file.graph_.root(), "", 0));
  file.tensors_ = walker.take();
  return file;
}

}  // namespace ucpfs::format
