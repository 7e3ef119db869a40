// See checkpoint_builder.h.
#include "index/checkpoint_builder.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <span>
#include <utility>

#include "core/checked.h"
#include "core/slice/slice.h"

namespace ucpfs::index {
namespace {

constexpr uint64_t kCompareBlockBytes = 1u << 20;

}  // namespace

std::string JoinInts(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + "]";
}

Result<uint32_t> CheckpointBuilder::AddFile(const std::string& rel_path) {
  if (auto it = file_ids_.find(rel_path); it != file_ids_.end()) return it->second;
  if (!SafeRelativePath(rel_path) || !SafeTreePath(rel_path)) {
    return CorruptError(dir() + ": file path '" + rel_path + "' leaves the checkpoint directory");
  }
  auto src = tree_.Open(rel_path);
  if (!src.ok()) return src.status();
  const FileIdentity& ident = src->identity;  // of the version opened
  SourceFile f;
  f.rel_path = rel_path;
  f.n_bytes = ident.n_bytes;
  f.mtime_ns = ident.mtime_ns;
  f.dev = ident.dev;
  f.ino = ident.ino;
  f.ctime_ns = ident.ctime_ns;
  const auto id = static_cast<uint32_t>(ckpt_.files.size());
  // Read through the scan's bounded descriptor cache (a checkpoint may have more files than
  // the open-file limit); the descriptor opened here closes now.
  UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<const LazySource> lazy, tree_.OpenLazy(rel_path, f.Identity(), nullptr, fd_cache_));
  sources_.push_back(std::move(lazy));
  ckpt_.files.push_back(std::move(f));
  file_ids_.emplace(rel_path, id);
  return id;
}

Status TpSliceMerger::Add(Item item, int tp_rank, const std::string& where) {
  auto [it, fresh] = index_.try_emplace(item.key, merged_.size());
  if (fresh) {
    contributed_.insert({item.key, tp_rank});
    merged_.push_back(std::move(item));
    return Status::Ok();
  }
  Item& into = merged_[it->second];
  if (into.layout.shape.empty()) return Status::Ok();  // a step: every tp rank's is the same
  if (!contributed_.insert({item.key, tp_rank}).second) {
    if (!repeat_is_error_) return Status::Ok();
    return CorruptError(where + ": '" + item.key + "' is stored by another pipeline stage too");
  }
  if (into.layout.shape != item.layout.shape) {
    return CorruptError(where + ": '" + item.key + "': the slice of tp rank " + std::to_string(tp_rank) +
                        " makes a tensor of shape " + JoinInts(item.layout.shape) + ", another rank's " +
                        JoinInts(into.layout.shape));
  }
  for (slice::Fragment& f : item.layout.fragments) into.layout.fragments.push_back(std::move(f));
  return Status::Ok();
}

Status FoldTpMean(Item& item, int n_copies, const std::string& where) {
  const uint64_t numel = item.layout.NumElems();
  if (numel == 0) return Status::Ok();
  auto refuse = [&](const std::string& why) {
    return UnsupportedError(where + ": '" + item.key + "' (averaged over tp ranks): " + why);
  };
  const std::vector<int64_t> zeros(item.layout.shape.size(), 0);
  std::vector<int64_t> row_major(item.layout.shape.size(), 1);
  for (size_t d = row_major.size(); d-- > 1;) row_major[d - 1] = row_major[d] * item.layout.shape[d];
  std::vector<std::vector<slice::Fragment>> copies(1);
  uint64_t covered = 0;
  for (slice::Fragment& f : item.layout.fragments) {
    if (f.file_id == slice::kZeroFileId || f.box.offsets != zeros || f.box.sizes != item.layout.shape ||
        (!f.strides.empty() && f.strides != row_major) || !f.mean_with.empty()) {
      return refuse("a tp rank's slice is not a flat range of the whole tensor");
    }
    covered += f.NumElems();
    copies.back().push_back(std::move(f));
    if (covered == numel) {
      covered = 0;
      copies.emplace_back();
    }
  }
  copies.pop_back();
  if (covered != 0 || copies.size() != static_cast<size_t>(n_copies)) {
    return refuse("its slices make " + std::to_string(copies.size()) + " whole copies, not one per tp rank (" +
                  std::to_string(n_copies) + ")");
  }
  std::set<uint64_t> cuts;
  for (auto& copy : copies) {
    std::sort(copy.begin(), copy.end(), [](const auto& a, const auto& b) { return a.flat_lo < b.flat_lo; });
    uint64_t at = 0;
    for (const slice::Fragment& f : copy) {
      if (f.flat_lo != at) return refuse("a tp rank's slices overlap or leave a gap");
      cuts.insert(f.flat_lo);
      at = f.flat_hi;
    }
  }
  cuts.insert(numel);
  std::vector<slice::Fragment> out;
  std::vector<size_t> at(copies.size(), 0);  // each copy's fragment holding the current cut
  for (auto c = cuts.begin(); std::next(c) != cuts.end(); ++c) {
    const uint64_t lo = *c, hi = *std::next(c);
    for (size_t k = 0; k < copies.size(); ++k) {
      while (copies[k][at[k]].flat_hi <= lo) ++at[k];
    }
    const slice::Fragment& first = copies[0][at[0]];
    slice::Fragment g = first;
    g.strides.clear();
    g.flat_lo = lo;
    g.flat_hi = hi;
    g.byte_offset = first.byte_offset + (lo - first.flat_lo) * ItemSize(first.dtype);
    for (size_t k = 1; k < copies.size(); ++k) {
      const slice::Fragment& f = copies[k][at[k]];
      g.mean_with.push_back({f.file_id, f.byte_offset + (lo - f.flat_lo) * ItemSize(f.dtype), f.dtype});
    }
    out.push_back(std::move(g));
  }
  item.layout.fragments = std::move(out);
  return Status::Ok();
}

Item CheckpointBuilder::WholeTensor(std::string key, DType dtype, std::vector<int64_t> shape, uint32_t file_id,
                                   uint64_t byte_offset, std::vector<int64_t> strides) {
  Item item;
  item.key = std::move(key);
  item.kind = ItemKind::kTensor;
  item.dtype = dtype;
  item.layout.shape = std::move(shape);
  if (item.layout.NumElems() == 0) return item;
  slice::Fragment f;
  f.box.offsets.assign(item.layout.shape.size(), 0);
  f.box.sizes = item.layout.shape;
  f.flat_lo = 0;
  f.flat_hi = item.layout.NumElems();
  f.file_id = file_id;
  f.byte_offset = byte_offset;
  f.dtype = dtype;
  f.strides = std::move(strides);
  item.layout.fragments.push_back(std::move(f));
  return item;
}

Result<format::TorchFile> CheckpointBuilder::OpenTorchFile(uint32_t file_id) const {
  return format::TorchFile::Open(sources_.at(file_id));
}

Status CheckpointBuilder::FinishTensor(Item& item, const std::string& where) {
  std::vector<std::pair<size_t, size_t>> replicas;
  Status cov = slice::ValidateCoverage(item.layout, item.key, &replicas);
  if (!cov.ok()) return cov.WithContext(where);
  if (!replicas.empty()) UCPFS_RETURN_IF_ERROR(DropReplicas(item, replicas));
  return Status::Ok();
}

// Replicas must hold equal data; keep the first of each pair.
Status CheckpointBuilder::DropReplicas(Item& item, const std::vector<std::pair<size_t, size_t>>& replicas) {
  std::set<size_t> drop;
  for (const auto& [a, b] : replicas) {
    UCPFS_RETURN_IF_ERROR(
        CompareReplicaFragments(item, item.layout.fragments[a], item.layout.fragments[b], sources_));
    drop.insert(b);
  }
  auto& frags = item.layout.fragments;
  for (auto it = drop.rbegin(); it != drop.rend(); ++it) {
    frags.erase(frags.begin() + static_cast<std::ptrdiff_t>(*it));
  }
  return Status::Ok();
}

Status CompareReplicaFragments(const Item& item, const slice::Fragment& a, const slice::Fragment& b,
                               const std::vector<std::shared_ptr<const ByteSource>>& sources) {
  auto differ = [&]() {
    return CorruptError(sources[b.file_id]->Name() + ": tensor '" + item.key +
                        "': box at offsets " + JoinInts(a.box.offsets) + " sizes " +
                        JoinInts(a.box.sizes) +
                        " is covered twice by replicas with different data (here at byte " +
                        std::to_string(b.byte_offset) + ", in " + sources[a.file_id]->Name() +
                        " at byte " + std::to_string(a.byte_offset) + ")");
  };
  if (a.strides.empty() && b.strides.empty() && a.dtype == b.dtype) {
    // Both plain byte ranges: compare them block by block.
    auto n = CheckedMul(a.NumElems(), ItemSize(a.dtype));
    if (!n) return CorruptError(item.key + ": replica size overflows");
    std::vector<std::byte> x(std::min<uint64_t>(*n, kCompareBlockBytes)), y(x.size());
    for (uint64_t done = 0; done < *n;) {
      const uint64_t len = std::min<uint64_t>(x.size(), *n - done);
      UCPFS_RETURN_IF_ERROR(
          sources[a.file_id]->ReadAt(a.byte_offset + done, std::span(x.data(), len)));
      UCPFS_RETURN_IF_ERROR(
          sources[b.file_id]->ReadAt(b.byte_offset + done, std::span(y.data(), len)));
      if (std::memcmp(x.data(), y.data(), len) != 0) return differ();
      done += len;
    }
    return Status::Ok();
  }
  // Strided or differently typed replicas: read both through the slice planner as row-major
  // elements of their box in one dtype.
  const DType dst = a.dtype == b.dtype ? a.dtype : item.dtype;
  auto single = [](const slice::Fragment& f) {
    slice::TensorLayout l;
    l.shape = f.box.sizes;
    slice::Fragment g = f;
    std::fill(g.box.offsets.begin(), g.box.offsets.end(), 0);
    l.fragments.push_back(std::move(g));
    return l;
  };
  const slice::TensorLayout la = single(a), lb = single(b);
  const uint64_t item_size = ItemSize(dst);
  const uint64_t per_block = std::max<uint64_t>(1, kCompareBlockBytes / item_size);
  std::vector<std::byte> x, y;
  for (uint64_t e = a.flat_lo; e < a.flat_hi;) {
    const uint64_t n = std::min(per_block, a.flat_hi - e);
    x.resize(n * item_size);
    y.resize(n * item_size);
    UCPFS_RETURN_IF_ERROR(slice::ReadTensorBytes(la, dst, sources, e * item_size, x));
    UCPFS_RETURN_IF_ERROR(slice::ReadTensorBytes(lb, dst, sources, e * item_size, y));
    if (std::memcmp(x.data(), y.data(), x.size()) != 0) return differ();
    e += n;
  }
  return Status::Ok();
}

std::vector<Status> CheckTpReplicas(const Checkpoint& checkpoint,
                                    const std::vector<std::shared_ptr<const ByteSource>>& sources,
                                    uint64_t* compared) {
  std::map<std::string, const Item*> by_key;
  for (const Item& it : checkpoint.items) by_key.emplace(it.key, &it);
  std::vector<Status> problems;
  for (const Item& copy : checkpoint.replicas) {
    const auto found = by_key.find(copy.key);
    for (const slice::Fragment& c : copy.layout.fragments) {
      const std::string where = c.file_id < sources.size() ? sources[c.file_id]->Name() : copy.key;
      const slice::Fragment* same = nullptr;
      if (found != by_key.end()) {
        for (const slice::Fragment& f : found->second->layout.fragments) {
          if (f.box.offsets == c.box.offsets && f.box.sizes == c.box.sizes && f.flat_lo == c.flat_lo &&
              f.flat_hi == c.flat_hi) {
            same = &f;
            break;
          }
        }
      }
      if (same == nullptr) {
        problems.push_back(CorruptError(where + ": tensor '" + copy.key +
                                        "': a tp-replicated copy with no matching piece in the tensor that is read"));
        continue;
      }
      if (c.file_id >= sources.size() || same->file_id >= sources.size()) {
        problems.push_back(CorruptError(where + ": tensor '" + copy.key + "': file id out of range"));
        continue;
      }
      Status s = CompareReplicaFragments(*found->second, *same, c, sources);
      if (compared != nullptr) ++*compared;
      if (!s.ok()) {
        problems.push_back(std::move(s));
        break;  // one problem per copy
      }
    }
  }
  return problems;
}

void PlaceRange(const Placement& pl, uint64_t lo, uint64_t hi, uint32_t file_id, uint64_t byte_offset, DType dtype,
                std::vector<slice::Fragment>* out) {
  auto fragment = [&](slice::Box box, uint64_t flat_lo, uint64_t flat_hi, uint64_t bytes) {
    slice::Fragment f;
    f.box = std::move(box);
    f.flat_lo = flat_lo;
    f.flat_hi = flat_hi;
    f.file_id = file_id;
    f.byte_offset = bytes;
    f.dtype = dtype;
    out->push_back(std::move(f));
  };
  if (pl.pieces.empty()) {
    slice::Box whole;
    whole.offsets.assign(pl.global_shape.size(), 0);
    whole.sizes = pl.global_shape;
    fragment(std::move(whole), lo, hi, byte_offset);
    return;
  }
  uint64_t start = 0;
  for (const slice::Box& piece : pl.pieces) {
    const uint64_t vol = piece.Volume();
    const uint64_t a = std::max(lo, start), b = std::min(hi, start + vol);
    if (a < b) fragment(piece, a - start, b - start, byte_offset + (a - lo) * ItemSize(dtype));
    start += vol;
  }
}

Result<Item> PlacedItem(const Placement& pl, const std::string& key, const format::TensorRecord& rec,
                        uint32_t file_id, const std::string& where) {
  Item item;
  item.key = key;
  item.kind = ItemKind::kTensor;
  item.dtype = rec.dtype;
  item.layout.shape = pl.global_shape;
  if (rec.contiguous) {
    PlaceRange(pl, 0, rec.n_elems, file_id, rec.data_offset, rec.dtype, &item.layout.fragments);
  } else if (pl.pieces.empty()) {
    slice::Fragment f;
    f.box.offsets.assign(rec.shape.size(), 0);
    f.box.sizes = rec.shape;
    f.flat_lo = 0;
    f.flat_hi = rec.n_elems;
    f.file_id = file_id;
    f.byte_offset = rec.data_offset;
    f.dtype = rec.dtype;
    f.strides = rec.stride;
    item.layout.fragments.push_back(std::move(f));
  } else {
    return UnsupportedError(where + ": " + rec.key + " is a non-contiguous slice of a tensor-parallel parameter");
  }
  return item;
}

}  // namespace ucpfs::index
