// See run_dir.h.
#include "index/run_dir.h"

#include <algorithm>
#include <iterator>

#include "index/dcp_scan.h"

namespace ucpfs::index {

Result<RunCheckpoints> FindRunCheckpoints(const SourceTree& tree) {
  UCPFS_ASSIGN_OR_RETURN(const std::vector<TreeEntry> entries, tree.List(""));
  std::vector<std::string> names;  // sorted, as List gives them
  for (const TreeEntry& e : entries) {
    if (e.name.empty() || e.name[0] == '.' || e.kind != EntryKind::kDirectory) continue;
    names.push_back(e.name);
  }
  RunCheckpoints out;
  static const char* const kMarkers[] = {".metadata", "__0.metadata", "latest", "latest_checkpointed_iteration.txt",
                                         "mp_rank_00_model_states.pt", "trainer_state.json"};
  for (const std::string& name : names) {
    Result<std::shared_ptr<const SourceTree>> sub = tree.Subtree(name);
    if (!sub.ok()) continue;
    std::vector<std::string> markers(std::begin(kMarkers), std::end(kMarkers));
    if (std::none_of(std::begin(kMarkers), std::end(kMarkers),
                     [&](const char* m) { return (*sub)->Stat(m).ok(); })) {
      // One checkpoint saved as several DCP directories (Accelerate's save_state folder): its
      // first part's metadata.
      for (const std::string& part : DcpCompositeParts(**sub)) markers.push_back(part + "/.metadata");
    }
    for (const std::string& marker : markers) {
      Result<TreeEntry> st = (*sub)->Stat(marker);
      if (!st.ok() || st->kind != EntryKind::kFile) continue;
      if (out.checkpoints.size() >= kMaxRunCheckpoints) {
        ++out.n_left_out;
      } else {
        out.checkpoints.push_back({name, marker, st->identity.mtime_ns});
      }
      break;
    }
  }
  std::stable_sort(out.checkpoints.begin(), out.checkpoints.end(), [](const RunCheckpoint& a, const RunCheckpoint& b) {
    return a.marker_mtime_ns != b.marker_mtime_ns ? a.marker_mtime_ns < b.marker_mtime_ns : a.name < b.name;
  });
  return out;
}

}  // namespace ucpfs::index
