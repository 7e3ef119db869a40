// target: `target/<layout>/rank_<N>/{model.pt,model.safetensors,optim.pt,extra_state.pt,
// ucp_info.json}` (views/target.h plans and builds the files): the --layout views when the
// namespace is built, any other valid layout name when it is first looked up (the mount's
// dynamic directory), within a memory budget shared by the layouts built on lookup; a refused
// lookup is remembered with its reason (`target/<layout>.error`, status.json "target_refused",
// stats.json "lookup_layouts"). For every checkpoint of a run: the --layout views only.
#include <algorithm>
#include <array>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/json_text.h"
#include "fs/namespace.h"
#include "views/target.h"
#include "views/view_inputs.h"
#include "views/view_kind.h"

namespace ucpfs::views {
namespace {

using fs::FixedSource;
using fs::Ino;
using fs::kRootIno;
using fs::Opener;
using fs::SubtreeLister;
using fs::SubtreeResolver;
using fs::Tree;

constexpr size_t kMaxListedLookupLayouts = 32;
// Layouts built on lookup have at most this many ranks (a rank costs about half a millisecond to
// plan and add, so a lookup answers within a few seconds); larger ones are refused at once and
// can be given with --layout.
constexpr int kMaxLookupWorld = 4096;
// The most recent lookup refusals kept for stats.json (each reason cut to kMaxRefusalBytes).
constexpr size_t kMaxListedRefusals = 8;
constexpr size_t kMaxRefusalBytes = 400;
// target/<layout>.error: why a lookup of target/<layout> was refused (while it is remembered).
constexpr std::string_view kRefusalSuffix = ".error";
// status.json keeps room for the refusals (kMaxListedRefusals of at most kMaxRefusalBytes each,
// their layout names and JSON escapes); refusals that do not fit are left out of it.
constexpr uint64_t kStatusRefusalRoomBytes = 8192;

// The file target/<layout>.error: `why` and a newline. kNotFound when no refusal of `layout`
// is remembered (never refused, or pushed out by newer refusals).
Result<std::shared_ptr<const Tree>> RefusalFile(const std::string& layout, const std::optional<std::string>& why,
                                                struct timespec mtime, const ViewAccess& access) {
  if (!why) return NotFoundError("no refusal of a layout '" + layout + "' is remembered");
  const std::string text = *why + "\n";
  auto src = std::make_shared<MemorySource>(
      "target/" + layout + std::string(kRefusalSuffix),
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  auto tree = std::make_shared<Tree>(Tree::OneFile(src->Size(), mtime, FixedSource(src)));
  UCPFS_RETURN_IF_ERROR(tree->SetAccess(kRootIno, access.mode, access.uid, access.gid));
  return std::shared_ptr<const Tree>(std::move(tree));
}

// The files of one rank of a layout, built again (TargetPlan::Build) when one of them is opened,
// so a layout keeps only its tree (names and sizes), not its ranks' pickles, zip headers, copy
// plans and ucp_info.json: what a layout holds no longer grows with the model, and 64 layouts of
// 512 ranks fit in the daemon's memory bound (issue 12). Rebuilding is deterministic (target.h),
// so the bytes are those whose size the tree advertises; a mismatch is an internal error. Opens
// of one file while an earlier open still holds it share that build.
// fs::BuiltOnOpen does the same for one file; a rank's five files share one holder here, which
// is about half the memory of five of those over 32,768 ranks.
enum class RankFile : uint8_t { kModel = 0, kSafetensors = 1, kOptim = 2, kExtra = 3, kInfo = 4 };

std::shared_ptr<const ByteSource> FileOf(const views::RankFiles& f, RankFile which) {
  switch (which) {
    case RankFile::kModel: return f.model;
    case RankFile::kSafetensors: return f.model_safetensors;
    case RankFile::kOptim: return f.optim;
    case RankFile::kExtra: return f.extra;
    case RankFile::kInfo: return f.info;
  }
  return nullptr;
}

class LazyRankFiles {
 public:
  LazyRankFiles(std::shared_ptr<const views::TargetPlan> plan, int rank) : plan_(std::move(plan)), rank_(rank) {}

  // Errors: TargetPlan::Build's; kInternal when the file is gone or its size changed.
  Result<std::shared_ptr<const ByteSource>> Open(RankFile which, uint64_t n_bytes) const {
    std::lock_guard lock(mu_);
    auto& held = open_[static_cast<size_t>(which)];
    if (auto src = held.lock()) return src;
    views::RankFileSet want{.model = which == RankFile::kModel,
                            .model_safetensors = which == RankFile::kSafetensors,
                            .optim = which == RankFile::kOptim,
                            .extra = which == RankFile::kExtra,
                            .info = which == RankFile::kInfo};
    UCPFS_ASSIGN_OR_RETURN(auto files, plan_->Build(rank_, want));
    UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<const ByteSource> src, fs::CheckBuiltAgain(FileOf(files, which), n_bytes));
    held = src;
    return src;
  }

 private:
  std::shared_ptr<const views::TargetPlan> plan_;
  int rank_;
  mutable std::mutex mu_;
  mutable std::array<std::weak_ptr<const ByteSource>, 5> open_;  // guarded by mu_
};

// Tree bytes per rank of a layout: its directory, each file's node, and its LazyRankFiles (for
// the budget of layouts built on lookup; calibrated with tests/bench/scale_bench.py).
constexpr uint64_t kNodeBytes = 512;
uint64_t RankTreeBytes(const views::RankFiles& f) {
  uint64_t n_files = 0;
  for (RankFile w : {RankFile::kModel, RankFile::kSafetensors, RankFile::kOptim, RankFile::kExtra, RankFile::kInfo}) {
    n_files += FileOf(f, w) != nullptr ? 1 : 0;
  }
  return (1 + n_files) * kNodeBytes + sizeof(LazyRankFiles) + 64;
}

// Adds `rank_<N>/{model.pt,model.safetensors,optim.pt,extra_state.pt,ucp_info.json}` for every
// rank of `plan` under `ldir`, each file sized now and built again on open (LazyRankFiles).
// Rank files depend on (tp, pp, ep) for model.pt and, without ZeRO partitioning, optim.pt; DP
// replicas link to the first such file. Counts the distinct files added in *n_files.
Status AddLayoutRanks(Tree& tree, Ino ldir, std::shared_ptr<const views::TargetPlan> plan, struct timespec mtime,
                      const ViewAccess& access, size_t* n_files) {
  const layout::Layout& l = plan->layout();
  // Replicas alike (TargetPlan::ReplicasAlike): a DP replica's files are sized from its group's
  // first rank without building anything, so a layout of thousands of DP ranks is listed in the
  // time of its distinct ranks plus its tree nodes.
  const bool alike = plan->ReplicasAlike();
  struct Shared {
    Ino first = 0, second = 0, third = 0;  // model.pt, optim.pt, model.safetensors
    Ino refused_safetensors = 0;           // model.safetensors.error, when it cannot be made
    int first_rank = -1, first_dp = 0;     // the group's first rank, built in full
    uint64_t info_bytes = 0, extra_bytes = 0;
    bool has_extra = false;
    // A ZeRO layout's optim.pt: each DP rank's own (its window of the flat states) but of one
    // size, ps elements of each, so sized from the first rank's; 0 when there is none.
    uint64_t zero_optim_bytes = 0;
  };
  std::map<std::tuple<int, int, int>, Shared> shared_files;  // (tp,pp,ep) -> the rank files DP replicas share
  for (int rank = 0; rank < l.World(); ++rank) {
    const auto c = layout::CoordsOf(l, rank);
    auto it = shared_files.try_emplace({c.tp, c.pp, c.ep}).first;
    Shared& shared = it->second;
    const bool sized_from_first = alike && shared.first_rank >= 0;
    // A DP replica links to the files it shares: only its own are built to be sized.
    views::RankFileSet want;
    want.model = want.model_safetensors = shared.first == 0;
    want.optim = shared.first == 0;
    views::RankFiles files_of_rank;  // a replica sized from its first rank builds nothing
    if (!sized_from_first) {
      UCPFS_ASSIGN_OR_RETURN(files_of_rank, plan->Build(rank, want));
    }
    if (shared.first_rank < 0) {
      shared.first_rank = rank;
      shared.first_dp = c.dp;
      shared.info_bytes = files_of_rank.info->Size();
      shared.has_extra = files_of_rank.extra != nullptr;
      if (shared.has_extra) shared.extra_bytes = files_of_rank.extra->Size();
      if (l.zero != 0 && files_of_rank.optim) shared.zero_optim_bytes = files_of_rank.optim->Size();
    }
    UCPFS_ASSIGN_OR_RETURN(Ino rdir, tree.AddDir(ldir, "rank_" + std::to_string(rank), mtime));
    auto lazy = std::make_shared<const LazyRankFiles>(plan, rank);
    auto add = [&](const char* name, RankFile which, Ino* share, std::optional<uint64_t> sized = {}) -> Status {
      if (share != nullptr && *share != 0) return tree.AddLink(rdir, name, *share);
      const uint64_t n_bytes = sized ? *sized : FileOf(files_of_rank, which)->Size();
      Opener open = [lazy, which, n_bytes]() { return lazy->Open(which, n_bytes); };
      UCPFS_ASSIGN_OR_RETURN(Ino ino, tree.AddFile(rdir, name, n_bytes, mtime, std::move(open)));
      UCPFS_RETURN_IF_ERROR(tree.SetAccess(ino, access.mode, access.uid, access.gid));
      if (share != nullptr) *share = ino;
      ++*n_files;
      return Status::Ok();
    };
    UCPFS_RETURN_IF_ERROR(add("model.pt", RankFile::kModel, &shared.first));
    if (files_of_rank.model_safetensors || shared.third != 0) {
      UCPFS_RETURN_IF_ERROR(add("model.safetensors", RankFile::kSafetensors, &shared.third));
    } else if (shared.refused_safetensors != 0) {
      UCPFS_RETURN_IF_ERROR(tree.AddLink(rdir, "model.safetensors.error", shared.refused_safetensors));
    } else if (!files_of_rank.model_safetensors_refused.empty()) {
      // Where safetensors cannot hold the rank's tensors the file is left out, and says why.
      const std::string text = files_of_rank.model_safetensors_refused + "\n";
      auto src = std::make_shared<MemorySource>(
          "target/" + l.name + "/rank_" + std::to_string(rank) + "/model.safetensors.error",
          std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
      UCPFS_ASSIGN_OR_RETURN(shared.refused_safetensors,
                             tree.AddFile(rdir, "model.safetensors.error", src->Size(), mtime, FixedSource(src)));
      UCPFS_RETURN_IF_ERROR(tree.SetAccess(shared.refused_safetensors, access.mode, access.uid, access.gid));
    }
    if (l.zero != 0 && shared.zero_optim_bytes != 0) {
      UCPFS_RETURN_IF_ERROR(add("optim.pt", RankFile::kOptim, nullptr, shared.zero_optim_bytes));
    } else if (files_of_rank.optim || (l.zero == 0 && shared.second != 0)) {
      UCPFS_RETURN_IF_ERROR(add("optim.pt", RankFile::kOptim, &shared.second));
    }
    if (sized_from_first) {
      if (shared.has_extra) UCPFS_RETURN_IF_ERROR(add("extra_state.pt", RankFile::kExtra, nullptr, shared.extra_bytes));
      const uint64_t info_bytes =
          views::TargetPlan::ReplicaInfoBytes(shared.info_bytes, shared.first_rank, shared.first_dp, rank, c.dp);
      UCPFS_RETURN_IF_ERROR(add("ucp_info.json", RankFile::kInfo, nullptr, info_bytes));
      continue;
    }
    if (files_of_rank.extra) UCPFS_RETURN_IF_ERROR(add("extra_state.pt", RankFile::kExtra, nullptr));
    UCPFS_RETURN_IF_ERROR(add("ucp_info.json", RankFile::kInfo, nullptr));
  }
  return Status::Ok();
}

class Target final : public ViewKind {
 public:
  const char* Name() const override { return "target"; }
  Status Add(const ViewContext& ctx, ViewOutput* out) const override {
    const std::shared_ptr<const index::Snapshot>& snapshot = ctx.snapshot;
    const ViewOptions& targets = ctx.options;
    const index::PatternOptions& patterns = ctx.patterns;
    Tree* tree = &ctx.tree;
    const struct timespec mtime = ctx.mtime;
    const ViewAccess access = ctx.access;
    // A checkpoint of a run has target/ only with --layout.
    if (ctx.run_member && targets.layouts.empty()) return Status::Ok();

    // target/<layout>/rank_<N>/: the --layout views now; any other valid layout name when it is
    // first looked up (NamespaceInfo::resolve_target).
    UCPFS_ASSIGN_OR_RETURN(Ino target, tree->AddDir(ctx.parent, "target", mtime));
    size_t n_target = 0;
    // Made now, not on first lookup: status.json lists the extra state and what is not served,
    // which takes decoding the small non-tensor items (tensor bytes stay unread).
    UCPFS_ASSIGN_OR_RETURN(auto target_input, TargetInputOf(snapshot, targets, patterns, [](const std::string& w) {
                             std::fprintf(stderr, "ucpfs: warning: %s\n", w.c_str());
                           }));
    {
      for (const auto& l : targets.layouts) {
        auto plan = views::TargetPlan::Make(target_input, l);
        if (!plan.ok()) return plan.error().WithContext("layout " + l.name);
        UCPFS_ASSIGN_OR_RETURN(Ino ldir, tree->AddDir(target, l.name, mtime));
        UCPFS_RETURN_IF_ERROR(AddLayoutRanks(*tree, ldir, std::make_shared<const views::TargetPlan>(std::move(*plan)),
                                             mtime, access, &n_target));
      }
    }
    if (ctx.run_member) return Status::Ok();
    // Memory of the layouts built on lookup. A layout's estimate is reserved before it is built
    // and given back when its Tree is destroyed (the Filesystem evicts it once the kernel has
    // forgotten its inodes), so the budget bounds what they hold at once, not in a lifetime.
    struct LookupBudget {
      std::mutex mu;
      uint64_t limit = 0;
      uint64_t used = 0;   // guarded by mu
      uint64_t n_live = 0;  // layouts holding a reservation; guarded by mu
      // Their names (a name twice while a rebuilt layout races its evicted one); guarded by mu.
      std::multiset<std::string> names;
      // The last layouts a lookup named but could not build, with why (newest last; a name once);
      // guarded by mu. Shown in stats.json and `ucpfs status`: a refused lookup only says ENOENT.
      std::deque<std::pair<std::string, std::string>> refused;
      void Refused(const std::string& name, std::string why) {
        if (why.size() > kMaxRefusalBytes) why = why.substr(0, kMaxRefusalBytes - 3) + "...";
        std::lock_guard lock(mu);
        std::erase_if(refused, [&](const auto& r) { return r.first == name; });
        if (refused.size() == kMaxListedRefusals) refused.pop_front();
        refused.emplace_back(name, std::move(why));
      }
      // The reason the layout `name` was last refused, if it is still listed.
      std::optional<std::string> RefusalOf(const std::string& name) {
        std::lock_guard lock(mu);
        for (const auto& [layout_name, why] : refused) {
          if (layout_name == name) return why;
        }
        return std::nullopt;
      }
      void Release(const std::string& name, uint64_t n_bytes) {
        std::lock_guard lock(mu);
        used -= std::min(used, n_bytes);
        n_live -= std::min<uint64_t>(n_live, 1);
        if (auto it = names.find(name); it != names.end()) names.erase(it);
      }
    };
    // A subtree and its reservation: handed out through an aliasing shared_ptr to `tree`.
    struct BudgetedTree {
      BudgetedTree(struct timespec mtime, std::shared_ptr<LookupBudget> budget_in, std::string name_in,
                   uint64_t n_bytes_in)
          : tree(mtime), budget(std::move(budget_in)), name(std::move(name_in)), n_bytes(n_bytes_in) {}
      BudgetedTree(const BudgetedTree&) = delete;
      BudgetedTree& operator=(const BudgetedTree&) = delete;
      ~BudgetedTree() { budget->Release(name, n_bytes); }
      Tree tree;
      std::shared_ptr<LookupBudget> budget;
      std::string name;
      uint64_t n_bytes;
    };
    auto budget = std::make_shared<LookupBudget>();
    budget->limit = targets.lookup_budget_bytes;
    auto build_layout = [snapshot, target_input, mtime, access, budget](
                            const layout::Layout& l) -> Result<std::shared_ptr<const Tree>> {
      // A stray lookup must not make the daemon build thousands of rank directories; larger
      // layouts can still be given explicitly with --layout.
      if (l.World() > kMaxLookupWorld) {
        return InvalidArgumentError("layout " + l.name + " has " + std::to_string(l.World()) +
                                    " ranks; layouts built on lookup are limited to " +
                                    std::to_string(kMaxLookupWorld) + " (use --layout)");
      }
      UCPFS_ASSIGN_OR_RETURN(auto made, views::TargetPlan::Make(target_input, l));
      auto plan = std::make_shared<const views::TargetPlan>(std::move(made));
      // Bounded memory: a layout keeps only its tree (rank files are built again on open:
      // LazyRankFiles), so its estimate is rank 0's tree bytes × ranks, reserved before any rank
      // is added; a layout that would pass the budget shared by all layouts built on lookup is
      // refused.
      UCPFS_ASSIGN_OR_RETURN(auto probe, plan->Build(0));
      const uint64_t estimate = RankTreeBytes(probe) * static_cast<uint64_t>(l.World());
      {
        std::lock_guard lock(budget->mu);
        if (budget->used + estimate > budget->limit) {
          return ResourceExhaustedError(
              "layout " + l.name + " would take about " + std::to_string(estimate >> 20) + " MiB (" +
              std::to_string(l.World()) + " ranks); layouts built on lookup may take " +
              std::to_string(budget->limit >> 20) + " MiB together and " + std::to_string(budget->used >> 20) +
              " MiB are in use (raise --lookup-memory-mib, or give it with --layout; layouts no longer in "
              "use are released when the kernel forgets them)");
        }
        budget->used += estimate;  // reserved now, so racing lookups cannot both pass
        ++budget->n_live;
        budget->names.insert(l.name);
      }
      auto sub = std::make_shared<BudgetedTree>(mtime, budget, l.name, estimate);  // releases on failure too
      size_t n_files = 0;
      UCPFS_RETURN_IF_ERROR(AddLayoutRanks(sub->tree, kRootIno, std::move(plan), mtime, access, &n_files));
      return std::shared_ptr<const Tree>(sub, &sub->tree);
    };
    SubtreeResolver resolve_target = [build_layout, budget, mtime, access](
                                         const std::string& name) -> Result<std::shared_ptr<const Tree>> {
      if (name.ends_with(kRefusalSuffix)) {
        return RefusalFile(name.substr(0, name.size() - kRefusalSuffix.size()),
                           budget->RefusalOf(name.substr(0, name.size() - kRefusalSuffix.size())), mtime, access);
      }
      UCPFS_ASSIGN_OR_RETURN(auto l, layout::ParseLayout(name));
      if (l.name != name) {
        return InvalidArgumentError("layout '" + name + "' is not spelled canonically (use '" +
                                    l.name + "')");
      }
      // A well-formed layout that cannot be built is remembered with its reason (names that are
      // no layout are not: shells and file managers probe many).
      Result<std::shared_ptr<const Tree>> made = build_layout(l);
      if (!made.ok()) budget->Refused(l.name, made.error().message());
      return made;
    };
    // target/ lists `<layout>.error` for each refusal still remembered.
    SubtreeLister list_target = [budget]() {
      std::vector<std::string> names;
      std::lock_guard lock(budget->mu);
      for (const auto& refusal : budget->refused) names.push_back(refusal.first + std::string(kRefusalSuffix));
      return names;
    };

    out->counts["target_files"] = n_target;
    out->status["target_layouts"] = nlohmann::ordered_json::array();
    for (const auto& l : targets.layouts) out->status["target_layouts"].push_back(l.name);
    // Parameters the optimizer holds fused and the model saves split (views::FusedParam).
    out->status["fused_params"] = nlohmann::ordered_json::array();
    for (const auto& f : target_input->fused) {
      out->status["fused_params"].push_back({{"param", f.param}, {"stored_as", f.stored_as}, {"note", f.note}});
    }
    out->status["extra_state"] = nlohmann::ordered_json::array();
    for (const auto& e : target_input->extras) {
      nlohmann::ordered_json j = {{"key", e.key}};
      if (e.dp_rank >= 0) j["source_dp_rank"] = e.dp_rank;
      out->status["extra_state"].push_back(std::move(j));
    }
    out->status["not_served"] = nlohmann::ordered_json::array();
    for (const auto& n : target_input->not_served) {
      out->status["not_served"].push_back({{"key", n.key}, {"reason", n.reason}});
    }
    // Layouts a lookup named and could not build, with why (newest last): filled in at each open
    // of status.json (status_live below), as in stats.json's lookup_layouts.refused.
    out->status["target_refused"] = nlohmann::ordered_json::array();
    out->live_room_bytes = kStatusRefusalRoomBytes;
    out->status_live = [budget](const nlohmann::ordered_json& status, uint64_t n_bytes) {
      nlohmann::ordered_json j = status;
      {
        std::lock_guard lock(budget->mu);
        for (const auto& [name, why] : budget->refused) j["target_refused"].push_back({{"layout", name}, {"reason", why}});
      }
      std::string text = JsonText(j) + "\n";
      // The oldest refusals give way when escapes make them outgrow the room (never in practice).
      while (text.size() >= n_bytes && !j["target_refused"].empty()) {
        j["target_refused"].erase(0);
        text = JsonText(j) + "\n";
      }
      return text;
    };
    out->stats = [budget](nlohmann::ordered_json& j) {
      std::lock_guard lock(budget->mu);
      // Layouts built on lookup and not yet released, by name (at most kMaxListedLookupLayouts:
      // stats.json has a fixed size).
      nlohmann::ordered_json names = nlohmann::ordered_json::array();
      for (const std::string& name : std::set<std::string>(budget->names.begin(), budget->names.end())) {
        if (names.size() == kMaxListedLookupLayouts) break;
        names.push_back(name);
      }
      nlohmann::ordered_json refused = nlohmann::ordered_json::array();
      for (const auto& [name, why] : budget->refused) refused.push_back({{"layout", name}, {"reason", why}});
      j["lookup_layouts"] = {{"live", budget->n_live},
                             {"names", std::move(names)},
                             {"memory_bytes", budget->used},
                             {"memory_limit_bytes", budget->limit},
                             {"max_ranks", kMaxLookupWorld},
                             {"refused", std::move(refused)}};
    };
    out->dynamic_dir = target;
    out->resolve = std::move(resolve_target);
    out->list = std::move(list_target);
    return Status::Ok();
  }
};

}  // namespace

// The target views' input, made once when the namespace is built (status.json reports its
// extra state and unserved items) and shared by every layout, --layout or built on lookup.
Result<std::shared_ptr<const TargetInput>> TargetInputOf(const std::shared_ptr<const index::Snapshot>& snapshot,
                                                         const ViewOptions& options,
                                                         const index::PatternOptions& patterns,
                                                         const std::function<void(const std::string&)>& warn) {
  UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<views::TargetInput> in,
                         index::MakeTargetInput(snapshot->checkpoint(), snapshot, snapshot->mapping, snapshot->files,
                                                warn));
  index::ApplyPatterns(*in, patterns, options.pp_split);
  return std::shared_ptr<const views::TargetInput>(std::move(in));
}

const ViewKind* TargetKind() {
  static const Target kind;
  return &kind;
}

}  // namespace ucpfs::views
