// ScanDcp: DCP directory -> Checkpoint. Reads the metadata (one `.metadata`, else the union of
// rank-local `__<r>.metadata`), then for every tensor chunk opens its storage slice as a
// torch.save zip, checks the stored shape against the chunk and records where its first element
// lies. Megatron flattened-range chunks (mcore_data nd_reformulated_orig_global_shape) become
// flat-range fragments of the original shape; Megatron's layer-stacked tensors become one item
// per layer (mcore_unstack.h), so item keys are then `decoder.layers.<i>.…`, not the DCP fqn. Coverage is checked per tensor; replicas (the
// same box stored twice, e.g. by every rank of a rank-local save) must hold equal bytes, and
// only the first is kept.
//
// Error rule: the first problem in state_dict_metadata order wins; every message names the file
// (a metadata file or a data file with its slice) and the item's fqn.
#include "index/dcp_scan.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <utility>

#include "core/byte_source.h"
#include "core/checked.h"
#include "core/format/plain_value.h"
#include "core/format/torch_file.h"
#include "core/io/file_source.h"
#include "core/io/lazy_file_source.h"
#include "index/checkpoint_builder.h"
#include "index/dcp_metadata.h"
#include "index/mcore_unstack.h"
#include "index/megatron_scan.h"
#include "index/pickle_walk.h"

namespace ucpfs::index {
bool SafeRelativePath(const std::string& p) {
  if (p.empty() || p.front() == '/' || p.find('\0') != std::string::npos) return false;
  size_t start = 0;
  while (start <= p.size()) {
    size_t end = p.find('/', start);
    if (end == std::string::npos) end = p.size();
    if (p.compare(start, end - start, "..") == 0 && end - start == 2) return false;
    start = end + 1;
  }
  return true;
}

namespace {

constexpr uint64_t kMaxMetadataBytes = 4ull << 30;


// "__<digits>.metadata" -> rank, else -1.
int64_t RankLocalMetadataRank(const std::string& name) {
  constexpr std::string_view kSuffix = ".metadata";
  if (name.size() <= 2 + kSuffix.size() || !name.starts_with("__") || !name.ends_with(kSuffix))
    return -1;
  const char* first = name.data() + 2;
  const char* last = name.data() + name.size() - kSuffix.size();
  int64_t rank = -1;
  auto [p, ec] = std::from_chars(first, last, rank);
  if (ec != std::errc() || p != last || rank < 0) return -1;
  return rank;
}

// "dir/name", or `name` when `dir` is the root ("").
std::string Join(const std::string& dir, const std::string& name) { return dir.empty() ? name : dir + "/" + name; }

// Rank-local metadata names of `dir` (relative to the tree) sorted by rank.
std::vector<std::string> RankLocalMetadataFiles(const SourceTree& tree, const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  Result<std::vector<TreeEntry>> entries = tree.List(dir);
  if (!entries.ok()) return {};
  for (const TreeEntry& e : *entries) {
    const int64_t rank = RankLocalMetadataRank(e.name);
    if (rank >= 0 && e.kind == EntryKind::kFile) found.emplace_back(rank, e.name);
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [rank, name] : found) out.push_back(std::move(name));
  return out;
}


// Shape without its leading size-1 axes (Megatron prepends singleton axes to chunk views).
std::vector<int64_t> StripLeadingOnes(const std::vector<int64_t>& v) {
  size_t i = 0;
  while (i < v.size() && v[i] == 1) ++i;
  return {v.begin() + static_cast<std::ptrdiff_t>(i), v.end()};
}

bool HasZero(const std::vector<int64_t>& v) { return std::find(v.begin(), v.end(), 0) != v.end(); }

// The metadata files of a DCP directory: `.metadata`, else the rank-local ones by rank.
std::vector<std::string> MetadataFiles(const SourceTree& tree, const std::string& dir) {
  if (tree.IsFile(Join(dir, ".metadata"))) return {".metadata"};
  return RankLocalMetadataFiles(tree, dir);
}

// A composite DCP directory (IsDcpCompositeDirectory): at most this many parts, each recognised
// from metadata of at most kMaxPartMetadataBytes.
constexpr size_t kMaxParts = 16;
constexpr uint64_t kMaxPartMetadataBytes = 64ull << 20;

// The DCP subdirectories of `dir` (real directories, never a symlink, no dot names), by name.
std::vector<std::string> DcpSubdirectories(const SourceTree& tree, const std::string& dir) {
  std::vector<std::string> out;  // sorted, as List gives them
  Result<std::vector<TreeEntry>> entries = tree.List(dir);
  if (!entries.ok()) return out;
  for (const TreeEntry& e : *entries) {
    const std::string& name = e.name;
    if (name.empty() || name[0] == '.' || e.kind != EntryKind::kDirectory) continue;
    const std::string sub = Join(dir, name);
    if (tree.IsFile(sub + "/.metadata") || !RankLocalMetadataFiles(tree, sub).empty()) out.push_back(name);
  }
  return out;
}

// The parts of `dir` when it is one checkpoint saved as several DCP directories whose keys are
// disjoint (Accelerate's save_state: `pytorch_model_fsdp_0/` holds the model, `optimizer_0/` the
// optimizer); empty otherwise. Saves of one model at several steps repeat their keys: a run.
std::vector<std::string> CompositeParts(const SourceTree& tree, const std::string& dir) {
  if (tree.IsFile(Join(dir, ".metadata")) || !RankLocalMetadataFiles(tree, dir).empty()) return {};
  std::vector<std::string> parts = DcpSubdirectories(tree, dir);
  if (parts.size() < 2 || parts.size() > kMaxParts) return {};
  std::set<std::string> keys;  // of the parts before
  for (const std::string& part : parts) {
    const std::string sub = Join(dir, part);
    std::set<std::string> mine;  // a rank-local part's files may list a key each
    for (const std::string& name : MetadataFiles(tree, sub)) {
      auto src = tree.Open(sub + "/" + name);
      if (!src.ok() || src->bytes->Size() > kMaxPartMetadataBytes) return {};
      auto bytes = ReadRange(*src->bytes, 0, src->bytes->Size(), kMaxPartMetadataBytes);
      if (!bytes.ok()) return {};
      auto md = ParseDcpMetadata(*bytes, src->bytes->Name());
      if (!md.ok()) return {};
      for (const DcpEntry& e : md->entries) mine.insert(e.fqn);
    }
    for (const std::string& k : mine) {
      if (keys.count(k) != 0) return {};  // a key of another part: not one checkpoint
    }
    keys.insert(mine.begin(), mine.end());
  }
  return parts;
}

class DcpScan {
 public:
  explicit DcpScan(const SourceTree& tree) : tree_(tree), dir_(tree.Root()), builder_(tree) {}

  Result<Checkpoint> Run(const ScanProgress& progress) {
    UCPFS_RETURN_IF_ERROR(ReadMegatronMarker());
    UCPFS_RETURN_IF_ERROR(ReadMetadata());
    builder_.checkpoint().format = "dcp";
    if (megatron_) builder_.checkpoint().flavor = "megatron-torch_dist";
    facts_.megatron_core = megatron_;

    const bool with_common = megatron_ && tree_.IsFile("common.pt");
    const uint64_t total = entries_.size() + (with_common ? 1 : 0);
    uint64_t done = 0;
    for (const Merged& m : entries_) {
      Item item;
      if (m.entry.is_bytes) {
        UCPFS_ASSIGN_OR_RETURN(item, ScanBytes(m));
      } else {
        UCPFS_ASSIGN_OR_RETURN(item, ScanTensor(m));
      }
      builder_.AddItem(std::move(item));
      if (progress) progress(++done, total);
    }
    if (with_common) {
      // Megatron's common state (torch.save of the non-sharded state dict), kept as an opaque
      // byte item named after the file.
      UCPFS_ASSIGN_OR_RETURN(uint32_t id, builder_.AddFile("common.pt"));
      Item item;
      item.key = "common.pt";
      item.kind = ItemKind::kBytes;
      item.file_id = id;
      item.byte_offset = 0;
      item.n_bytes = builder_.checkpoint().files[id].n_bytes;
      builder_.AddItem(std::move(item));
      ReadMegatronArgs(id);
      if (progress) progress(++done, total);
    }
    builder_.checkpoint().facts = facts_;
    Checkpoint out = builder_.Take();
    if (megatron_) {
      // Megatron-Core stacks a block's layers (and experts) under one key: one item per layer.
      UCPFS_ASSIGN_OR_RETURN(out.items, UnstackMegatronItems(std::move(out.items)));
    }
    return out;
  }

 private:
  // One state_dict_metadata entry after merging metadata files; chunk_meta[i] is the metadata
  // file (index into metas_) that listed chunks[i].
  struct Merged {
    DcpEntry entry;
    std::vector<size_t> chunk_meta;
    size_t meta = 0;  // the file that listed the entry first
  };

  // Megatron-LM records its arguments in the common state (`args`, an argparse.Namespace). The
  // vocabulary padding of another tensor-parallel size needs the real vocabulary (vocab_size,
  // None when a tokenizer gave it; one more with NullTokenizer: MegatronTokenizerVocab) and
  // make_vocab_size_divisible_by; splitting the fused QKV
  // needs the query groups (or heads and kv_channels); Megatron's weight-decay rule, which the
  // optimizer's param groups are matched by (MegatronCoreOptimizerFactsOf), needs
  // apply_wd_to_qk_layernorm. Decoded once (DecodeMegatronArgs) into the facts; a common.pt that does not parse,
  // or has no args, leaves them unset (the preset's defaults apply).
  void ReadMegatronArgs(uint32_t common_id) {
    auto tf = builder_.OpenTorchFile(common_id);
    if (!tf.ok()) return;
    const pickle::PickleGraph& g = tf->graph();
    facts_.args = DecodeMegatronArgs(g, g.DictGet(g.root(), "args"));
  }

  // ---- directory and metadata ------------------------------------------------------------

  Status ReadMegatronMarker() {
    const std::string path = tree_.PathOf("metadata.json");
    if (!tree_.IsFile("metadata.json")) return Status::Ok();
    UCPFS_ASSIGN_OR_RETURN(OpenedFile src, tree_.Open("metadata.json"));
    UCPFS_ASSIGN_OR_RETURN(std::vector<std::byte> bytes,
                           ReadRange(*src.bytes, 0, src.bytes->Size(), 16u << 20));
    const auto* begin = reinterpret_cast<const char*>(bytes.data());
    nlohmann::json j = nlohmann::json::parse(begin, begin + bytes.size(), nullptr, false);
    if (j.is_discarded()) return CorruptError(path + ": not valid JSON");
    if (!j.is_object() || !j.contains("sharded_backend")) return Status::Ok();  // not Megatron's
    const auto& backend = j["sharded_backend"];
    if (!backend.is_string() || backend.get<std::string>() != "torch_dist") {
      return UnsupportedError(path + ": Megatron sharded_backend " + backend.dump() +
                              " is not supported (only torch_dist)");
    }
    megatron_ = true;
    UCPFS_RETURN_IF_ERROR(builder_.AddFile("metadata.json").status());
    return Status::Ok();
  }

  Status ReadMetadata() {
    if (!tree_.IsDirectory("")) return NotFoundError(dir_ + ": no such directory");
    // (part directory with its '/', metadata file name): the directory's own metadata, or each
    // part's of a composite directory (CompositeParts), whose data paths are relative to the part.
    std::vector<std::pair<std::string, std::string>> names;
    for (const std::string& name : MetadataFiles(tree_, "")) names.emplace_back("", name);
    if (names.empty() && !megatron_) {
      for (const std::string& part : CompositeParts(tree_, "")) {
        for (const std::string& name : MetadataFiles(tree_, part)) names.emplace_back(part + "/", name);
      }
    }
    if (names.empty()) {
      return NotFoundError(dir_ + ": no DCP metadata (neither .metadata nor __<rank>.metadata, nor DCP "
                                  "subdirectories with disjoint keys)");
    }
    for (const auto& [base, name] : names) {
      UCPFS_ASSIGN_OR_RETURN(uint32_t id, builder_.AddFile(base + name));
      const ByteSource& src = *builder_.source(id);
      UCPFS_ASSIGN_OR_RETURN(std::vector<std::byte> bytes,
                             ReadRange(src, 0, src.Size(), kMaxMetadataBytes));
      UCPFS_ASSIGN_OR_RETURN(DcpMetadata md, ParseDcpMetadata(bytes, src.Name()));
      metas_.push_back(std::move(md));
      meta_names_.push_back(src.Name());
      meta_bases_.push_back(base);
    }
    builder_.checkpoint().flavor = metas_.front().flavor;
    return Merge();
  }

  // Union of the metadata files' entries in first-seen order; chunks are concatenated (a
  // rank-local file lists only its rank's chunks).
  Status Merge() {
    std::map<std::string, size_t> index;
    for (size_t mi = 0; mi < metas_.size(); ++mi) {
      for (DcpEntry& e : metas_[mi].entries) {
        auto [it, fresh] = index.emplace(e.fqn, entries_.size());
        if (fresh) {
          Merged m;
          m.meta = mi;
          m.chunk_meta.assign(e.chunks.size(), mi);
          m.entry = std::move(e);
          entries_.push_back(std::move(m));
          continue;
        }
        Merged& m = entries_[it->second];
        if (m.entry.is_bytes != e.is_bytes ||
            (!e.is_bytes && (m.entry.dtype != e.dtype || m.entry.size != e.size))) {
          auto desc = [](const DcpEntry& x) {
            return x.is_bytes ? std::string("bytes")
                              : std::string(TorchName(x.dtype)) + " " + JoinInts(x.size);
          };
          return CorruptError(meta_names_[mi] + ": '" + e.fqn + "' is " + desc(e) + " here but " +
                              desc(m.entry) + " in " + meta_names_[m.meta]);
        }
        for (DcpChunk& c : e.chunks) {
          m.entry.chunks.push_back(std::move(c));
          m.chunk_meta.push_back(mi);
        }
      }
      for (auto& [key, shape] : metas_[mi].nd_orig_shape) nd_orig_shape_.emplace(key, shape);
    }
    ApplySavedOrder();
    return Status::Ok();
  }

  // Items in the order of the state dict that was saved, where the metadata records it
  // (planner_data, the first metadata file's first): model.pt lists parameters in that order,
  // which is model.parameters()' order, so an optimizer built from the model matches optim.pt.
  // Entries no planner_data names keep their metadata order, after the others.
  void ApplySavedOrder() {
    std::map<std::string, size_t> rank;
    for (const DcpMetadata& md : metas_) {
      for (const std::string& key : md.saved_order) rank.emplace(key, rank.size());
    }
    if (rank.empty()) return;
    auto pos = [&](const Merged& m) {
      auto it = rank.find(m.entry.fqn);
      return it == rank.end() ? rank.size() : it->second;
    };
    std::stable_sort(entries_.begin(), entries_.end(),
                     [&](const Merged& a, const Merged& b) { return pos(a) < pos(b); });
  }

  // Storage for `key`, looked up first in metadata file `mi`, then in the others.
  const DcpStorage* FindStorage(const DcpStorageKey& key, size_t mi) const {
    if (auto it = metas_[mi].storage.find(key); it != metas_[mi].storage.end()) return &it->second;
    for (const DcpMetadata& md : metas_) {
      if (auto it = md.storage.find(key); it != md.storage.end()) return &it->second;
    }
    return nullptr;
  }

  // ---- files -----------------------------------------------------------------------------

  // A data file named by a storage entry of `what` (which names the item for errors).
  Result<uint32_t> AddDataFile(const DcpStorage& s, size_t meta, const std::string& what) {
    const std::string& meta_name = meta_names_[meta];
    if (!SafeRelativePath(s.relative_path)) {
      return CorruptError(meta_name + ": " + what + ": relative_path '" + s.relative_path +
                          "' leaves the checkpoint directory");
    }
    auto id = builder_.AddFile(meta_bases_[meta] + s.relative_path);
    if (!id.ok()) {
      if (id.error().code() == StatusCode::kNotFound) {
        return CorruptError(meta_name + ": " + what + ": data file '" + s.relative_path +
                            "' is missing");
      }
      return id.error().WithContext(what);
    }
    const uint64_t size = builder_.checkpoint().files[*id].n_bytes;
    if (!RangeInside(s.byte_offset, s.n_bytes, size)) {
      return CorruptError(builder_.source(*id)->Name() + ": " + what + ": storage entry [" +
                          std::to_string(s.byte_offset) + ", +" + std::to_string(s.n_bytes) +
                          ") lies past the end of the file (" + std::to_string(size) + " bytes)");
    }
    return *id;
  }

  // ---- items -----------------------------------------------------------------------------

  Result<Item> ScanBytes(const Merged& m) {
    const std::string what = "byte item '" + m.entry.fqn + "'";
    const DcpStorage* s = FindStorage(DcpStorageKey{m.entry.fqn, false, {}}, m.meta);
    if (s == nullptr) {
      // Some writers index BYTE_IO items with an offset; accept any entry of this fqn.
      for (const DcpMetadata& md : metas_) {
        auto it = md.storage.lower_bound(DcpStorageKey{m.entry.fqn, false, {}});
        if (it != md.storage.end() && it->first.fqn == m.entry.fqn) {
          s = &it->second;
          break;
        }
      }
    }
    if (s == nullptr)
      return CorruptError(meta_names_[m.meta] + ": " + what + " has no storage_data entry");
    UCPFS_RETURN_IF_ERROR(RefuseTransforms(*s, what));
    UCPFS_ASSIGN_OR_RETURN(uint32_t id, AddDataFile(*s, m.meta, what));
    Item item;
    item.key = m.entry.fqn;
    item.kind = ItemKind::kBytes;
    item.file_id = id;
    item.byte_offset = s->byte_offset;
    item.n_bytes = s->n_bytes;
    return item;
  }

  Status RefuseTransforms(const DcpStorage& s, const std::string& what) const {
    if (s.transform_descriptors.empty()) return Status::Ok();
    std::string list;
    for (const auto& d : s.transform_descriptors) list += (list.empty() ? "" : ", ") + d;
    return UnsupportedError(dir_ + "/" + s.relative_path + ": " + what +
                            " is stored through stream transforms [" + list +
                            "] (e.g. compression); only plain torch.save items can be served");
  }

  // The torch.save tensor of one chunk: opens the slice, checks that it holds a tensor whose
  // shape is `want` (up to leading size-1 axes), and returns it with the slice's base offset.
  struct Stored {
    format::TensorRecord rec;
    uint32_t file_id = 0;
    uint64_t byte_offset = 0;      // absolute offset of the first element in the file
    std::vector<int64_t> strides;  // per chunk dim; empty when row-major contiguous
  };

  Result<Stored> OpenChunk(const DcpStorage& s, uint32_t id, const std::vector<int64_t>& want,
                           const std::string& what) {
    const std::shared_ptr<const ByteSource>& file = builder_.source(id);
    // SerializationFormat.SAFETENSORS (torch >= 2.8) records offsets into one safetensors blob
    // per file: u64 header length, then '{'. A torch.save zip starts with "PK\3\4".
    std::byte head[9] = {};
    const uint64_t n_head = std::min<uint64_t>(sizeof(head), file->Size() - s.byte_offset);
    if (n_head > 0) UCPFS_RETURN_IF_ERROR(file->ReadAt(s.byte_offset, std::span(head, n_head)));
    if (n_head == sizeof(head) && std::memcmp(head, "PK\x03\x04", 4) != 0 &&
        head[8] == std::byte{'{'}) {
      return UnsupportedError(
          file->Name() + ": " + what +
          " is stored in a safetensors blob (DCP SerializationFormat.SAFETENSORS), "
          "which is not supported");
    }
    UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<SliceSource> slice,
                           SliceSource::Make(file, s.byte_offset, s.n_bytes));
    auto tf = format::TorchFile::Open(slice);
    if (!tf.ok()) return tf.error().WithContext(what);
    const pickle::PickleGraph& g = tf->graph();
    if (g.root() == pickle::kNoNode || g.kind(g.root()) != pickle::Kind::kTensor ||
        tf->tensors().empty() || !tf->tensors().front().key.empty()) {
      return CorruptError(slice->Name() + ": " + what + ": blob holds a " +
                          (g.root() == pickle::kNoNode ? std::string("nothing")
                                                       : pickle::KindName(g.kind(g.root()))) +
                          ", not a tensor");
    }
    Stored out;
    out.rec = tf->tensors().front();
    out.file_id = id;
    auto abs = CheckedAdd(s.byte_offset, out.rec.data_offset);
    if (!abs) return CorruptError(slice->Name() + ": " + what + ": data offset overflows");
    out.byte_offset = *abs;
    const std::vector<int64_t>& have = out.rec.shape;
    if (have != want && StripLeadingOnes(have) != StripLeadingOnes(want)) {
      return CorruptError(slice->Name() + ": " + what + ": stored tensor has shape " +
                          JoinInts(have) + " but the metadata declares chunk sizes " +
                          JoinInts(want));
    }
    if (!out.rec.contiguous) {
      // Align the stored strides to the chunk's dims (size-1 axes take any stride).
      out.strides.assign(want.size(), 1);
      const size_t n = std::min(want.size(), have.size());
      for (size_t i = 0; i < n; ++i) {
        out.strides[want.size() - 1 - i] = out.rec.stride[have.size() - 1 - i];
      }
    }
    return out;
  }

  Result<Item> ScanTensor(const Merged& m) {
    const DcpEntry& e = m.entry;
    Item item;
    item.key = e.fqn;
    item.kind = ItemKind::kTensor;
    item.dtype = e.dtype;

    const auto nd = nd_orig_shape_.find(e.fqn);
    std::vector<int64_t> local;  // nd-reformulated: the local chunk shape x per original axis
    if (nd != nd_orig_shape_.end()) {
      UCPFS_ASSIGN_OR_RETURN(local, NdLocalShape(m, nd->second));
      item.layout.shape = nd->second;
    } else {
      item.layout.shape = e.size;
    }

    std::set<
        std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::string, uint64_t, uint64_t>>
        seen;
    for (size_t ci = 0; ci < e.chunks.size(); ++ci) {
      const DcpChunk& c = e.chunks[ci];
      const std::string& meta_name = meta_names_[m.chunk_meta[ci]];
      const std::string what = "tensor '" + e.fqn + "' chunk at offsets " + JoinInts(c.offsets);
      UCPFS_RETURN_IF_ERROR(CheckChunk(e, c, meta_name, what));
      const DcpStorage* s = FindStorage(DcpStorageKey{e.fqn, true, c.offsets}, m.chunk_meta[ci]);
      const bool empty = HasZero(c.sizes);
      if (s == nullptr) {
        if (empty) continue;  // an empty chunk needs no bytes
        return CorruptError(meta_name + ": " + what + " has no storage_data entry");
      }
      // The same chunk listed by several metadata files with the same storage is one chunk.
      if (!seen.emplace(c.offsets, c.sizes, s->relative_path, s->byte_offset, s->n_bytes).second)
        continue;
      UCPFS_RETURN_IF_ERROR(RefuseTransforms(*s, what));
      UCPFS_ASSIGN_OR_RETURN(uint32_t id, AddDataFile(*s, m.chunk_meta[ci], what));
      if (empty) continue;  // torch.chunk leaves the last ranks empty: no elements, no fragment
      UCPFS_ASSIGN_OR_RETURN(Stored st, OpenChunk(*s, id, c.sizes, what));

      if (st.rec.dtype != e.dtype) {
        return CorruptError(builder_.source(id)->Name() + ": " + what + ": the metadata says " +
                            std::string(TorchName(e.dtype)) + " but the stored tensor is " +
                            std::string(TorchName(st.rec.dtype)));
      }
      slice::Fragment f;
      f.file_id = st.file_id;
      f.byte_offset = st.byte_offset;
      f.dtype = st.rec.dtype;
      if (nd == nd_orig_shape_.end()) {
        f.box.offsets = c.offsets;
        f.box.sizes = c.sizes;
        f.flat_lo = 0;
        f.flat_hi = f.box.Volume();
        f.strides = std::move(st.strides);
      } else {
        // Megatron flattened_range: chunk (cx, cy, ..., a) + (1, ..., 1, b - a) of the
        // reformulated [X//x, Y//y, ..., x*y*...] is flat range [a, b) of the original box
        // [cx*x, cy*y, ...] + [x, y, ...], stored as a 1-D contiguous run.
        if (!st.strides.empty()) {
          return UnsupportedError(builder_.source(id)->Name() + ": " + what +
                                  ": flattened-range chunk is stored non-contiguous");
        }
        const size_t n = local.size();
        for (size_t i = 0; i < n; ++i) {
          f.box.offsets.push_back(c.offsets[i] * local[i]);  // c.offsets[i] < X/x: no overflow
          f.box.sizes.push_back(local[i]);
        }
        f.flat_lo = static_cast<uint64_t>(c.offsets[n]);
        f.flat_hi = f.flat_lo + static_cast<uint64_t>(c.sizes[n]);
      }
      item.layout.fragments.push_back(std::move(f));
    }

    UCPFS_RETURN_IF_ERROR(builder_.FinishTensor(item, meta_names_[m.meta]));
    return item;
  }

  // Chunk rank and bounds against the DCP tensor's global size.
  static Status CheckChunk(const DcpEntry& e, const DcpChunk& c, const std::string& meta_name,
                           const std::string& what) {
    if (c.offsets.size() != e.size.size() || c.sizes.size() != e.size.size()) {
      return CorruptError(meta_name + ": " + what + ": offsets/sizes have " +
                          std::to_string(c.offsets.size()) + "/" + std::to_string(c.sizes.size()) +
                          " dims but the tensor has " + std::to_string(e.size.size()));
    }
    for (size_t i = 0; i < e.size.size(); ++i) {
      auto end = CheckedAdd(static_cast<uint64_t>(c.offsets[i]), static_cast<uint64_t>(c.sizes[i]));
      if (!end || *end > static_cast<uint64_t>(e.size[i])) {
        return CorruptError(meta_name + ": " + what + " with sizes " + JoinInts(c.sizes) +
                            " lies outside the tensor's size " + JoinInts(e.size));
      }
    }
    return Status::Ok();
  }

  // For an nd-reformulated tensor: the original local chunk shape x (X = R_i * x_i per axis,
  // R_n = prod x). Errors: kCorrupt when the shapes do not fit or a chunk is not flat.
  Result<std::vector<int64_t>> NdLocalShape(const Merged& m,
                                            const std::vector<int64_t>& orig) const {
    const DcpEntry& e = m.entry;
    const std::string where = meta_names_[m.meta] + ": tensor '" + e.fqn + "'";
    const std::string shapes = "reformulated size " + JoinInts(e.size) +
                               " does not fit nd_reformulated_orig_global_shape " + JoinInts(orig);
    const size_t n = orig.size();
    if (e.size.size() != n + 1) return CorruptError(where + ": " + shapes);
    std::vector<int64_t> local(n);
    uint64_t prod = 1;
    for (size_t i = 0; i < n; ++i) {
      if (e.size[i] == 0) {
        if (orig[i] != 0) return CorruptError(where + ": " + shapes);
        local[i] = 0;
      } else {
        if (orig[i] % e.size[i] != 0) return CorruptError(where + ": " + shapes);
        local[i] = orig[i] / e.size[i];
      }
      auto p = CheckedMul(prod, static_cast<uint64_t>(local[i]));
      if (!p) return CorruptError(where + ": " + shapes);
      prod = *p;
    }
    if (prod != static_cast<uint64_t>(e.size[n]) && !HasZero(orig))
      return CorruptError(where + ": " + shapes);
    for (const DcpChunk& c : e.chunks) {
      for (size_t i = 0; i < n && i < c.sizes.size(); ++i) {
        if (c.sizes[i] > 1) {
          return CorruptError(where + ": flattened-range chunk at offsets " + JoinInts(c.offsets) +
                              " has sizes " + JoinInts(c.sizes) +
                              " (expected 1 on every axis but the last)");
        }
      }
    }
    return local;
  }

  const SourceTree& tree_;
  std::string dir_;  // the tree's root, for messages
  bool megatron_ = false;
  DcpSourceFacts facts_;
  CheckpointBuilder builder_;
  std::vector<DcpMetadata> metas_;
  std::vector<std::string> meta_names_;
  std::vector<std::string> meta_bases_;  // per metadata file: "" or its part directory with '/'
  std::vector<Merged> entries_;
  std::map<std::string, std::vector<int64_t>> nd_orig_shape_;
};

}  // namespace

bool IsDcpDirectory(const SourceTree& tree) {
  return tree.IsFile(".metadata") || !RankLocalMetadataFiles(tree, "").empty();
}

std::vector<std::string> DcpCompositeParts(const SourceTree& tree) { return CompositeParts(tree, ""); }

Result<Checkpoint> ScanDcp(const SourceTree& tree, const ScanProgress& progress) {
  return DcpScan(tree).Run(progress);
}

MegatronCoreOptimizerFacts MegatronCoreOptimizerFactsOf(const Checkpoint& c, const KeyMapping& mapping,
                                                        const FileTable& files) {
  using pickle::Kind;
  using pickle::NodeId;
  MegatronCoreOptimizerFacts out;
  const DcpSourceFacts* dcp = std::get_if<DcpSourceFacts>(&c.facts);
  if (dcp == nullptr || !dcp->megatron_core || !files) return out;
  const Item* common = nullptr;
  for (const Item& it : c.items) {
    if (it.kind == ItemKind::kBytes && it.key == "common.pt") common = &it;
  }
  if (common == nullptr || common->file_id >= files->size()) return out;
  auto slice = SliceSource::Make((*files)[common->file_id], common->byte_offset, common->n_bytes);
  auto tf = slice.ok() ? format::TorchFile::Open(*slice) : Result<format::TorchFile>(slice.error());
  if (!tf.ok()) {
    out.not_served.push_back({"common.pt: optimizer.param_groups", tf.error().message()});
    return out;
  }
  const pickle::PickleGraph& g = tf->graph();
  auto number = [&](NodeId n) -> std::optional<double> {
    if (g.kind(n) == Kind::kFloat) return g.float_value(n);
    if (g.kind(n) == Kind::kInt) return static_cast<double>(g.int_value(n));
    return std::nullopt;
  };
  auto truthy = [&](NodeId n) {
    return (g.kind(n) == Kind::kBool && g.bool_value(n)) || (g.kind(n) == Kind::kInt && g.int_value(n) != 0);
  };
  // The groups, each with its path: one optimizer's (`optimizer.optimizer.param_groups` or
  // `optimizer.param_groups`), or a ChainedOptimizer's, keyed 0, 1, ... (MoE: the dense
  // parameters' optimizer, then the expert-parallel ones').
  struct Group {
    std::string where;
    NodeId node;
  };
  std::vector<Group> list;
  auto add_groups = [&](NodeId o, const std::string& where) {
    NodeId groups = Get(g, Get(g, o, "optimizer"), "param_groups");
    std::string path = where + ".optimizer.param_groups";
    if (g.kind(groups) != Kind::kList) {
      groups = Get(g, o, "param_groups");
      path = where + ".param_groups";
    }
    const std::span<const NodeId> items = Items(g, groups);
    for (size_t i = 0; i < items.size(); ++i) list.push_back({path + "[" + std::to_string(i) + "]", items[i]});
  };
  const NodeId opt = Get(g, g.root(), "optimizer");
  add_groups(opt, "common.pt: optimizer");
  if (list.empty() && g.kind(opt) == Kind::kDict) {
    for (const auto& [k, v] : g.dict_items(opt)) {
      if (g.kind(k) == Kind::kInt) add_groups(v, "common.pt: optimizer." + std::to_string(g.int_value(k)));
    }
  }
  if (list.empty()) return out;  // dp_reshardable keeps them in its own objects
  const std::string where = "common.pt: optimizer param_groups";

  // The step: one for all groups (DistributedOptimizer.state_dict writes the same in each).
  for (const Group& group : list) {
    const std::optional<double> v = number(Get(g, group.node, "step"));
    if (!v) continue;
    if (out.step && *out.step != *v) {
      out.not_served.push_back({where, "the param groups record different steps; no step served"});
      out.step.reset();
      break;
    }
    out.step = v;
  }

  // Each group's class under Megatron's rule: expert-parallel or not, weight decay off (wd_mult
  // 0) or on; class = 2 * expert + no_wd.
  std::string refused;
  std::optional<size_t> group_of[4];
  bool expert_groups = false;
  for (size_t gi = 0; gi < list.size() && refused.empty(); ++gi) {
    const NodeId group = list[gi].node;
    const std::optional<double> wd_mult = number(Get(g, group, "wd_mult"));
    const std::optional<double> lr_mult = number(Get(g, group, "lr_mult"));
    const bool expert = truthy(Get(g, group, "is_expert_parallel"));
    expert_groups |= expert;
    const int cls = 2 * expert + (wd_mult && *wd_mult == 0.0);
    if (!wd_mult) {
      refused = list[gi].where + " has no wd_mult";
    } else if (truthy(Get(g, group, "is_decoupled_lr")) || (lr_mult && *lr_mult != 1.0)) {
      refused = list[gi].where + " differs from the others by more than weight decay (lr_mult or decoupled lr)";
    } else if (group_of[cls]) {
      refused = list[gi].where + " and " + list[*group_of[cls]].where + " are of one class";
    } else {
      group_of[cls] = gi;
    }
  }
  // The parameters of each class, in mapping order. Expert parameters (`.experts.`: SequentialMLP's
  // local_experts, TEGroupedMLP's experts) are expert-parallel when the optimizer has such groups
  // (Megatron-Core marks them so only with expert_model_parallel_size > 1).
  const bool wd_on_qk_layernorm = dcp->args && dcp->args->apply_wd_to_qk_layernorm;
  std::vector<std::string> members[4];
  for (const ParamEntry& p : mapping.params) {
    int32_t primary = p.item[static_cast<int>(StateKind::kWeight)];
    if (primary < 0) primary = p.item[static_cast<int>(StateKind::kFp32)];
    if (primary < 0 || c.items[static_cast<size_t>(primary)].kind != ItemKind::kTensor) continue;
    const size_t n_dims = c.items[static_cast<size_t>(primary)].layout.shape.size();
    const bool expert = expert_groups && p.name.find(".experts.") != std::string::npos;
    members[2 * expert + MegatronNoWeightDecay(p.name, n_dims, wd_on_qk_layernorm)].push_back(p.name);
  }
  for (int cls = 0; cls < 4 && refused.empty(); ++cls) {
    if (members[cls].empty()) continue;
    if (!group_of[cls]) {
      refused = "no " + std::string(cls >= 2 ? "expert-parallel " : "") + "group " +
                std::string(cls % 2 ? "without" : "with") + " weight decay for the " +
                std::to_string(members[cls].size()) + " parameters Megatron's rule puts there (first '" +
                members[cls].front() + "')";
      break;
    }
    // Saves that keep the groups' parameter lists: as many as the rule gives.
    const NodeId params = Get(g, list[*group_of[cls]].node, "params");
    if ((g.kind(params) == Kind::kList || g.kind(params) == Kind::kTuple) &&
        Items(g, params).size() != members[cls].size()) {
      refused = list[*group_of[cls]].where + " lists " + std::to_string(Items(g, params).size()) +
                " parameters; Megatron's rule gives it " + std::to_string(members[cls].size());
    }
  }
  if (!refused.empty()) {
    out.not_served.push_back({where, "hyper-parameters left out of optim.pt: " + refused +
                                         "; parameters cannot be matched to their groups"});
    return out;
  }
  for (int cls = 0; cls < 4; ++cls) {
    if (members[cls].empty()) continue;
    const Group& source = list[*group_of[cls]];
    MegatronCoreParamGroup group;
    group.params = std::move(members[cls]);
    for (const auto& [k, v] : Pairs(g, source.node)) {
      // step is each parameter's state in torch's form, not a group field.
      if (g.kind(k) != Kind::kString || g.text(k) == "params" || g.text(k) == "param_names" || g.text(k) == "step") {
        continue;
      }
      auto value = format::DecodeValueAt(*tf, *slice, v);
      if (!value.ok()) {
        out.not_served.push_back({source.where + "." + std::string(g.text(k)),
                                  value.error().message()});
        continue;
      }
      group.fields.emplace_back(std::string(g.text(k)), std::move(*value));
    }
    out.groups.push_back(std::move(group));
  }
  return out;
}

}  // namespace ucpfs::index
