#include "core/format/plain_value.h"

#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "core/format/pickle.h"
#include "core/format/torch_file.h"

namespace ucpfs::format {
namespace {

// A tensor's contiguous bytes inside the blob.
class BlobTensorProvider final : public TensorBytesProvider {
 public:
  BlobTensorProvider(std::shared_ptr<const ByteSource> blob, uint64_t data_offset)
      : blob_(std::move(blob)), data_offset_(data_offset) {}
  Status Read(uint64_t byte_offset, std::span<std::byte> out) const override {
    return blob_->ReadAt(data_offset_ + byte_offset, out);
  }
  Status DescribeReads(uint64_t byte_offset, uint64_t n_bytes, const SourceRunSink& sink) const override {
    return blob_->DescribeReads(data_offset_ + byte_offset, n_bytes, sink);
  }

 private:
  std::shared_ptr<const ByteSource> blob_;
  uint64_t data_offset_;
};

class Decoder {
 public:
  Decoder(const TorchFile& tf, std::shared_ptr<const ByteSource> blob, const PlainValueLimits& limits)
      : tf_(tf), g_(tf.graph()), blob_(std::move(blob)), limits_(limits) {}

  Result<SaveValue> Value(pickle::NodeId id, const std::string& path, uint32_t depth) {
    if (depth > limits_.max_depth) {
      return ResourceExhaustedError(Where(path) + "nesting deeper than " + std::to_string(limits_.max_depth));
    }
    if (++visited_ > limits_.max_nodes) {
      return ResourceExhaustedError(Where(path) + "more than " + std::to_string(limits_.max_nodes) +
                                    " values");
    }
    switch (g_.kind(id)) {
      case pickle::Kind::kNone: return SaveValue::None();
      case pickle::Kind::kBool: return SaveValue::Bool(g_.bool_value(id));
      case pickle::Kind::kInt: return SaveValue::Int(g_.int_value(id));
      case pickle::Kind::kFloat: return SaveValue::Float(g_.float_value(id));
      case pickle::Kind::kString: return SaveValue::Str(std::string(g_.text(id)));
      case pickle::Kind::kBytes: return SaveValue::Bytes(std::string(g_.text(id)));
      case pickle::Kind::kTuple:
      case pickle::Kind::kList: {
        std::vector<SaveValue> items;
        size_t i = 0;
        for (pickle::NodeId item : g_.items(id)) {
          UCPFS_ASSIGN_OR_RETURN(auto v, Value(item, Child(path, std::to_string(i++)), depth + 1));
          items.push_back(std::move(v));
        }
        return g_.kind(id) == pickle::Kind::kList ? SaveValue::List(std::move(items))
                                                  : SaveValue::Tuple(std::move(items));
      }
      case pickle::Kind::kDict: {
        if (g_.state(id) != pickle::kNoNode) return Unsupported(path, "a dict subclass with state");
        SaveValue::DictItems items;
        std::unordered_map<std::string, size_t> position;  // "s:<key>" / "i:<key>" -> index in items
        for (const auto& [k, v] : g_.dict_items(id)) {
          SaveValue key;
          std::string key_text;
          if (g_.kind(k) == pickle::Kind::kString) {
            key_text = std::string(g_.text(k));
            key = SaveValue::Str(key_text);
          } else if (g_.kind(k) == pickle::Kind::kInt) {
            key_text = std::to_string(g_.int_value(k));
            key = SaveValue::Int(g_.int_value(k));
          } else {
            return Unsupported(path, std::string("a dict key of kind ") + pickle::KindName(g_.kind(k)));
          }
          UCPFS_ASSIGN_OR_RETURN(auto value, Value(v, Child(path, key_text), depth + 1));
          // A repeated key (several SETITEMs) keeps its last value, as Python would; found by
          // hash, so a hostile dict with many keys stays linear.
          const std::string slot = (key.kind() == SaveValue::Kind::kInt ? "i:" : "s:") + key_text;
          auto [it, fresh] = position.try_emplace(slot, items.size());
          if (fresh) {
            items.emplace_back(std::move(key), std::move(value));
          } else {
            items[it->second].second = std::move(value);
          }
        }
        return g_.ordered(id) ? SaveValue::OrderedDict(std::move(items)) : SaveValue::Dict(std::move(items));
      }
      case pickle::Kind::kTensor: {
        UCPFS_ASSIGN_OR_RETURN(auto rec, ResolveTensor(*blob_, tf_.archive(), g_, id, path));
        if (!rec.contiguous) return Unsupported(path, "a tensor that is not contiguous");
        if (limits_.keep_objects && g_.tensor(id).is_parameter) return Unsupported(path, "a Parameter");
        SaveTensor t{rec.dtype, rec.shape, std::make_shared<BlobTensorProvider>(blob_, rec.data_offset)};
        t.requires_grad = g_.tensor(id).requires_grad;
        return SaveValue::Tensor(std::move(t));
      }
      case pickle::Kind::kGlobal:
        if (!limits_.keep_objects) return Unsupported(path, "a global");
        return SaveValue::Global(std::string(g_.module(id)), std::string(g_.name(id)));
      case pickle::Kind::kObject: {
        if (limits_.keep_objects) return Object(id, path, depth);
        const pickle::NodeId callable = g_.object(id).callable;
        std::string what = "an object";
        if (g_.kind(callable) == pickle::Kind::kGlobal) {
          what = "a " + std::string(g_.module(callable)) + "." + std::string(g_.name(callable)) + " object";
        }
        return Unsupported(path, what);
      }
      default:
        return Unsupported(path, std::string("a value of kind ") + pickle::KindName(g_.kind(id)));
    }
  }

 private:
  Result<SaveValue> Object(pickle::NodeId id, const std::string& path, uint32_t depth) {
    const pickle::ObjectInfo o = g_.object(id);
    if (o.kwargs != pickle::kNoNode) return Unsupported(path, "an object built with keyword arguments");
    UCPFS_ASSIGN_OR_RETURN(auto callable, Value(o.callable, Child(path, "<callable>"), depth + 1));
    SaveValue args = SaveValue::Tuple();
    if (o.args != pickle::kNoNode) {
      if (g_.kind(o.args) != pickle::Kind::kTuple) return Unsupported(path, "an object whose arguments are not a tuple");
      UCPFS_ASSIGN_OR_RETURN(args, Value(o.args, Child(path, "<args>"), depth + 1));
    }
    std::optional<SaveValue> state;
    if (o.state != pickle::kNoNode) {
      UCPFS_ASSIGN_OR_RETURN(state, Value(o.state, Child(path, "<state>"), depth + 1));
    }
    std::vector<SaveValue> list_items;
    for (pickle::NodeId item : o.list_items) {
      UCPFS_ASSIGN_OR_RETURN(auto v, Value(item, Child(path, "<item>"), depth + 1));
      list_items.push_back(std::move(v));
    }
    SaveValue::DictItems dict_items;
    for (const auto& [k, v] : o.dict_items) {
      UCPFS_ASSIGN_OR_RETURN(auto key, Value(k, Child(path, "<key>"), depth + 1));
      UCPFS_ASSIGN_OR_RETURN(auto value, Value(v, Child(path, "<value>"), depth + 1));
      dict_items.emplace_back(std::move(key), std::move(value));
    }
    return SaveValue::Object(std::move(callable), std::move(args), o.newobj, std::move(state),
                             std::move(list_items), std::move(dict_items));
  }

  std::string Where(const std::string& path) const {
    return blob_->Name() + ": at " + (path.empty() ? std::string("the root") : "'" + path + "'") + ": ";
  }
  static std::string Child(const std::string& path, const std::string& part) {
    return path.empty() ? part : path + "." + part;
  }
  Status Unsupported(const std::string& path, const std::string& what) const {
    return UnsupportedError(Where(path) + what +
                            " is not plain data (a weights_only torch.load refuses it)");
  }

  const TorchFile& tf_;
  const pickle::PickleGraph& g_;
  std::shared_ptr<const ByteSource> blob_;
  const PlainValueLimits& limits_;
  uint64_t visited_ = 0;
};

}  // namespace

Result<SaveValue> DecodePlainValue(std::shared_ptr<const ByteSource> blob, const PlainValueLimits& limits) {
  UCPFS_ASSIGN_OR_RETURN(auto tf, TorchFile::Open(blob));
  return DecodeValueAt(tf, std::move(blob), tf.graph().root(), limits);
}

Result<SaveValue> DecodeValueAt(const TorchFile& tf, std::shared_ptr<const ByteSource> file, uint32_t node,
                                const PlainValueLimits& limits) {
  if (node >= tf.graph().size()) return InvalidArgumentError(file->Name() + ": no pickle node " + std::to_string(node));
  Decoder d(tf, std::move(file), limits);
  return d.Value(node, "", 0);
}

}  // namespace ucpfs::format
