// Walks a DCP Metadata pickle graph by class name into DcpMetadata records. Fields are read
// from the BUILD state (a dict, or a (dict, slotstate) tuple), from SETITEMs on the object, from
// NEWOBJ_EX keyword arguments, and last from positional constructor arguments in dataclass field
// order, so both NEWOBJ+BUILD pickles (what torch writes) and REDUCE-with-args variants parse.
#include "index/dcp_metadata.h"

#include <string_view>
#include <unordered_map>

namespace ucpfs::index {
namespace {

using pickle::Kind;
using pickle::kNoNode;
using pickle::NodeId;
using pickle::PickleGraph;

class Walker {
 public:
  Walker(const PickleGraph& g, const std::string& name) : g_(g), name_(name) {}

  Result<DcpMetadata> Run() {
    const NodeId root = g_.root();
    if (root == kNoNode || (g_.kind(root) != Kind::kObject && g_.kind(root) != Kind::kDict)) {
      return Corrupt("root is a " + KindOf(root) + ", not a DCP Metadata object");
    }
    DcpMetadata md;
    md.flavor = FlavorOf(root);
    const NodeId sdm = Field(root, "state_dict_metadata", 0);
    if (sdm == kNoNode || g_.kind(sdm) != Kind::kDict) {
      return Corrupt("Metadata (class '" + std::string(g_.ClassName(root)) +
                     "') has no state_dict_metadata dict (found " + KindOf(sdm) + ")");
    }
    const NodeId storage = Field(root, "storage_data", 2);
    UCPFS_RETURN_IF_ERROR(RejectPrototype(sdm, storage));

    std::unordered_map<std::string, size_t> index;  // fqn -> position in md.entries
    for (const auto& [k, v] : g_.dict_items(sdm)) {
      if (g_.kind(k) != Kind::kString) {
        return Corrupt("state_dict_metadata has a key of kind " + KindOf(k) + ", not a string");
      }
      UCPFS_ASSIGN_OR_RETURN(DcpEntry e, Entry(std::string(g_.text(k)), v));
      auto [it, fresh] = index.emplace(e.fqn, md.entries.size());
      if (fresh) {
        md.entries.push_back(std::move(e));
      } else {
        md.entries[it->second] = std::move(e);  // a repeated key keeps its first position
      }
    }

    if (storage != kNoNode && g_.kind(storage) != Kind::kNone) {
      if (g_.kind(storage) != Kind::kDict)
        return Corrupt("storage_data is a " + KindOf(storage) + ", not a dict");
      for (const auto& [k, v] : g_.dict_items(storage)) {
        UCPFS_ASSIGN_OR_RETURN(DcpStorageKey key, StorageKey(k));
        UCPFS_ASSIGN_OR_RETURN(DcpStorage info, StorageInfo(key, v));
        md.storage[std::move(key)] = std::move(info);
      }
    }

    const NodeId planner = Field(root, "planner_data", 1);
    if (planner != kNoNode && g_.kind(planner) == Kind::kDict) {
      for (const auto& [k, v] : g_.dict_items(planner)) {
        if (g_.kind(k) == Kind::kString) md.saved_order.emplace_back(g_.text(k));
      }
    }

    const NodeId mcore = Field(root, "mcore_data", -1);
    if (mcore != kNoNode && g_.kind(mcore) == Kind::kDict) {
      for (const auto& [k, v] : g_.dict_items(mcore)) {
        if (g_.kind(k) != Kind::kString) continue;
        const NodeId shape = Field(v, "nd_reformulated_orig_global_shape", -1);
        if (shape == kNoNode || g_.kind(shape) == Kind::kNone) continue;
        const std::string key(g_.text(k));
        UCPFS_ASSIGN_OR_RETURN(
            md.nd_orig_shape[key],
            Ints(shape, "mcore_data['" + key + "'].nd_reformulated_orig_global_shape"));
      }
    }
    return md;
  }

 private:
  Status Corrupt(const std::string& what) const { return CorruptError(name_ + ": " + what); }

  std::string KindOf(NodeId id) const {
    if (id == kNoNode) return "nothing";
    const std::string_view cls = g_.ClassName(id);
    if (!cls.empty()) return "'" + std::string(cls) + "' object";
    return pickle::KindName(g_.kind(id));
  }

  std::string FlavorOf(NodeId root) const {
    if (g_.kind(root) == Kind::kObject) {
      const NodeId cls = g_.object(root).callable;
      if (cls != kNoNode && g_.kind(cls) == Kind::kGlobal &&
          g_.module(cls).find("_shard.checkpoint") != std::string_view::npos) {
        return "torch-1.13";
      }
    }
    return "torch-2.x";
  }

  // Attribute `field` of an object (see the file comment), or of a dict by key; kNoNode if
  // absent. `position` is the dataclass field index used for positional arguments (-1: none).
  NodeId Field(NodeId obj, std::string_view field, int position) const {
    if (obj == kNoNode) return kNoNode;
    if (g_.kind(obj) == Kind::kDict) return g_.DictGet(obj, field);
    if (g_.kind(obj) != Kind::kObject) return kNoNode;
    const pickle::ObjectInfo o = g_.object(obj);
    if (o.state != kNoNode) {
      if (g_.kind(o.state) == Kind::kDict) {
        if (NodeId v = g_.DictGet(o.state, field); v != kNoNode) return v;
      } else if (g_.kind(o.state) == Kind::kTuple) {
        for (NodeId part : g_.items(o.state)) {  // (dict, slotstate)
          if (g_.kind(part) != Kind::kDict) continue;
          if (NodeId v = g_.DictGet(part, field); v != kNoNode) return v;
        }
      }
    }
    NodeId found = kNoNode;
    for (const auto& [k, v] : o.dict_items) {
      if (g_.kind(k) == Kind::kString && g_.text(k) == field) found = v;
    }
    if (found != kNoNode) return found;
    if (o.kwargs != kNoNode) {
      if (NodeId v = g_.DictGet(o.kwargs, field); v != kNoNode) return v;
    }
    if (position >= 0 && o.args != kNoNode) {
      const auto args = g_.items(o.args);
      if (static_cast<size_t>(position) < args.size()) return args[position];
    }
    return kNoNode;
  }

  bool HasField(NodeId obj, std::string_view field) const {
    return Field(obj, field, -1) != kNoNode;
  }

  // torch 1.12's prototype `_shard.checkpoint` wrote ShardedTensorStorageMetadata /
  // TensorStorageMetadata{storage_key, ...} and no storage_data; nothing in it says where chunks
  // of the current schema are, so refuse it by name.
  Status RejectPrototype(NodeId sdm, NodeId storage) const {
    bool prototype = false;
    std::string cls;
    for (const auto& [k, v] : g_.dict_items(sdm)) {
      (void)k;
      cls = std::string(g_.ClassName(v));
      if (cls == "ShardedTensorStorageMetadata" || cls == "ShardStorageMetadata" ||
          HasField(v, "storage_key") || HasField(v, "tensor_metadata")) {
        prototype = true;
        break;
      }
    }
    if (!prototype && storage == kNoNode && !g_.dict_items(sdm).empty()) {
      prototype = true;
      cls = "Metadata without storage_data";
    }
    if (!prototype) return Status::Ok();
    return UnsupportedError(name_ + ": torch 1.12 prototype DCP metadata (" + cls +
                            ") is not supported; re-save the checkpoint with torch >= 1.13");
  }

  Result<int64_t> Int(NodeId id, const std::string& what) const {
    if (id == kNoNode || g_.kind(id) != Kind::kInt) {
      return Corrupt(what + " is " + KindOf(id) + ", not an int");
    }
    return g_.int_value(id);
  }

  Result<std::vector<int64_t>> Ints(NodeId id, const std::string& what) const {
    if (id == kNoNode || (g_.kind(id) != Kind::kTuple && g_.kind(id) != Kind::kList)) {
      return Corrupt(what + " is " + KindOf(id) + ", not a tuple of ints");
    }
    std::vector<int64_t> out;
    for (NodeId item : g_.items(id)) {
      if (g_.kind(item) != Kind::kInt)
        return Corrupt(what + " holds a " + KindOf(item) + ", not an int");
      if (g_.int_value(item) < 0) return Corrupt(what + " holds a negative value");
      out.push_back(g_.int_value(item));
    }
    return out;
  }

  Result<DType> DTypeOf(NodeId props, const std::string& fqn) const {
    NodeId dt = Field(props, "dtype", 0);
    if (dt == kNoNode && g_.kind(props) == Kind::kObject) {
      // TensorProperties.__getstate__: (dtype, layout, requires_grad, memory_format, pin_memory)
      const NodeId st = g_.object(props).state;
      if (st != kNoNode && g_.kind(st) == Kind::kTuple && !g_.items(st).empty())
        dt = g_.items(st)[0];
    }
    std::string_view tname;
    if (dt != kNoNode && g_.kind(dt) == Kind::kGlobal && g_.module(dt) == "torch") {
      tname = g_.name(dt);
    } else if (dt != kNoNode && g_.kind(dt) == Kind::kString) {
      tname = g_.text(dt);
      if (tname.starts_with("torch.")) tname.remove_prefix(6);
    } else {
      return Corrupt("tensor '" + fqn + "': properties hold no dtype (found " + KindOf(dt) + ")");
    }
    const auto d = DTypeFromTorchName(tname);
    if (!d)
      return UnsupportedError(name_ + ": tensor '" + fqn + "': unknown dtype torch." +
                              std::string(tname));
    return *d;
  }

  Result<DcpEntry> Entry(std::string fqn, NodeId v) const {
    DcpEntry e;
    e.fqn = std::move(fqn);
    const std::string_view cls = g_.ClassName(v);
    if (cls == "BytesStorageMetadata") {
      e.is_bytes = true;
      return e;
    }
    if (cls != "TensorStorageMetadata") {
      return UnsupportedError(name_ + ": '" + e.fqn + "': unknown storage metadata " + KindOf(v));
    }
    const std::string where = "tensor '" + e.fqn + "'";
    UCPFS_ASSIGN_OR_RETURN(e.dtype, DTypeOf(Field(v, "properties", 0), e.fqn));
    UCPFS_ASSIGN_OR_RETURN(e.size, Ints(Field(v, "size", 1), where + " size"));
    const NodeId chunks = Field(v, "chunks", 2);
    if (chunks == kNoNode || g_.kind(chunks) != Kind::kList) {
      return Corrupt(where + ": chunks is " + KindOf(chunks) + ", not a list");
    }
    for (NodeId c : g_.items(chunks)) {
      const std::string cw = where + " chunk " + std::to_string(e.chunks.size());
      if (g_.ClassName(c) != "ChunkStorageMetadata" && g_.kind(c) != Kind::kDict) {
        return Corrupt(cw + " is " + KindOf(c) + ", not a ChunkStorageMetadata");
      }
      DcpChunk chunk;
      UCPFS_ASSIGN_OR_RETURN(chunk.offsets, Ints(Field(c, "offsets", 0), cw + " offsets"));
      UCPFS_ASSIGN_OR_RETURN(chunk.sizes, Ints(Field(c, "sizes", 1), cw + " sizes"));
      e.chunks.push_back(std::move(chunk));
    }
    return e;
  }

  Result<DcpStorageKey> StorageKey(NodeId k) const {
    if (g_.ClassName(k) != "MetadataIndex") {
      return Corrupt("storage_data has a key that is " + KindOf(k) + ", not a MetadataIndex");
    }
    DcpStorageKey key;
    const NodeId fqn = Field(k, "fqn", 0);
    if (fqn == kNoNode || g_.kind(fqn) != Kind::kString) {
      return Corrupt("storage_data MetadataIndex fqn is " + KindOf(fqn) + ", not a string");
    }
    key.fqn = std::string(g_.text(fqn));
    const NodeId off = Field(k, "offset", 1);
    if (off != kNoNode && g_.kind(off) != Kind::kNone) {
      key.has_offsets = true;
      UCPFS_ASSIGN_OR_RETURN(key.offsets, Ints(off, "storage_data key '" + key.fqn + "' offset"));
    }
    return key;
  }

  Result<DcpStorage> StorageInfo(const DcpStorageKey& key, NodeId v) const {
    const std::string where = "storage_data['" + key.fqn + "']";
    DcpStorage s;
    const NodeId path = Field(v, "relative_path", 0);
    if (path == kNoNode || g_.kind(path) != Kind::kString) {
      return Corrupt(where + ": relative_path is " + KindOf(path) + ", not a string");
    }
    s.relative_path = std::string(g_.text(path));
    UCPFS_ASSIGN_OR_RETURN(int64_t off, Int(Field(v, "offset", 1), where + " offset"));
    UCPFS_ASSIGN_OR_RETURN(int64_t len, Int(Field(v, "length", 2), where + " length"));
    if (off < 0 || len < 0) return Corrupt(where + ": negative offset or length");
    s.byte_offset = static_cast<uint64_t>(off);
    s.n_bytes = static_cast<uint64_t>(len);
    const NodeId td = Field(v, "transform_descriptors", 3);
    if (td != kNoNode && g_.kind(td) != Kind::kNone) {
      if (g_.kind(td) == Kind::kList || g_.kind(td) == Kind::kTuple) {
        for (NodeId d : g_.items(td)) {
          s.transform_descriptors.push_back(g_.kind(d) == Kind::kString ? std::string(g_.text(d))
                                                                        : "<" + KindOf(d) + ">");
        }
      } else {
        s.transform_descriptors.push_back("<" + KindOf(td) + ">");
      }
    }
    return s;
  }

  const PickleGraph& g_;
  const std::string& name_;
};

}  // namespace

Result<DcpMetadata> ParseDcpMetadata(std::span<const std::byte> bytes, const std::string& name,
                                     const pickle::PickleLimits& limits) {
  UCPFS_ASSIGN_OR_RETURN(PickleGraph g, pickle::ParsePickle(bytes, name, limits));
  return Walker(g, name).Run();
}

}  // namespace ucpfs::index
