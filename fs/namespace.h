// What every mount's tree has whatever it serves: `.ucpfs/` (status.json, stats.json, sync),
// the namespace of a source with no checkpoint yet (`.ucpfs/` only), and what a built namespace
// tells the daemon (NamespaceInfo). The views themselves are built into the tree by views/
// (views/mount_views.h); the source's own files are not in the tree: the mount's Passthrough
// serves them beside it. Knows no FUSE types, no checkpoint and no view.
#pragma once

#include <memory>
#include <optional>
#include <vector>
#include <string>

#include <functional>

#include <nlohmann/json.hpp>

#include "core/byte_source.h"
#include "core/status.h"
#include "fs/mount_report.h"
#include "fs/tree.h"

namespace ucpfs::fs {

struct NamespaceInfo {
  std::string source_dir;  // absolute
  size_t n_atomic_files = 0;
  size_t n_passthrough_files = 0;
  size_t n_target_files = 0;      // distinct inodes under target/
  std::string status_json;  // the content of .ucpfs/status.json
  // target/ and the builder of its layouts not given with --layout, for ServeTree's
  // MountOptions::dynamic_dir / resolve (a view's ViewOutput::dynamic_dir: views/view_kind.h).
  // The resolver builds `target/<name>/` as a Tree of its own (rank_<N>/ under its root);
  // errors (kInvalidArgument) name the layout and why: not a layout name, not its canonical
  // spelling, or one the model refuses. It keeps the snapshot it reads alive; thread-safe.
  Ino target_dir = 0;
  SubtreeResolver resolve_target;
  // The names target/ lists before they are looked up: `<layout>.error` of each remembered
  // refusal (the resolver serves them as files holding the reason). For MountOptions::list.
  SubtreeLister list_target;
  std::string index_state;   // set by the caller, for its messages
  double index_seconds = 0;
};

// What the mount adds to `.ucpfs/` beside the views (each optional).
struct MountHooks {
  // `.ucpfs/sync`: its open(2) returns once everything saved into the mount before it is
  // durable (`ucpfs sync MNT`), and fails with the flush error otherwise.
  std::function<Status()> sync;
  // The write capture's counters, as stats.json's "capture".
  std::function<nlohmann::ordered_json()> capture_stats;
  // The object store's client counters (requests, bytes GET...), as stats.json's "s3".
  std::function<nlohmann::ordered_json()> s3_stats;
  // View reads and errors so far, as stats.json's "views" and "errors" (MountReport::AddTo).
  std::shared_ptr<MountReport> report;
  // More top-level keys of status.json (e.g. "run": the checkpoints of a run directory).
  nlohmann::ordered_json status_extra = nlohmann::ordered_json::object();
};

// Opener of a file whose bytes are made already (a MemorySource, a lazy file sized at mount).
Opener FixedSource(std::shared_ptr<const ByteSource> src);

// Opener of a file built again when it is opened, so the tree keeps only its name, its size and
// what `build` captures, not the built file (zip headers, pickles, copy plans): what a view holds
// between opens does not grow with the model. Opens while an earlier one still holds the file
// share that build. `build` must be deterministic: its file has the `n_bytes` the tree lists;
// another size is kInternal, naming the file. Errors: `build`'s.
using Builder = std::function<Result<std::shared_ptr<const ByteSource>>()>;
Opener BuiltOnOpen(Builder build, uint64_t n_bytes);

// A file built again (BuiltOnOpen, target/'s rank files), checked against the `n_bytes` the
// tree lists: kInternal, naming the file, when it is missing or has another size; else as given.
Result<std::shared_ptr<const ByteSource>> CheckBuiltAgain(Result<std::shared_ptr<const ByteSource>> built,
                                                          uint64_t n_bytes);

// The current time (CLOCK_REALTIME), the mtime of what a mount makes.
struct timespec Now();

// `.ucpfs/`: status.json (`status_text`), stats.json (counters as of open(2): `counters`', the
// report's and the capture's, padded with spaces to a fixed size so the size is known before
// the content; JSON allows trailing white space) and, with a capture, `sync` (its open(2)
// returns once everything saved before it is durable).
// With `status_live`, status.json is made again at each open (what happened since the mount,
// e.g. refused layouts): status_live(n) returns the text in at most n - 1 bytes, padded with
// spaces to a fixed size of status_text's plus `live_room_bytes`.
// Errors: the Tree's (a name taken).
Status AddMetaDir(Tree& tree, struct timespec mtime, const std::string& status_text,
                  std::function<void(nlohmann::ordered_json&)> counters, const MountHooks& hooks,
                  std::function<std::string(uint64_t)> status_live = nullptr, uint64_t live_room_bytes = 0);

// The namespace of a source that holds no checkpoint (yet): `.ucpfs/` only, status.json saying
// `why` under "no_checkpoint".
Result<std::shared_ptr<Tree>> BuildEmptyNamespace(const std::string& source_dir, const std::string& why,
                                                  uint64_t generation, const MountHooks& hooks, NamespaceInfo* info);

}  // namespace ucpfs::fs
