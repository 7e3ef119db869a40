// ScanMegatronLegacy: Megatron-LM legacy save directory -> Checkpoint. See megatron_scan.h.
//
// Error rule: the first problem wins, in this order: the tracker file, the rank directories,
// rank 0's args, then each rank's file in (pp, tp) order; every message names the file.
#include "index/megatron_scan.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <optional>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/checked.h"
#include "core/format/torch_file.h"
#include "core/layout/layout.h"
#include "index/checkpoint_builder.h"
#include "index/pickle_walk.h"

namespace ucpfs::index {
namespace {

constexpr std::string_view kTracker = "latest_checkpointed_iteration.txt";
constexpr std::string_view kModelFile = "model_optim_rng.pt";
constexpr uint64_t kMaxTrackerBytes = 64;
constexpr int64_t kMaxDegree = 4096;
constexpr int64_t kMaxLayers = 1 << 20;
constexpr int64_t kMaxDim = int64_t{1} << 40;

std::string Pad(int64_t v, int width) {
  std::string s = std::to_string(v);
  return s.size() < static_cast<size_t>(width) ? std::string(static_cast<size_t>(width) - s.size(), '0') + s : s;
}

// The rank directory Megatron-LM's get_checkpoint_name gives (tensor and pipeline rank).
std::string RankDir(int tp_rank, int pp_rank, int pp) {
  return "mp_rank_" + Pad(tp_rank, 2) + (pp > 1 ? "_" + Pad(pp_rank, 3) : "");
}

// ---- reading the pickled structure as data ----

std::optional<int64_t> IntOf(const pickle::PickleGraph& g, pickle::NodeId n) {
  if (g.kind(n) == pickle::Kind::kInt) return g.int_value(n);
  return std::nullopt;
}

std::optional<double> NumberOf(const pickle::PickleGraph& g, pickle::NodeId n) {
  if (g.kind(n) == pickle::Kind::kFloat) return g.float_value(n);
  if (g.kind(n) == pickle::Kind::kInt) return static_cast<double>(g.int_value(n));
  return std::nullopt;
}

bool Truthy(const pickle::PickleGraph& g, pickle::NodeId n) {
  switch (g.kind(n)) {
    case pickle::Kind::kBool: return g.bool_value(n);
    case pickle::Kind::kInt: return g.int_value(n) != 0;
    default: return false;
  }
}

bool IsNone(const pickle::PickleGraph& g, pickle::NodeId n) {
  return n == pickle::kNoNode || g.kind(n) == pickle::Kind::kNone;
}

// The model facts the views take from the args (megatron_scan.h MegatronModelFacts); the
// embedding's tying is left to the names.
layout::ModelInfo ModelInfoOf(const MegatronSourceFacts& f) {
  layout::ModelInfo info;
  info.n_layers = static_cast<int>(std::min<int64_t>(f.num_layers, kMaxLayers));
  info.gated_linear_unit = f.swiglu;
  info.hidden_size = f.hidden_size;
  info.num_attention_heads = f.num_attention_heads;
  info.num_query_groups = f.num_query_groups;
  info.head_dim = f.kv_channels;
  info.vocab_size = f.vocab_size.value_or(0);
  info.vocab_pad_multiple = f.make_vocab_size_divisible_by;
  return info;
}

// The model facts of `args` (megatron_scan.h).
struct Args {
  int tp = 1, pp = 1;
  int64_t num_layers = 0, hidden_size = 0, heads = 0, query_groups = 0, kv_channels = 0;
  int64_t padded_vocab = 0, vocab = 0, divisible_by = 0;
  int64_t first_stage_layers = 0, last_stage_layers = 0;  // decoder_first/last_pipeline_num_layers
  bool swiglu = false, tied = true, distributed_optimizer = false, wd_on_qk_layernorm = false;
  double version = 0;
  // The grad-buffer settings of the distributed optimizer (Megatron-LM's get_model builds the
  // DistributedDataParallelConfig from them); checked only when distributed_optimizer is set.
  bool overlap_grad_reduce = false, overlap_param_gather_with_optimizer_step = false;
  int64_t ddp_bucket_size = 0, ddp_num_buckets = 0;  // 0: not given
  int64_t data_parallel_size = 1, context_parallel_size = 1, distopt_instances = 1, mtp_layers = 0;
  std::optional<bool> grads_in_fp32;  // accumulate_allreduce_grads_in_fp32, when saved
  std::string other_data_parallel;    // a non-DDP wrapper named in args (FSDP), or ""
};

Result<Args> ReadArgs(const format::TorchFile& tf, const std::string& where) {
  const pickle::PickleGraph& g = tf.graph();
  const pickle::NodeId args = Get(g, g.root(), "args");
  if (Pairs(g, args).empty()) {
    return CorruptError(where + ": no 'args' (the argparse.Namespace Megatron-LM saves) in the checkpoint");
  }
  Args a;
  auto need = [&](std::string_view key, int64_t lo, int64_t hi) -> Result<int64_t> {
    std::optional<int64_t> v = IntOf(g, Get(g, args, key));
    if (!v) return CorruptError(where + ": args." + std::string(key) + " is missing or not an int");
    if (*v < lo || *v > hi) {
      return CorruptError(where + ": args." + std::string(key) + " = " + std::to_string(*v) + " is out of range [" +
                          std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    return *v;
  };
  auto optional_int = [&](std::string_view key, int64_t lo, int64_t hi) -> Result<int64_t> {
    const pickle::NodeId n = Get(g, args, key);
    if (IsNone(g, n)) return int64_t{0};
    return need(key, lo, hi);
  };
  UCPFS_ASSIGN_OR_RETURN(const int64_t tp, need("tensor_model_parallel_size", 1, kMaxDegree));
  UCPFS_ASSIGN_OR_RETURN(const int64_t pp, need("pipeline_model_parallel_size", 1, kMaxDegree));
  a.tp = static_cast<int>(tp);
  a.pp = static_cast<int>(pp);
  UCPFS_ASSIGN_OR_RETURN(a.num_layers, need("num_layers", 1, kMaxLayers));
  UCPFS_ASSIGN_OR_RETURN(a.hidden_size, need("hidden_size", 1, kMaxDim));
  UCPFS_ASSIGN_OR_RETURN(a.heads, need("num_attention_heads", 1, kMaxDim));
  UCPFS_ASSIGN_OR_RETURN(a.padded_vocab, need("padded_vocab_size", 1, kMaxDim));
  UCPFS_ASSIGN_OR_RETURN(a.divisible_by, optional_int("make_vocab_size_divisible_by", 1, kMaxDim));
  UCPFS_ASSIGN_OR_RETURN(a.vocab, optional_int("vocab_size", 1, kMaxDim));
  if (const pickle::NodeId t = Get(g, args, "tokenizer_type"); g.kind(t) == pickle::Kind::kString) {
    a.vocab = MegatronTokenizerVocab(a.vocab, g.text(t));
  }
  UCPFS_ASSIGN_OR_RETURN(a.kv_channels, optional_int("kv_channels", 1, kMaxDim));
  a.query_groups = a.heads;
  if (Truthy(g, Get(g, args, "group_query_attention"))) {
    UCPFS_ASSIGN_OR_RETURN(a.query_groups, need("num_query_groups", 1, a.heads));
  }
  if (a.kv_channels == 0) {
    if (a.hidden_size % a.heads != 0) return CorruptError(where + ": args.hidden_size is not divisible by the heads");
    a.kv_channels = a.hidden_size / a.heads;
  }
  if (a.vocab > a.padded_vocab) {
    return CorruptError(where + ": the vocabulary of args.vocab_size (and tokenizer_type) " + std::to_string(a.vocab) + " exceeds padded_vocab_size " +
                        std::to_string(a.padded_vocab));
  }
  a.swiglu = Truthy(g, Get(g, args, "swiglu"));
  a.tied = !Truthy(g, Get(g, args, "untie_embeddings_and_output_weights"));
  a.distributed_optimizer = Truthy(g, Get(g, args, "use_distributed_optimizer"));
  a.wd_on_qk_layernorm = Truthy(g, Get(g, args, "apply_wd_to_qk_layernorm"));
  a.overlap_grad_reduce = Truthy(g, Get(g, args, "overlap_grad_reduce"));
  a.overlap_param_gather_with_optimizer_step = Truthy(g, Get(g, args, "overlap_param_gather_with_optimizer_step"));
  UCPFS_ASSIGN_OR_RETURN(a.ddp_bucket_size, optional_int("ddp_bucket_size", 1, kMaxDim));
  UCPFS_ASSIGN_OR_RETURN(a.ddp_num_buckets, optional_int("ddp_num_buckets", 1, kMaxDim));
  UCPFS_ASSIGN_OR_RETURN(a.data_parallel_size, optional_int("data_parallel_size", 1, kMaxDegree));
  UCPFS_ASSIGN_OR_RETURN(a.context_parallel_size, optional_int("context_parallel_size", 1, kMaxDegree));
  UCPFS_ASSIGN_OR_RETURN(a.distopt_instances, optional_int("num_distributed_optimizer_instances", 1, kMaxDegree));
  UCPFS_ASSIGN_OR_RETURN(a.mtp_layers, optional_int("mtp_num_layers", 0, kMaxLayers));
  a.data_parallel_size = std::max<int64_t>(a.data_parallel_size, 1);
  a.context_parallel_size = std::max<int64_t>(a.context_parallel_size, 1);
  a.distopt_instances = std::max<int64_t>(a.distopt_instances, 1);
  if (const pickle::NodeId n = Get(g, args, "accumulate_allreduce_grads_in_fp32"); g.kind(n) == pickle::Kind::kBool) {
    a.grads_in_fp32 = g.bool_value(n);
  }
  for (const char* fsdp : {"use_megatron_fsdp", "use_custom_fsdp", "use_torch_fsdp2"}) {
    if (Truthy(g, Get(g, args, fsdp))) a.other_data_parallel = fsdp;
  }

  auto refuse = [&](const std::string& why) { return UnsupportedError(where + ": " + why + " is not supported"); };
  UCPFS_ASSIGN_OR_RETURN(const int64_t ep, optional_int("expert_model_parallel_size", 1, kMaxDegree));
  UCPFS_ASSIGN_OR_RETURN(const int64_t experts, optional_int("num_experts", 0, kMaxDim));
  if (ep > 1 || experts > 0) return refuse("a mixture-of-experts model (args.num_experts, expert_model_parallel_size)");
  UCPFS_ASSIGN_OR_RETURN(const int64_t vpp, optional_int("virtual_pipeline_model_parallel_size", 1, kMaxDegree));
  UCPFS_ASSIGN_OR_RETURN(const int64_t vpp_layers, optional_int("num_layers_per_virtual_pipeline_stage", 1, kMaxLayers));
  if (vpp > 1 || vpp_layers > 0) return refuse("a virtual pipeline (args.virtual_pipeline_model_parallel_size)");
  if (Truthy(g, Get(g, args, "account_for_embedding_in_pipeline_split")) ||
      Truthy(g, Get(g, args, "account_for_loss_in_pipeline_split"))) {
    return refuse("a pipeline split that accounts for the embedding or the loss");
  }
  UCPFS_ASSIGN_OR_RETURN(a.first_stage_layers, optional_int("decoder_first_pipeline_num_layers", 0, a.num_layers));
  UCPFS_ASSIGN_OR_RETURN(a.last_stage_layers, optional_int("decoder_last_pipeline_num_layers", 0, a.num_layers));
  const std::optional<double> version = NumberOf(g, Get(g, g.root(), "checkpoint_version"));
  if (!version) return CorruptError(where + ": no checkpoint_version");
  if (*version < 3.0) {
    return refuse("checkpoint_version " + std::to_string(*version) + " (older QKV layouts; 3.0 and later are read)");
  }
  a.version = *version;
  return a;
}

// The layers of each pipeline stage, as Megatron splits them: evenly, or with the first and
// last stage's counts given and the rest split evenly over the middle stages.
Result<std::vector<int64_t>> StageLayers(const Args& a, const std::string& where) {
  std::vector<int64_t> n(static_cast<size_t>(a.pp), 0);
  int64_t rest = a.num_layers;
  int middle = a.pp;
  if (a.pp > 1 && a.first_stage_layers > 0) {
    n.front() = a.first_stage_layers;
    rest -= a.first_stage_layers;
    --middle;
  }
  if (a.pp > 1 && a.last_stage_layers > 0) {
    n.back() = a.last_stage_layers;
    rest -= a.last_stage_layers;
    --middle;
  }
  if (rest < 0 || (middle == 0 && rest != 0) || (middle > 0 && rest % middle != 0)) {
    return CorruptError(where + ": args.num_layers " + std::to_string(a.num_layers) +
                        " cannot be split over pipeline stages " + std::to_string(a.pp) + " as args say");
  }
  for (int s = 0; s < a.pp; ++s) {
    const bool given = (s == 0 && a.pp > 1 && a.first_stage_layers > 0) ||
                       (s == a.pp - 1 && a.pp > 1 && a.last_stage_layers > 0);
    if (!given) n[static_cast<size_t>(s)] = rest / middle;
  }
  return n;
}

// `decoder.layers.<n>.` / `encoder.layers.<n>.`: the position of <n> and its value.
std::optional<std::pair<size_t, size_t>> LayerNumberAt(const std::string& name) {
  for (std::string_view stack : {"decoder.layers.", "encoder.layers."}) {
    size_t at = name.find(stack);
    while (at != std::string::npos) {
      if (at == 0 || name[at - 1] == '.') {
        const size_t begin = at + stack.size();
        size_t end = begin;
        while (end < name.size() && std::isdigit(static_cast<unsigned char>(name[end])) != 0) ++end;
        if (end > begin && end - begin <= 9 && end < name.size() && name[end] == '.') return std::make_pair(begin, end);
      }
      at = name.find(stack, at + 1);
    }
  }
  return std::nullopt;
}

class MegatronScanner {
 public:
  explicit MegatronScanner(const SourceTree& tree) : builder_(tree) {}

  Result<Checkpoint> Run(const ScanProgress& progress) {
    UCPFS_RETURN_IF_ERROR(FindIteration());
    // Rank 0's args decide the degrees; then every rank's directory must be there.
    std::string rank0;
    for (const std::string& candidate : {RankDir(0, 0, 1), RankDir(0, 0, 2)}) {
      if (tree().IsFile(Rel(candidate + "/" + std::string(kModelFile)))) {
        rank0 = candidate;
        break;
      }
    }
    if (rank0.empty()) {
      return NotFoundError(Abs("") + " holds no " + RankDir(0, 0, 1) + "/" + std::string(kModelFile) + " or " +
                           RankDir(0, 0, 2) + "/" + std::string(kModelFile));
    }
    UCPFS_ASSIGN_OR_RETURN(const uint32_t id0, builder_.AddFile(Rel(rank0 + "/" + std::string(kModelFile))));
    UCPFS_ASSIGN_OR_RETURN(format::TorchFile tf0, builder_.OpenTorchFile(id0));
    const std::string where0 = builder_.source(id0)->Name();
    UCPFS_ASSIGN_OR_RETURN(args_, ReadArgs(tf0, where0));
    decoded_args_ = DecodeMegatronArgs(tf0.graph(), Get(tf0.graph(), tf0.graph().root(), "args"));
    if (rank0 != RankDir(0, 0, args_.pp)) {
      return CorruptError(where0 + ": args say pipeline size " + std::to_string(args_.pp) + ", but the rank directory is " +
                          rank0);
    }
    UCPFS_ASSIGN_OR_RETURN(stage_layers_, StageLayers(args_, where0));
    const int64_t n_files = int64_t{args_.tp} * args_.pp;
    if (n_files > 65536) return UnsupportedError(where0 + ": " + std::to_string(n_files) + " rank files");
    for (int s = 0; s < args_.pp; ++s) {
      for (int t = 0; t < args_.tp; ++t) {
        const std::string d = RankDir(t, s, args_.pp);
        if (!tree().IsDirectory(Rel(d))) {
          return CorruptError(Abs(d) + ": the directory of tp rank " + std::to_string(t) + ", pipeline stage " +
                              std::to_string(s) + " is missing (or not a directory)");
        }
      }
    }
    // A rank directory beyond the degrees means args and files disagree.
    for (const std::string& extra : {RankDir(args_.tp, 0, args_.pp), RankDir(0, args_.pp, args_.pp)}) {
      if (args_.pp > 1 || extra != RankDir(0, args_.pp, args_.pp)) {
        if (tree().IsDirectory(Rel(extra))) {
          return CorruptError(Abs(extra) + ": a rank directory beyond args' tp " + std::to_string(args_.tp) + " x pp " +
                              std::to_string(args_.pp));
        }
      }
    }
    Checkpoint& cp = builder_.checkpoint();
    cp.format = "megatron";
    cp.flavor = "megatron-lm-legacy tp" + std::to_string(args_.tp) + " pp" + std::to_string(args_.pp) +
                (args_.distributed_optimizer ? " distributed-optimizer" : "") + (iter_dir_.empty() ? "" : " " + iter_dir_);

    uint64_t done = 0;
    for (int s = 0; s < args_.pp; ++s) {
      for (int t = 0; t < args_.tp; ++t) {
        UCPFS_RETURN_IF_ERROR(ScanRank(t, s));
        if (progress) progress(++done, static_cast<uint64_t>(n_files));
      }
    }
    for (Item& item : merged_.items()) {
      if (!item.layout.shape.empty()) UCPFS_RETURN_IF_ERROR(builder_.FinishTensor(item, Abs(iter_dir_)));
      builder_.AddItem(std::move(item));
    }
    cp.facts = Facts();
    return builder_.Take();
  }

 private:
  // Symlinks are not followed (a symlinked rank directory or file is "missing").
  const SourceTree& tree() const { return builder_.tree(); }
  std::string Rel(const std::string& p) const { return iter_dir_.empty() || p.empty() ? iter_dir_ + p : iter_dir_ + "/" + p; }
  std::string Abs(const std::string& p) const {
    const std::string rel = Rel(p);
    return rel.empty() ? builder_.dir() : builder_.dir() + "/" + rel;
  }

  // The tracker names the iteration directory; without one the directory is it.
  Status FindIteration() {
    if (!tree().IsFile(kTracker)) return Status::Ok();
    UCPFS_ASSIGN_OR_RETURN(const uint32_t id, builder_.AddFile(std::string(kTracker)));
    const ByteSource& src = *builder_.source(id);
    if (src.Size() > kMaxTrackerBytes) {
      return CorruptError(src.Name() + ": " + std::to_string(src.Size()) + " bytes, not an iteration number");
    }
    std::string text(src.Size(), '\0');
    UCPFS_RETURN_IF_ERROR(src.ReadAt(0, std::as_writable_bytes(std::span(text.data(), text.size()))));
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back())) != 0) text.pop_back();
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front())) != 0) text.erase(0, 1);
    const bool digits = !text.empty() && text.size() <= 12 &&
                        std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (text == "release") {
      iter_dir_ = "release";
    } else if (digits) {
      iter_dir_ = "iter_" + Pad(std::stoll(text), 7);
    } else {
      return CorruptError(src.Name() + ": '" + text.substr(0, 32) + "' is neither an iteration number nor 'release'");
    }
    iteration_ = text;
    if (!tree().IsDirectory(Rel(""))) {
      return CorruptError(src.Name() + ": names iteration " + text + ", but " + Abs("") +
                          " is not a directory (missing, or a symlink)");
    }
    return Status::Ok();
  }

  // One rank's model tensors and optimizer state, placed in the global tensors.
  Status ScanRank(int t, int s) {
    const std::string rel = RankDir(t, s, args_.pp) + "/" + std::string(kModelFile);
    if (!tree().IsFile(Rel(rel))) {
      return CorruptError(Abs(rel) + ": missing (or not a regular file) for tp rank " + std::to_string(t) +
                          ", pipeline stage " + std::to_string(s));
    }
    UCPFS_ASSIGN_OR_RETURN(const uint32_t id, builder_.AddFile(Rel(rel)));
    UCPFS_ASSIGN_OR_RETURN(format::TorchFile tf, builder_.OpenTorchFile(id));
    const std::string where = builder_.source(id)->Name();
    UCPFS_RETURN_IF_ERROR(CheckSameArgs(tf, where));
    const pickle::PickleGraph& g = tf.graph();
    if (!IsNone(g, Get(g, g.root(), "model0"))) {
      return UnsupportedError(where + ": model chunks model0, model1, ... (a virtual pipeline) are not supported");
    }
    if (Pairs(g, Get(g, g.root(), "model")).empty()) return CorruptError(where + ": no 'model' state dict");

    int64_t first_layer = 0;
    for (int i = 0; i < s; ++i) first_layer += stage_layers_[static_cast<size_t>(i)];
    const int64_t n_layers = stage_layers_[static_cast<size_t>(s)];
    const bool last_copy_of_tied = args_.tied && args_.pp > 1 && s == args_.pp - 1;

    // Model tensors, in state-dict order: (global name, record).
    std::vector<std::pair<std::string, const format::TensorRecord*>> params;
    std::set<std::string> skip;  // the tied copy: its optimizer state is skipped too
    int64_t max_local_layer = -1;
    constexpr std::string_view kModel = "model.";
    for (const format::TensorRecord& rec : tf.tensors()) {
      if (rec.key.rfind(kModel, 0) != 0) continue;
      std::string name = rec.key.substr(kModel.size());
      if (name.find("_extra_state") != std::string::npos) continue;  // Transformer Engine metadata
      if (auto at = LayerNumberAt(name)) {
        const int64_t local = std::stoll(name.substr(at->first, at->second - at->first));
        if (local >= n_layers) {
          return CorruptError(where + ": " + rec.key + ": layer " + std::to_string(local) + " of a stage with " +
                              std::to_string(n_layers) + " layers (args.num_layers " +
                              std::to_string(args_.num_layers) + ", pp " + std::to_string(args_.pp) + ")");
        }
        max_local_layer = std::max(max_local_layer, local);
        name = name.substr(0, at->first) + std::to_string(local + first_layer) + name.substr(at->second);
      }
      if (last_copy_of_tied && s > 0 && name == "output_layer.weight") skip.insert(name);
      params.emplace_back(std::move(name), &rec);
    }
    if (n_layers > 0 && max_local_layer + 1 != n_layers) {
      return CorruptError(where + ": the stage holds layers 0.." + std::to_string(max_local_layer) + ", args give it " +
                          std::to_string(n_layers));
    }
    for (const auto& [name, rec] : params) {
      if (skip.count(name) != 0) continue;
      UCPFS_ASSIGN_OR_RETURN(std::optional<Item> item, PlacedTensor(name, *rec, id, t, name, where));
      if (item) UCPFS_RETURN_IF_ERROR(Merge(std::move(*item), t, where));
    }
    if (args_.distributed_optimizer) return DistributedOptimizerState(tf, t, s, params, skip, where);
    return OptimizerState(tf, id, t, params, skip, where);
  }

  Status CheckSameArgs(const format::TorchFile& tf, const std::string& where) const {
    UCPFS_ASSIGN_OR_RETURN(const Args a, ReadArgs(tf, where));
    if (a.tp != args_.tp || a.pp != args_.pp || a.num_layers != args_.num_layers || a.hidden_size != args_.hidden_size ||
        a.heads != args_.heads || a.query_groups != args_.query_groups || a.padded_vocab != args_.padded_vocab ||
        a.swiglu != args_.swiglu || a.tied != args_.tied || a.distributed_optimizer != args_.distributed_optimizer) {
      return CorruptError(where + ": its args (tp, pp, layers, sizes, vocabulary, swiglu, tied embeddings or optimizer) "
                          "differ from rank 0's");
    }
    return Status::Ok();
  }

  // Where tp rank t's stored tensor `name` of shape `local` lies in the global tensor.
  Result<Placement> Place(const std::string& name, const std::vector<int64_t>& local, int t,
                          const std::string& where) const {
    Placement pl;
    pl.global_shape = local;
    layout::ModelInfo info = ModelFacts();
    info.vocab_size = 0;  // the stored rows, padding included, are the global tensor
    auto pattern = layout::PatternFor(layout::Preset::kMegatron, name, local, info);
    if (!pattern.ok()) {
      if (pattern.error().code() != StatusCode::kNotFound) return pattern.error().WithContext(where);
      pattern = layout::PatternFromGeometry(local, std::nullopt);  // not a Megatron name: replicated
    }
    if (pattern->tp == layout::TpKind::kReplicate || pattern->tp == layout::TpKind::kPartial || args_.tp == 1) {
      pl.skip = t != 0;
      pl.skip_holds_copy = pattern->tp != layout::TpKind::kPartial;
      return pl;
    }
    const auto d = static_cast<size_t>(pattern->tp_dim);
    if (d >= local.size()) return CorruptError(where + ": " + name + " of shape " + JoinInts(local) + " has no dim to split");
    const std::optional<uint64_t> global = CheckedMul(static_cast<uint64_t>(local[d]), static_cast<uint64_t>(args_.tp));
    if (!global || *global > (uint64_t{1} << 48)) return CorruptError(where + ": " + name + ": the global size overflows");
    pl.global_shape[d] = static_cast<int64_t>(*global);
    if (pattern->tp == layout::TpKind::kVocab && pl.global_shape[0] != args_.padded_vocab) {
      return CorruptError(where + ": " + name + " has " + std::to_string(local[0]) + " rows per tp rank, " +
                          std::to_string(pl.global_shape[0]) + " in all; args.padded_vocab_size is " +
                          std::to_string(args_.padded_vocab));
    }
    UCPFS_ASSIGN_OR_RETURN(layout::ParamPattern global_pattern,
                           layout::PatternFor(layout::Preset::kMegatron, name, pl.global_shape, info));
    global_pattern.vocab_pad_multiple = 0;  // the stored padding is part of the global tensor
    layout::Layout lay;
    lay.tp = args_.tp;
    layout::RankCoords coords;
    coords.tp = t;
    auto view = layout::TargetSlice(layout::Preset::kMegatron, name, global_pattern, pl.global_shape, lay,
                                    {0, static_cast<int>(args_.num_layers)}, coords);
    if (!view.ok()) return view.error().WithContext(where);
    if (view->local_shape != local || (view->pieces.size() > 1 && view->cat_dim != 0)) {
      return CorruptError(where + ": " + name + " of shape " + JoinInts(local) +
                          " is not a tp slice of the global tensor its pattern gives (local shape " +
                          JoinInts(view->local_shape) + ")");
    }
    pl.pieces = view->pieces;
    return pl;
  }

  // A stored tensor of tp rank t as (part of) the global item `key` of parameter `name`;
  // nullopt for a replica that is not read (kept in Checkpoint::replicas for `ucpfs verify`).
  Result<std::optional<Item>> PlacedTensor(const std::string& name, const format::TensorRecord& rec, uint32_t file_id,
                                           int t, const std::string& key, const std::string& where) {
    UCPFS_ASSIGN_OR_RETURN(Placement pl, Place(name, rec.shape, t, where));
    const bool replica = pl.skip;
    if (replica && !pl.skip_holds_copy) return std::optional<Item>();  // partial values: nothing to compare
    pl.skip = false;
    UCPFS_ASSIGN_OR_RETURN(Item item, PlacedItem(pl, key, rec, file_id, where));
    if (replica) {
      builder_.AddReplica(std::move(item));
      return std::optional<Item>();
    }
    return std::optional<Item>(std::move(item));
  }

  Status Merge(Item item, int t, const std::string& where) { return merged_.Add(std::move(item), t, where); }

  // The non-distributed optimizer's state: positions matched to parameters (megatron_scan.h).
  Status OptimizerState(const format::TorchFile& tf, uint32_t file_id, int t,
                        const std::vector<std::pair<std::string, const format::TensorRecord*>>& params,
                        const std::set<std::string>& skip, const std::string& where) {
    const pickle::PickleGraph& g = tf.graph();
    const pickle::NodeId opt = Get(g, g.root(), "optimizer");
    if (IsNone(g, opt)) return Status::Ok();  // saved with --no-save-optim
    if (g.kind(opt) == pickle::Kind::kList) {
      return UnsupportedError(where + ": the optimizer is a ChainedOptimizer of " +
                              std::to_string(g.items(opt).size()) + " optimizers");
    }
    // Float16OptimizerWithFloat16Params: {optimizer: torch.optim state dict, fp32_from_fp16_params,
    // grad_scaler}; FP32Optimizer: the torch.optim state dict itself.
    pickle::NodeId inner = Get(g, opt, "optimizer");
    std::string prefix = "optimizer.optimizer.";
    const bool float16 = !IsNone(g, inner);
    if (!float16) {
      inner = opt;
      prefix = "optimizer.";
    }
    const pickle::NodeId groups = Get(g, inner, "param_groups");
    if (g.kind(groups) != pickle::Kind::kList) return CorruptError(where + ": optimizer param_groups is not a list");
    std::map<std::string, const format::TensorRecord*> by_key;
    for (const format::TensorRecord& rec : tf.tensors()) by_key.emplace(rec.key, &rec);

    // Each group's class: weight decay on or off (and not an expert group).
    std::set<bool> classes;
    for (size_t gi = 0; gi < g.items(groups).size(); ++gi) {
      const pickle::NodeId group = g.items(groups)[gi];
      const std::string gw = where + ": optimizer param_groups[" + std::to_string(gi) + "]";
      const std::optional<double> wd_mult = NumberOf(g, Get(g, group, "wd_mult"));
      if (!wd_mult) return UnsupportedError(gw + " has no wd_mult (Megatron-Core < 0.5 param groups are not read)");
      if (Truthy(g, Get(g, group, "is_expert_parallel"))) return UnsupportedError(gw + " is an expert-parallel group");
      const std::optional<double> lr_mult = NumberOf(g, Get(g, group, "lr_mult"));
      if (!classes.insert(*wd_mult == 0.0).second || (lr_mult && *lr_mult != 1.0)) {
        return UnsupportedError(gw + ": param groups that differ by more than weight decay (lr_mult, decoupled_lr) "
                                     "cannot be matched to parameters");
      }
    }
    size_t matched = 0;
    for (size_t gi = 0; gi < g.items(groups).size(); ++gi) {
      const pickle::NodeId group = g.items(groups)[gi];
      const std::string gk = std::to_string(gi);
      const bool no_wd = *NumberOf(g, Get(g, group, "wd_mult")) == 0.0;
      const pickle::NodeId positions = Get(g, group, "params");
      if (g.kind(positions) != pickle::Kind::kList) {
        return CorruptError(where + ": optimizer param_groups[" + gk + "].params is not a list");
      }
      // The group's parameters, in model order, as Megatron's _get_param_groups picks them.
      std::vector<size_t> members;
      for (size_t pi = 0; pi < params.size(); ++pi) {
        const bool off = MegatronNoWeightDecay(params[pi].first, params[pi].second->shape.size(), args_.wd_on_qk_layernorm);
        if (off == no_wd) members.push_back(pi);
      }
      if (members.size() != g.items(positions).size()) {
        return UnsupportedError(where + ": optimizer param_groups[" + gk + "] holds " +
                                std::to_string(g.items(positions).size()) + " parameters; the model has " +
                                std::to_string(members.size()) + (no_wd ? " without" : " with") +
                                " weight decay (frozen parameters or other param-group rules?)");
      }
      matched += members.size();
      size_t master = 0;  // position in fp32_from_fp16_params[gi]
      for (size_t j = 0; j < members.size(); ++j) {
        const auto& [name, weight] = params[members[j]];
        const std::optional<int64_t> pos = IntOf(g, g.items(positions)[j]);
        if (!pos || *pos < 0) return CorruptError(where + ": optimizer param_groups[" + gk + "].params holds a non-index");
        const bool half = weight->dtype == DType::kBFloat16 || weight->dtype == DType::kFloat16;
        std::vector<std::pair<std::string, std::string>> states = {
            {prefix + "state." + std::to_string(*pos) + ".exp_avg", ".exp_avg"},
            {prefix + "state." + std::to_string(*pos) + ".exp_avg_sq", ".exp_avg_sq"}};
        if (float16 && half) {
          states.emplace_back("optimizer.fp32_from_fp16_params." + gk + "." + std::to_string(master++), ".fp32_param");
        }
        for (const auto& [source_key, suffix] : states) {
          auto rec = by_key.find(source_key);
          if (rec == by_key.end()) {
            return CorruptError(where + ": no " + source_key + " (the " + suffix.substr(1) + " of '" + name + "')");
          }
          if (rec->second->shape != weight->shape) {
            return CorruptError(where + ": " + source_key + " has shape " + JoinInts(rec->second->shape) + ", '" + name +
                                "' " + JoinInts(weight->shape));
          }
          if (skip.count(name) != 0) continue;
          UCPFS_ASSIGN_OR_RETURN(std::optional<Item> item,
                                 PlacedTensor(name, *rec->second, file_id, t, "optimizer.state." + name + suffix, where));
          if (item) UCPFS_RETURN_IF_ERROR(Merge(std::move(*item), t, where));
        }
        auto step = by_key.find(prefix + "state." + std::to_string(*pos) + ".step");
        if (step != by_key.end() && step->second->n_elems == 1 && skip.count(name) == 0) {
          Item item;
          item.key = "optimizer.state." + name + ".step";
          item.dtype = step->second->dtype;
          slice::Fragment f;
          f.flat_lo = 0;
          f.flat_hi = 1;
          f.file_id = file_id;
          f.byte_offset = step->second->data_offset;
          f.dtype = step->second->dtype;
          item.layout.fragments.push_back(std::move(f));
          UCPFS_RETURN_IF_ERROR(Merge(std::move(item), t, where));
        }
      }
    }
    if (matched != params.size()) {
      return UnsupportedError(where + ": the optimizer's param groups hold " + std::to_string(matched) +
                              " parameters, the model " + std::to_string(params.size()));
    }
    return Status::Ok();
  }

  // The distributed optimizer's state (megatron_scan.h): distrib_optim.pt beside the rank's
  // model_optim_rng.pt holds, per grad buffer and dtype, the fp32 masters and Adam moments of
  // every parameter of the buffer as flat "world" tensors: the concatenation of the buffer's
  // buckets, each cut at its numel_unpadded (the padding at a bucket's end stripped, the padding
  // before each parameter kept). The parameters' places in it are Megatron-Core's grad-buffer
  // layout, rebuilt here from the model's tensors and the args; every size is checked.
  Status DistributedOptimizerState(const format::TorchFile& tf, int t, int s,
                                   const std::vector<std::pair<std::string, const format::TensorRecord*>>& params,
                                   const std::set<std::string>& skip, const std::string& where) {
    const pickle::PickleGraph& g = tf.graph();
    const pickle::NodeId opt = Get(g, g.root(), "optimizer");
    if (IsNone(g, opt)) return Status::Ok();  // saved with --no-save-optim: no distrib_optim.pt either
    if (g.kind(opt) == pickle::Kind::kList) {
      return UnsupportedError(where + ": the optimizer is a ChainedOptimizer of " +
                              std::to_string(g.items(opt).size()) + " optimizers");
    }
    auto refuse = [](const std::string& file, const std::string& why) {
      return UnsupportedError(file + ": " + why + " is not supported with the distributed optimizer");
    };
    if (args_.context_parallel_size > 1) return refuse(where, "context parallelism (args.context_parallel_size)");
    if (args_.distopt_instances > 1) return refuse(where, "several optimizer instances (num_distributed_optimizer_instances)");
    if (args_.mtp_layers > 0) return refuse(where, "multi-token prediction (args.mtp_num_layers)");
    if (!args_.other_data_parallel.empty()) return refuse(where, "args." + args_.other_data_parallel);
    if (args_.overlap_grad_reduce && args_.ddp_num_buckets > 0) return refuse(where, "args.ddp_num_buckets");

    // DistributedOptimizer.state_dict(): {optimizer: {param_groups (no params), ...}, grad_scaler};
    // each group's step (Megatron keeps one step for all).
    const pickle::NodeId groups = Get(g, Get(g, opt, "optimizer"), "param_groups");
    if (g.kind(groups) != pickle::Kind::kList) {
      return CorruptError(where + ": optimizer.optimizer.param_groups (DistributedOptimizer.state_dict) is not a list");
    }
    std::optional<double> step;
    for (const pickle::NodeId group : g.items(groups)) {
      const std::optional<double> v = NumberOf(g, Get(g, group, "step"));
      if (!v) continue;
      if (step && *step != *v) return CorruptError(where + ": the optimizer's param groups record different steps");
      step = v;
    }
    if (step && distopt_step_ && *step != *distopt_step_) {
      return CorruptError(where + ": the optimizer's step differs from another rank's");
    }
    if (step) distopt_step_ = step;

    // The buffer's dtypes: Megatron-Core keeps one grad buffer per (param dtype, grad dtype).
    const DType param_dtype = params.empty() ? DType::kBFloat16 : params.front().second->dtype;
    for (const auto& [name, rec] : params) {
      if (rec->dtype != param_dtype) {
        return refuse(where, "a model with parameters of several dtypes ('" + params.front().first + "' " +
                                 std::string(TorchName(param_dtype)) + ", '" + name + "' " +
                                 std::string(TorchName(rec->dtype)) + ": Megatron-Core's get_parameter_state_dp_zero "
                                 "pairs such parameters with other parameters' states)");
      }
    }

    const std::string rel = RankDir(t, s, args_.pp) + "/distrib_optim.pt";
    if (!tree().IsFile(Rel(rel))) {
      return CorruptError(Abs(rel) + ": missing (or not a regular file); args.use_distributed_optimizer is set and " +
                          where + " holds an optimizer");
    }
    UCPFS_ASSIGN_OR_RETURN(const uint32_t id, builder_.AddFile(Rel(rel)));
    UCPFS_ASSIGN_OR_RETURN(format::TorchFile of, builder_.OpenTorchFile(id));
    const std::string file = builder_.source(id)->Name();
    const pickle::PickleGraph& og = of.graph();
    const pickle::NodeId root = og.root();
    if (og.kind(root) == pickle::Kind::kList) {
      return refuse(file, "a list of parameter states (a ChainedOptimizer of several optimizers)");
    }
    if (og.kind(root) != pickle::Kind::kDict) return CorruptError(file + ": not a dict of grad buffers");
    if (!Truthy(og, Get(og, root, "buckets_coalesced"))) {
      return refuse(file, "per-bucket state lists without 'buckets_coalesced' (Megatron-Core < 0.7)");
    }
    pickle::NodeId buffer = pickle::kNoNode;
    for (const auto& [k, v] : og.dict_items(root)) {
      if (og.kind(k) == pickle::Kind::kString && og.text(k) == "buckets_coalesced") continue;
      const std::optional<int64_t> index = IntOf(og, k);
      if (!index) return CorruptError(file + ": a key that is neither a grad buffer index nor 'buckets_coalesced'");
      if (*index != 0) {
        return refuse(file, "grad buffer " + std::to_string(*index) +
                                " (several buffers: parameters of several dtypes, expert or virtual-pipeline chunks)");
      }
      buffer = v;
    }
    if (og.kind(buffer) != pickle::Kind::kDict || og.dict_items(buffer).size() != 1) {
      return CorruptError(file + ": grad buffer 0 is missing or does not hold exactly one dtype entry");
    }
    const auto& [dtype_key, state] = og.dict_items(buffer).front();
    UCPFS_RETURN_IF_ERROR(CheckBufferDtypes(og, dtype_key, param_dtype, file));

    std::optional<int64_t> numel_unpadded = IntOf(og, Get(og, state, "numel_unpadded"));
    if (!numel_unpadded || *numel_unpadded < 0) {
      return CorruptError(file + ": grad buffer 0 has no numel_unpadded (a non-negative int)");
    }
    struct World {
      const char* name;
      const char* suffix;
      format::TensorRecord rec;
    };
    std::vector<World> worlds = {{"param", ".fp32_param", {}}, {"exp_avg", ".exp_avg", {}},
                                 {"exp_avg_sq", ".exp_avg_sq", {}}};
    for (World& w : worlds) {
      const pickle::NodeId n = Get(og, state, w.name);
      if (og.kind(n) != pickle::Kind::kTensor) return CorruptError(file + ": grad buffer 0 has no tensor '" + w.name + "'");
      UCPFS_ASSIGN_OR_RETURN(w.rec, format::ResolveTensor(of.source(), of.archive(), og, n, std::string("0.") + w.name));
      if (w.rec.dtype != DType::kFloat32 || w.rec.shape.size() != 1 || !w.rec.contiguous ||
          w.rec.shape[0] != *numel_unpadded) {
        return CorruptError(file + ": '" + w.name + "' of grad buffer 0 is " + std::string(TorchName(w.rec.dtype)) + " " +
                            JoinInts(w.rec.shape) + (w.rec.contiguous ? "" : " (not contiguous)") +
                            ", not a contiguous float32 vector of numel_unpadded " + std::to_string(*numel_unpadded));
      }
    }

    UCPFS_ASSIGN_OR_RETURN(const std::vector<uint64_t> offsets, BufferOffsets(params, s, *numel_unpadded, file));
    const bool half = param_dtype == DType::kBFloat16 || param_dtype == DType::kFloat16;
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& [name, rec] = params[i];
      if (skip.count(name) != 0) continue;
      UCPFS_ASSIGN_OR_RETURN(const Placement pl, Place(name, rec->shape, t, where));
      if (pl.skip) continue;
      for (const World& w : worlds) {
        if (!half && std::string_view(w.name) == "param") continue;  // an fp32 parameter is its own master
        Item item;
        item.key = "optimizer.state." + name + w.suffix;
        item.dtype = DType::kFloat32;
        item.layout.shape = pl.global_shape;
        PlaceRange(pl, 0, rec->n_elems, id, w.rec.data_offset + offsets[i] * sizeof(float), DType::kFloat32,
                   &item.layout.fragments);
        UCPFS_RETURN_IF_ERROR(Merge(std::move(item), t, file));
      }
    }
    return Status::Ok();
  }

  // The dtype key of grad buffer 0: (param dtype, grad dtype) as Megatron-Core >= 0.7 writes it,
  // each a pickled torch.<dtype>; the param dtype must be the model's, the grad dtype fp32 or
  // the param dtype as args.accumulate_allreduce_grads_in_fp32 says.
  Status CheckBufferDtypes(const pickle::PickleGraph& og, pickle::NodeId key, DType param_dtype,
                           const std::string& file) const {
    auto dtype_of = [&](pickle::NodeId n) -> std::optional<DType> {
      if (og.kind(n) != pickle::Kind::kGlobal || og.module(n) != "torch") return std::nullopt;
      return DTypeFromTorchName(og.name(n));
    };
    if (og.kind(key) != pickle::Kind::kTuple || og.items(key).size() != 2) {
      return UnsupportedError(file + ": grad buffer 0 is keyed by something other than (param dtype, grad dtype) "
                                     "(Megatron-Core < 0.7 keyed it by one dtype)");
    }
    const std::optional<DType> p = dtype_of(og.items(key)[0]), gd = dtype_of(og.items(key)[1]);
    if (!p || !gd) return CorruptError(file + ": grad buffer 0's key is not a pair of torch dtypes");
    if (*p != param_dtype) {
      return CorruptError(file + ": grad buffer 0 holds " + std::string(TorchName(*p)) + " parameters, the model's are " +
                          std::string(TorchName(param_dtype)));
    }
    const bool fp32_grads = *gd == DType::kFloat32;
    if ((!fp32_grads && *gd != param_dtype) || (args_.grads_in_fp32 && *args_.grads_in_fp32 != fp32_grads)) {
      return CorruptError(file + ": grad buffer 0's grad dtype " + std::string(TorchName(*gd)) +
                          " is not what args.accumulate_allreduce_grads_in_fp32 gives");
    }
    return Status::Ok();
  }

  // Where each of the stage's parameters (model order) starts in the world tensors, by
  // Megatron-Core's _ParamAndGradBuffer layout (0.8 and later, unchanged through 0.19):
  // parameters in reverse model order; each starts at a multiple of 64 elements; a bucket closes
  // once it holds >= bucket_size elements, and a tied embedding's copy on the first or last
  // pipeline stage (shared_embedding) gets a bucket of its own; a bucket's end is padded (to
  // lcm(dp, 128) elements), and that padding is what the world tensors strip. Bucket starts are
  // thus multiples of 128, so padding a start to 64 relative to its bucket or to the buffer is
  // the same, and the layout of the world tensors does not depend on dp.
  // bucket_size: Megatron-LM's get_model: none unless overlap_grad_reduce; else ddp_bucket_size,
  // or max(40M, 1M * dp * cp); DistributedDataParallel: none past the first pipeline stage or
  // with overlap_param_gather_with_optimizer_step (disable_bucketing).
  Result<std::vector<uint64_t>> BufferOffsets(const std::vector<std::pair<std::string, const format::TensorRecord*>>& params,
                                              int s, int64_t numel_unpadded, const std::string& file) const {
    std::optional<uint64_t> bucket_size;
    if (args_.overlap_grad_reduce && s == 0 && !args_.overlap_param_gather_with_optimizer_step) {
      bucket_size = args_.ddp_bucket_size > 0
                        ? static_cast<uint64_t>(args_.ddp_bucket_size)
                        : std::max<uint64_t>(40000000, uint64_t{1000000} * static_cast<uint64_t>(args_.data_parallel_size *
                                                                                               args_.context_parallel_size));
    }
    std::string shared;  // the shared_embedding parameter of this stage
    if (args_.pp > 1 && args_.tied) shared = s == 0 ? "embedding.word_embeddings.weight" : s == args_.pp - 1 ? "output_layer.weight" : "";
    auto pad = [](uint64_t v, uint64_t m) { return (v + m - 1) / m * m; };
    std::vector<uint64_t> offsets(params.size(), 0);
    uint64_t start = 0, bucket_start = 0, world_before = 0, end = 0;  // buffer indices; world_before: earlier buckets
    size_t in_bucket = 0;
    auto close = [&](uint64_t bucket_end) {
      world_before += bucket_end - bucket_start;
      bucket_start = pad(bucket_end, 128);  // lcm(dp, 128) in Megatron; only a multiple of 128 matters here
      in_bucket = 0;
      return bucket_start;
    };
    for (size_t k = params.size(); k-- > 0;) {
      const auto& [name, rec] = params[k];
      const bool own_bucket = !shared.empty() && name == shared;
      start = pad(start, 64);
      if (own_bucket && in_bucket > 0) start = close(start);
      offsets[k] = world_before + (start - bucket_start);
      end = start + rec->n_elems;
      if (end > (uint64_t{1} << 50)) return CorruptError(file + ": the model's parameters overflow a grad buffer");
      ++in_bucket;
      start = (bucket_size && end - bucket_start >= *bucket_size) || own_bucket ? close(end) : end;
    }
    if (in_bucket > 0) close(end);
    if (world_before != static_cast<uint64_t>(numel_unpadded)) {
      return CorruptError(file + ": numel_unpadded is " + std::to_string(numel_unpadded) + ", but the stage's " +
                          std::to_string(params.size()) + " parameters in Megatron-Core's grad-buffer layout take " +
                          std::to_string(world_before) + " elements (bucket size " +
                          (bucket_size ? std::to_string(*bucket_size) : std::string("none")) +
                          "; a model, bucket setting or Megatron-Core version this layout does not describe)");
    }
    return offsets;
  }

  layout::ModelInfo ModelFacts() const {
    layout::ModelInfo info = ModelInfoOf(Facts());
    info.tied_embeddings = args_.tied;
    return info;
  }

  // What the views need beyond items (megatron_scan.h MegatronModelFacts, MegatronOptimizerStep).
  MegatronSourceFacts Facts() const {
    MegatronSourceFacts info;
    if (!iteration_.empty()) info.iteration = iteration_;
    info.dir = iter_dir_;
    info.tp = args_.tp;
    info.pp = args_.pp;
    info.num_layers = args_.num_layers;
    info.hidden_size = args_.hidden_size;
    info.num_attention_heads = args_.heads;
    info.num_query_groups = args_.query_groups;
    info.kv_channels = args_.kv_channels;
    info.swiglu = args_.swiglu;
    info.tied_embeddings = args_.tied;
    info.padded_vocab_size = args_.padded_vocab;
    if (args_.vocab > 0) info.vocab_size = args_.vocab;
    info.make_vocab_size_divisible_by = args_.divisible_by;
    info.distributed_optimizer = args_.distributed_optimizer;
    info.checkpoint_version = args_.version;
    // The distributed optimizer's step (its param groups'), which distrib_optim.pt does not hold.
    info.optimizer_step = distopt_step_;
    info.args = decoded_args_;
    return info;
  }

  CheckpointBuilder builder_;
  std::string iteration_;  // the tracker's text, or "" without a tracker
  std::string iter_dir_;   // relative to the directory ("" when the directory is it)
  Args args_;
  std::vector<int64_t> stage_layers_;
  std::optional<double> distopt_step_;  // the distributed optimizer's param groups' step
  std::optional<MegatronCoreArgs> decoded_args_;  // rank 0's args as DecodeMegatronArgs reads them
  TpSliceMerger merged_{/*repeat_is_error=*/true};  // tied copies of later stages are skipped before Merge
};

}  // namespace

bool IsMegatronLegacyDirectory(const SourceTree& tree) {
  if (tree.IsFile(kTracker)) return true;
  for (const std::string& d : {RankDir(0, 0, 1), RankDir(0, 0, 2)}) {
    if (tree.IsDirectory(d) && tree.IsFile(d + "/" + std::string(kModelFile))) return true;
  }
  return false;
}

Result<Checkpoint> ScanMegatronLegacy(const SourceTree& tree, const ScanProgress& progress) {
  return MegatronScanner(tree).Run(progress);
}

Result<layout::ModelInfo> MegatronModelFacts(const Checkpoint& c) {
  const MegatronSourceFacts* info = std::get_if<MegatronSourceFacts>(&c.facts);
  return info == nullptr ? layout::ModelInfo() : ModelInfoOf(*info);
}

int64_t MegatronTokenizerVocab(int64_t args_vocab_size, std::string_view tokenizer_type) {
  return args_vocab_size > 0 && tokenizer_type == "NullTokenizer" ? args_vocab_size + 1 : args_vocab_size;
}

nlohmann::json MegatronArchitectureArgs(const pickle::PickleGraph& g, pickle::NodeId args) {
  static constexpr const char* kNames[] = {
      "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
      "group_query_attention", "kv_channels", "swiglu", "normalization", "norm_epsilon", "layernorm_epsilon",
      "apply_layernorm_1p", "position_embedding_type", "use_rotary_position_embeddings", "rotary_base",
      "rotary_percent", "rotary_interleaved", "use_rope_scaling", "rotary_seq_len_interpolation_factor",
      "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
      "max_position_embeddings", "seq_length", "bf16", "fp16", "params_dtype", "tokenizer_type",
      "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "multi_latent_attention", "squared_relu",
      "openai_gelu", "attention_softmax_in_fp32",
      // Megatron-DeepSpeed's names for the rotary base and learned positions
      "rope_theta", "add_position_embedding",
      // what makes a mixture of experts Mixtral's or not (views/hf_megatron.cc)
      "moe_layer_freq", "moe_shared_expert_intermediate_size", "moe_router_pre_softmax", "moe_router_score_function",
      "moe_router_topk_scaling_factor", "moe_expert_capacity_factor", "moe_router_num_groups",
      "moe_router_enable_expert_bias", "moe_grouped_gemm"};
  nlohmann::json out = nlohmann::json::object();
  for (const char* name : kNames) {
    const pickle::NodeId v = Get(g, args, name);
    switch (g.kind(v)) {
      case pickle::Kind::kBool: out[name] = g.bool_value(v); break;
      case pickle::Kind::kInt: out[name] = g.int_value(v); break;
      case pickle::Kind::kFloat: out[name] = g.float_value(v); break;
      case pickle::Kind::kString:
        if (g.text(v).size() <= 256) out[name] = std::string(g.text(v));
        break;
      case pickle::Kind::kGlobal:  // torch.float32 and the like
        if (g.module(v) == "torch" && g.name(v).size() <= 64) out[name] = "torch." + std::string(g.name(v));
        break;
      default: break;
    }
  }
  return out;
}

std::optional<MegatronCoreArgs> DecodeMegatronArgs(const pickle::PickleGraph& g, pickle::NodeId args) {
  MegatronCoreArgs known;
  known.apply_wd_to_qk_layernorm = Truthy(g, Get(g, args, "apply_wd_to_qk_layernorm"));
  bool any = known.apply_wd_to_qk_layernorm;
  auto positive = [&](const char* name, std::optional<int64_t>* into) {
    const pickle::NodeId v = Get(g, args, name);
    if (g.kind(v) == pickle::Kind::kInt && g.int_value(v) > 0) *into = g.int_value(v);
    any |= into->has_value();
  };
  positive("vocab_size", &known.vocab_size);
  positive("make_vocab_size_divisible_by", &known.make_vocab_size_divisible_by);
  positive("padded_vocab_size", &known.padded_vocab_size);
  positive("num_attention_heads", &known.num_attention_heads);
  positive("kv_channels", &known.kv_channels);
  if (Truthy(g, Get(g, args, "group_query_attention"))) {
    positive("num_query_groups", &known.num_query_groups);
  } else {
    positive("num_key_value_heads", &known.num_query_groups);
  }
  if (const pickle::NodeId t = Get(g, args, "tokenizer_type"); known.vocab_size && g.kind(t) == pickle::Kind::kString) {
    known.vocab_size = MegatronTokenizerVocab(*known.vocab_size, g.text(t));
  }
  known.architecture = MegatronArchitectureArgs(g, args);
  any |= !known.architecture.empty();
  if (!any) return std::nullopt;
  return known;
}

bool MegatronNoWeightDecay(const std::string& name, size_t n_dims, bool wd_on_qk_layernorm) {
  const bool bias_or_1d = name.ends_with(".bias") || n_dims == 1;
  const bool qk_norm = name.find("q_layernorm.") != std::string::npos || name.find("k_layernorm.") != std::string::npos;
  return bias_or_1d && !(wd_on_qk_layernorm && qk_norm);
}

std::optional<double> MegatronOptimizerStep(const Checkpoint& c) {
  const MegatronSourceFacts* info = std::get_if<MegatronSourceFacts>(&c.facts);
  return info == nullptr ? std::nullopt : info->optimizer_step;
}

}  // namespace ucpfs::index
