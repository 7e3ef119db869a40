// The other tags of a DeepSpeed save directory: every direct subdirectory besides the one
// `latest` names that holds DeepSpeed model states (`global_step2/`, ...), each scanned as a tag
// directory by itself (ScanDeepSpeed) and given its universal view (universal_view.h), so that
// a mount serves `<tag>_universal/` for every tag, as ds_to_universal would write it for that
// tag. The mounted checkpoint (the `latest` tag) keeps its own view and `latest_universal`.
//
// Not for: the `latest` tag (the mounted, indexed checkpoint serves it), tag directories given
// by themselves (no `latest`: nothing else to list), other formats. The tags are not indexed in
// LMDB: each is scanned again when a mount is built.
//
// Invariants:
//  - Only real directories count: the save directory is listed through its SourceTree, a
//    symlink is never followed. Skipped
//    unexamined: names starting with '.', names ending in `_universal` (what ds_to_universal
//    writes beside the tags), the `latest` tag, anything that is not a directory, directories
//    without model states (IsDeepSpeedDirectory false).
//  - Bounded: at most kMaxDeepSpeedTags tags, taken in name order; the subdirectories left
//    unexamined beyond them are counted (DeepSpeedTags::n_left_out), never silently dropped.
//  - A tag that fails (name too long for `<tag>_universal`, a nested save directory with its own
//    `latest`, a scan or view error) is kept with its error and no view; it never fails the
//    whole listing.
//  - Each view's model-states files (UniversalFile::build == null) have `source_rel` relative to
//    the TAG directory: the mount serves them as `<tag>/<source_rel>`.
//  - Parameters are mapped by the built-in key rules (MapKeys with no user rules): the DeepSpeed
//    scanner names every key the way they expect.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/io/lazy_file_source.h"
#include "core/io/source_tree.h"
#include "core/status.h"
#include "index/checkpoint.h"
#include "views/universal_view.h"

namespace ucpfs::index {

// At most this many tags get a universal view: each is scanned (model states and rank 0's
// optimizer pickle read) when the mount is built.
inline constexpr size_t kMaxDeepSpeedTags = 256;

struct DeepSpeedTag {
  std::string name;                   // the tag directory, e.g. "global_step2"
  std::optional<UniversalView> view;  // `<name>_universal/`, no latest_universal; null on error
  std::vector<SourceFile> files;      // the tag's files, relative to the tag directory
  std::string error;                  // why there is no view (empty when there is one)
};

struct DeepSpeedTags {
  std::vector<DeepSpeedTag> tags;  // in name order (bytewise)
  size_t n_left_out = 0;           // subdirectories not examined once kMaxDeepSpeedTags were found
};

// The tag directories of the save directory (the root of `save_dir`) besides `latest_tag`, in
// name order, at most `max_tags`; `*n_left_out` (may be null) counts the candidate
// subdirectories not examined beyond them. Errors: SourceTree::List's (naming the directory)
// when it cannot be listed.
Result<std::vector<std::string>> ListDeepSpeedTags(const SourceTree& save_dir, const std::string& latest_tag,
                                                   size_t max_tags, size_t* n_left_out);

// The universal view of every other tag of `save_dir`, the directory `latest` was indexed from
// (`latest`: its Checkpoint). Nothing when `latest` is not a DeepSpeed checkpoint or its facts
// name no tag (a tag directory mounted by itself). `counters` (may be null) counts the reads of
// the tags' files. Errors: those of ListDeepSpeedTags. Each tag's own failure is in its
// DeepSpeedTag::error.
Result<DeepSpeedTags> BuildDeepSpeedTagViews(const SourceTree& save_dir, const Checkpoint& latest,
                                             std::shared_ptr<IoCounters> counters);

}  // namespace ucpfs::index
