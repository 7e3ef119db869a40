// Snapshot: one consistent state of a checkpoint as ucpfs serves it: the opened index, the key
// mapping, the source file table (descriptors opened on first read, identity-checked), the
// options they were made with, and a generation number. Built by OpenSnapshot alone, for the
// mount, for `ucpfs convert` and for the inspecting commands, so they can never disagree about
// what a checkpoint holds.
//
// A mount swaps its Snapshot atomically after a save completes (a new generation); readers of
// the old one keep it (shared ownership) until they are done. Immutable once built.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/io/lazy_file_source.h"
#include "core/io/source_tree.h"
#include "core/status.h"
#include "index/catalog.h"
#include "index/key_map.h"
#include "index/file_table.h"

namespace ucpfs::index {

struct SnapshotOptions {
  std::string source_dir;        // absolute: where the index lives and what messages name
  // What the source is read through; empty: a LocalTree over source_dir.
  std::shared_ptr<const SourceTree> tree;
  std::string index_dir;         // empty: the default location
  bool read_only_index = false;
  std::vector<KeyRule> key_rules;  // --rules, loaded
  ScanProgress progress;
};

struct Snapshot {
  uint64_t generation = 0;
  SnapshotOptions options;
  OpenedIndex opened;
  KeyMapping mapping;
  std::shared_ptr<IoCounters> counters;
  FileTable files;

  const Checkpoint& checkpoint() const { return opened.checkpoint; }
  const std::string& source_dir() const { return options.source_dir; }
  // The source the files are read through (options.tree, or the LocalTree made for it).
  const SourceTree& tree() const { return *options.tree; }
};

// Indexes (or reuses the index of) options.source_dir and maps its keys. Errors: those of
// OpenOrBuildIndex (the scanner's kNotFound when the directory holds no checkpoint, kCorrupt,
// kIo...) and of MapKeys.
Result<std::shared_ptr<const Snapshot>> OpenSnapshot(const SnapshotOptions& options, uint64_t generation);

// The Snapshot of an index opened (or a checkpoint scanned) by the caller: keys mapped, file
// table opened. OpenSnapshot is OpenOrBuildIndex then this. Errors: those of MapKeys.
Result<std::shared_ptr<const Snapshot>> SnapshotOf(OpenedIndex opened, const SnapshotOptions& options,
                                                   uint64_t generation);

// Opens the source file `rel_path` of the snapshot now (LazySource::Open), if it has one:
// called before a save replaces it, so the snapshot's views keep reading the bytes indexed.
void OpenSourceFile(const Snapshot& snapshot, const std::string& rel_path);

}  // namespace ucpfs::index
