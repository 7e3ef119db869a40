// A run directory: a directory that is not a checkpoint itself but holds several, one per
// subdirectory (torchtitan's `checkpoint/step-N/`, a directory of DCP saves, of DeepSpeed save
// directories...). Finds them without reading tensor data, newest last.
//
// "Newest" is the checkpoint whose completion marker (`.metadata`, `__0.metadata`, `latest`,
// `latest_checkpointed_iteration.txt`, for a DeepSpeed tag its `mp_rank_00_model_states.pt`, for a
// Hugging Face Trainer `checkpoint-N/` its `trainer_state.json` (written after the model and the
// optimizer), for
// one checkpoint saved as several DCP directories (dcp_scan.h DcpCompositeParts, Accelerate's
// save_state folder) its first part's `.metadata`) was modified last; ties go to the name that sorts last.
//
// Trust: only real subdirectories are examined (never a symlink), names starting with '.' are
// skipped, and at most kMaxRunCheckpoints are taken in name order (the rest are counted).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/io/source_tree.h"
#include "core/status.h"

namespace ucpfs::index {

inline constexpr size_t kMaxRunCheckpoints = 256;

struct RunCheckpoint {
  std::string name;          // the subdirectory's name
  std::string marker;        // its completion marker's name
  int64_t marker_mtime_ns = 0;
};

struct RunCheckpoints {
  std::vector<RunCheckpoint> checkpoints;  // oldest first: the newest is back()
  size_t n_left_out = 0;                   // subdirectories with a marker beyond the limit
};

// The checkpoints of the run folder at the root of `tree`. Errors: SourceTree::List's when the
// root cannot be listed (kNotFound, kIo).
Result<RunCheckpoints> FindRunCheckpoints(const SourceTree& tree);

}  // namespace ucpfs::index
