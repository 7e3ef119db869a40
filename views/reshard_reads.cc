#include "views/reshard_reads.h"

#include <algorithm>
#include <map>
#include <unordered_map>

#include "core/format/torch_writer.h"

namespace ucpfs::views {
namespace {

// Longest strided run whose elements enter the distinct tally one by one; a longer one enters
// as its span (and the file's distinct count becomes an upper bound), so memory stays bounded.
constexpr uint64_t kMaxStridedElems = 4096;

// Disjoint half-open byte intervals [lo, hi), merged on insertion.
class IntervalSet {
 public:
  void Add(uint64_t lo, uint64_t hi) {
    if (lo >= hi) return;
    auto it = spans_.upper_bound(lo);
    if (it != spans_.begin() && std::prev(it)->second >= lo) {
      --it;
      lo = it->first;
      hi = std::max(hi, it->second);
      it = spans_.erase(it);
    }
    while (it != spans_.end() && it->first <= hi) {
      hi = std::max(hi, it->second);
      it = spans_.erase(it);
    }
    spans_.emplace(lo, hi);
  }
  uint64_t Total() const {
    uint64_t n = 0;
    for (const auto& [lo, hi] : spans_) n += hi - lo;
    return n;
  }

 private:
  std::map<uint64_t, uint64_t> spans_;
};

uint64_t Sum(const std::vector<uint64_t>& v) {
  uint64_t n = 0;
  for (uint64_t x : v) n += x;
  return n;
}

}  // namespace

uint64_t RankReads::ReadTotal() const { return Sum(read_n_bytes); }
uint64_t RankReads::FileTotal() const {
  uint64_t n = 0;
  for (const auto& f : files) n += f.file_n_bytes;
  return n;
}
uint64_t RankReads::PayloadTotal() const {
  uint64_t n = 0;
  for (const auto& f : files) n += f.payload_n_bytes;
  return n;
}

uint64_t ReshardReads::ReadTotal() const {
  uint64_t n = 0;
  for (const auto& r : ranks) n += r.ReadTotal();
  return n;
}
uint64_t ReshardReads::FileTotal() const {
  uint64_t n = 0;
  for (const auto& r : ranks) n += r.FileTotal();
  return n;
}
uint64_t ReshardReads::PayloadTotal() const {
  uint64_t n = 0;
  for (const auto& r : ranks) n += r.PayloadTotal();
  return n;
}

Result<ReshardReads> ComputeReshardReads(const TargetPlan& plan,
                                         std::span<const std::shared_ptr<const ByteSource>> files) {
  std::unordered_map<const ByteSource*, size_t> file_id;
  for (size_t i = 0; i < files.size(); ++i) file_id.emplace(files[i].get(), i);
  ReshardReads out;
  out.layout = plan.layout().name;
  out.sources.assign(files.size(), SourceReads{});
  std::vector<IntervalSet> distinct(files.size());
  RankFileSet want;
  want.model_safetensors = false;  // the same tensors as model.pt: a rank loads one or the other
  want.info = false;
  for (int rank = 0; rank < plan.layout().World(); ++rank) {
    const std::string where = "layout " + plan.layout().name + " rank " + std::to_string(rank);
    auto built = plan.Build(rank, want);
    if (!built.ok()) return built.error().WithContext(where);
    RankReads rr;
    rr.rank = rank;
    rr.read_n_bytes.assign(files.size(), 0);
    const std::pair<const char*, const std::shared_ptr<const ByteSource>*> kFiles[] = {
        {"model.pt", &built->model}, {"optim.pt", &built->optim}, {"extra_state.pt", &built->extra}};
    for (const auto& [name, source] : kFiles) {
      if (!*source) continue;
      RankFileReads f;
      f.name = name;
      f.file_n_bytes = (*source)->Size();
      f.read_n_bytes.assign(files.size(), 0);
      const auto* torch_file = dynamic_cast<const format::LazyTorchFile*>(source->get());
      if (torch_file == nullptr) return InternalError(where + ": " + f.name + " is not a lazy torch file");
      for (const auto& rec : torch_file->records()) {
        if (rec.tensor_index >= 0) f.payload_n_bytes += rec.n_bytes;
      }
      uint64_t view_n_bytes = 0;
      Status unknown;
      Status st = (*source)->DescribeReads(0, f.file_n_bytes, [&](const SourceRun& run) {
        view_n_bytes += run.ViewBytes();
        if (run.file == nullptr) {
          f.zero_n_bytes += run.ViewBytes();
          return;
        }
        auto it = file_id.find(run.file);
        if (it == file_id.end()) {
          if (unknown.ok()) unknown = InternalError(where + ": " + f.name + " reads " + run.file->Name() +
                                                    ", which is not in the source file table");
          return;
        }
        const size_t id = it->second;
        if (run.src_item_n_bytes != run.dst_item_n_bytes) f.converted_n_bytes += run.ViewBytes();
        f.read_n_bytes[id] += run.ReadBytes();
        const uint64_t isz = run.src_item_n_bytes;
        if (run.elem_stride == 1 || run.n_elems <= 1) {
          distinct[id].Add(run.byte_offset, run.byte_offset + run.ReadBytes());
        } else if (run.elem_stride > 0 && run.n_elems <= kMaxStridedElems) {
          const uint64_t step = static_cast<uint64_t>(run.elem_stride) * isz;
          for (uint64_t e = 0; e < run.n_elems; ++e) distinct[id].Add(run.byte_offset + e * step, run.byte_offset + e * step + isz);
        } else {
          const uint64_t stride = static_cast<uint64_t>(std::max<int64_t>(1, run.elem_stride));
          distinct[id].Add(run.byte_offset, run.byte_offset + ((run.n_elems - 1) * stride + 1) * isz);
          out.sources[id].distinct_exact = false;
        }
      });
      if (!st.ok()) return st.WithContext(where);
      if (!unknown.ok()) return unknown;
      if (view_n_bytes != f.payload_n_bytes) {
        return InternalError(where + ": " + f.name + ": its reads fill " + std::to_string(view_n_bytes) +
                             " bytes of its " + std::to_string(f.payload_n_bytes) + " bytes of tensor data");
      }
      for (size_t i = 0; i < files.size(); ++i) rr.read_n_bytes[i] += f.read_n_bytes[i];
      rr.files.push_back(std::move(f));
    }
    for (size_t i = 0; i < files.size(); ++i) {
      out.sources[i].read_n_bytes += rr.read_n_bytes[i];
      if (rr.read_n_bytes[i] > 0) ++out.sources[i].fan_out;
    }
    out.ranks.push_back(std::move(rr));
  }
  for (size_t i = 0; i < files.size(); ++i) out.sources[i].distinct_n_bytes = distinct[i].Total();
  return out;
}

}  // namespace ucpfs::views
