// The other tags of a DeepSpeed save directory and their universal views (deepspeed_tags.h).
//
// Not for: scanning a tag (deepspeed_scan.cc) or building a view (universal_view.cc); this file
// only finds the tags and runs both on each, keeping each tag's failure to that tag.
// GCC 12 with -fsanitize=address,undefined -O2 reports a false -Wmaybe-uninitialized inside
// libstdc++'s <regex> (GCC PR 105562; see key_map.cc): off before <regex> is first included.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "views/deepspeed_tags.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "index/deepspeed_scan.h"
#include "index/key_map.h"
#include "views/view_inputs.h"

namespace ucpfs::index {
namespace {

constexpr std::string_view kUniversalSuffix = "_universal";
constexpr size_t kMaxNameBytes = 255;  // NAME_MAX: `<tag>_universal` must be a name too

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// One tag directory (the root of `tag`) → its view. Errors name the tag directory.
Result<UniversalView> BuildTagView(const SourceTree& tag, const std::string& name,
                                   std::shared_ptr<IoCounters> counters, std::vector<SourceFile>* files_out) {
  const std::string& tag_dir = tag.Root();
  if (tag.Stat("latest").ok()) {
    return UnsupportedError(tag_dir + ": holds its own `latest`: a save directory, not a tag");
  }
  if (name.size() + kUniversalSuffix.size() > kMaxNameBytes) {
    return InvalidArgumentError(tag_dir + ": the name is too long for " + std::string(kUniversalSuffix) +
                                " to be added (at most " + std::to_string(kMaxNameBytes) + " bytes)");
  }
  UCPFS_ASSIGN_OR_RETURN(Checkpoint ckpt, ScanDeepSpeed(tag));
  UCPFS_ASSIGN_OR_RETURN(const KeyMapping mapping, MapKeys(ckpt, {}));
  UCPFS_ASSIGN_OR_RETURN(const FileTable files, OpenFileTable(tag, ckpt, std::move(counters)));
  UCPFS_ASSIGN_OR_RETURN(std::optional<UniversalView> view, BuildUniversalView(ckpt, nullptr, mapping, files, name));
  // The directory is the tag, so the view is named after it and has no latest_universal.
  if (!view || view->dir != name + std::string(kUniversalSuffix) || !view->latest_universal.empty()) {
    return InternalError(tag_dir + ": its universal view is not `" + name + std::string(kUniversalSuffix) + "`");
  }
  *files_out = std::move(ckpt.files);
  return std::move(*view);
}

}  // namespace

Result<std::vector<std::string>> ListDeepSpeedTags(const SourceTree& save_dir, const std::string& latest_tag,
                                                   size_t max_tags, size_t* n_left_out) {
  if (n_left_out != nullptr) *n_left_out = 0;
  UCPFS_ASSIGN_OR_RETURN(const std::vector<TreeEntry> entries, save_dir.List(""));
  // Candidates: real subdirectories (never a symlink's target), in name order (List's).
  std::vector<std::string> candidates;
  for (const TreeEntry& e : entries) {
    const std::string& name = e.name;
    if (name.empty() || name[0] == '.' || name == latest_tag || EndsWith(name, kUniversalSuffix)) continue;
    if (e.kind != EntryKind::kDirectory) continue;
    candidates.push_back(name);
  }
  std::vector<std::string> tags;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (tags.size() == max_tags) {
      if (n_left_out != nullptr) *n_left_out = candidates.size() - i;
      break;
    }
    Result<std::shared_ptr<const SourceTree>> tag = save_dir.Subtree(candidates[i]);
    if (tag.ok() && IsDeepSpeedDirectory(**tag)) tags.push_back(candidates[i]);
  }
  return tags;
}

Result<DeepSpeedTags> BuildDeepSpeedTagViews(const SourceTree& save_dir, const Checkpoint& latest,
                                             std::shared_ptr<IoCounters> counters) {
  DeepSpeedTags out;
  const auto* info = std::get_if<DeepSpeedSourceFacts>(&latest.facts);
  if (info == nullptr) return out;
  const std::string& latest_tag = info->tag;
  if (latest_tag.empty()) return out;  // a tag directory by itself
  UCPFS_ASSIGN_OR_RETURN(const std::vector<std::string> names,
                         ListDeepSpeedTags(save_dir, latest_tag, kMaxDeepSpeedTags, &out.n_left_out));
  for (const auto& name : names) {
    DeepSpeedTag tag;
    tag.name = name;
    Result<std::shared_ptr<const SourceTree>> tag_tree = save_dir.Subtree(name);
    auto built = tag_tree.ok() ? BuildTagView(**tag_tree, name, counters, &tag.files)
                               : Result<UniversalView>(tag_tree.error());
    if (built.ok()) {
      tag.view = std::move(*built);
    } else {
      tag.error = built.error().message();
    }
    out.tags.push_back(std::move(tag));
  }
  return out;
}

}  // namespace ucpfs::index
