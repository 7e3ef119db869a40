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

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
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

// One tag directory → its view. Errors name the tag directory.
Result<UniversalView> BuildTagView(const std::string& tag_dir, const std::string& name,
                                   std::shared_ptr<IoCounters> counters, std::vector<SourceFile>* files_out) {
  struct stat st;
  if (::lstat((tag_dir + "/latest").c_str(), &st) == 0) {
    return UnsupportedError(tag_dir + ": holds its own `latest`: a save directory, not a tag");
  }
  if (name.size() + kUniversalSuffix.size() > kMaxNameBytes) {
    return InvalidArgumentError(tag_dir + ": the name is too long for " + std::string(kUniversalSuffix) +
                                " to be added (at most " + std::to_string(kMaxNameBytes) + " bytes)");
  }
  UCPFS_ASSIGN_OR_RETURN(Checkpoint ckpt, ScanDeepSpeed(tag_dir));
  UCPFS_ASSIGN_OR_RETURN(const KeyMapping mapping, MapKeys(ckpt, {}));
  const FileTable files = OpenFileTable(tag_dir, ckpt, std::move(counters));
  UCPFS_ASSIGN_OR_RETURN(std::optional<UniversalView> view, BuildUniversalView(ckpt, mapping, files, name));
  // The directory is the tag, so the view is named after it and has no latest_universal.
  if (!view || view->dir != name + std::string(kUniversalSuffix) || !view->latest_universal.empty()) {
    return InternalError(tag_dir + ": its universal view is not `" + name + std::string(kUniversalSuffix) + "`");
  }
  *files_out = std::move(ckpt.files);
  return std::move(*view);
}

}  // namespace

Result<std::vector<std::string>> ListDeepSpeedTags(const std::string& save_dir, const std::string& latest_tag,
                                                   size_t max_tags, size_t* n_left_out) {
  if (n_left_out != nullptr) *n_left_out = 0;
  const int dfd = ::open(save_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return IoError(save_dir + ": open: " + std::strerror(errno), errno);
  DIR* d = ::fdopendir(dfd);
  if (d == nullptr) {
    const int err = errno;
    ::close(dfd);
    return IoError(save_dir + ": opendir: " + std::strerror(err), err);
  }
  // Candidates: real subdirectories (never a symlink's target), in name order.
  std::vector<std::string> candidates;
  while (struct dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.empty() || name[0] == '.' || name == latest_tag || EndsWith(name, kUniversalSuffix)) continue;
    struct stat st;
    if (::fstatat(dfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode)) continue;
    candidates.push_back(name);
  }
  ::closedir(d);  // closes dfd
  std::sort(candidates.begin(), candidates.end());
  std::vector<std::string> tags;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (tags.size() == max_tags) {
      if (n_left_out != nullptr) *n_left_out = candidates.size() - i;
      break;
    }
    if (IsDeepSpeedDirectory(save_dir + "/" + candidates[i])) tags.push_back(candidates[i]);
  }
  return tags;
}

Result<DeepSpeedTags> BuildDeepSpeedTagViews(const std::string& save_dir, const Checkpoint& latest,
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
    auto built = BuildTagView(save_dir + "/" + name, name, counters, &tag.files);
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
