// The registry of view kinds (view_kind.h): the one place a kind is listed. Their order is the
// order they are added to a mount's tree, so inode numbers follow it: a new kind goes last.
#include "views/view_kind.h"

namespace ucpfs::views {

const std::vector<const ViewKind*>& ViewKinds() {
  static const std::vector<const ViewKind*> kinds = {
      UniversalKind(),    // <tag>_universal/, latest_universal (DeepSpeed)
      AtomicKind(),       // atomic/
      SafetensorsKind(),  // safetensors/
      HfKind(),           // hf/ (or hf.error)
      TargetKind(),       // target/
  };
  return kinds;
}

Result<ViewBase> ViewBaseOf(const index::Snapshot& snapshot, const ViewOptions& options) {
  ViewBase base;
  UCPFS_ASSIGN_OR_RETURN(const TreeEntry src_st, snapshot.tree().Stat(""));
  base.mtime = {static_cast<time_t>(src_st.identity.mtime_ns / 1000000000),
                static_cast<long>(src_st.identity.mtime_ns % 1000000000)};
  const index::Checkpoint& ckpt = snapshot.checkpoint();
  UCPFS_ASSIGN_OR_RETURN(base.patterns, index::PatternOptionsFor(ckpt, options.preset, options.rules,
                                                                 options.vocab_pad_multiple, options.model_facts));
  base.access = AccessOfSources(snapshot.tree(), ckpt.files);
  return base;
}

ViewAccess AccessOfSources(const SourceTree& source, const std::vector<index::SourceFile>& sources) {
  ViewAccess a;
  bool all_other = true, all_user = true, all_group = true, first = true;
  int64_t uid = -1, gid = -1;
  bool same_uid = true, same_gid = true;
  for (const auto& f : sources) {
    Result<TreeEntry> st = source.Stat(f.rel_path);
    if (!st.ok()) continue;  // read fails later
    all_other = all_other && (st->mode & 0004);
    all_user = all_user && (st->mode & 0400);
    all_group = all_group && (st->mode & 0040);
    if (first) {
      uid = st->uid;
      gid = st->gid;
      first = false;
    }
    same_uid = same_uid && uid == st->uid;
    same_gid = same_gid && gid == st->gid;
  }
  if (all_other) return a;
  a.mode = 0;
  a.uid = same_uid ? uid : 0;
  a.gid = same_gid ? gid : 0;
  if (same_uid && all_user) a.mode |= 0400;
  if (same_gid && all_group) a.mode |= 0040;
  return a;
}

}  // namespace ucpfs::views
