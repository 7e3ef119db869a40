// FileTable: a checkpoint's source files by file id, each opened on first read and checked
// against its indexed identity. The one file table of the mount, `ucpfs convert` and
// `ucpfs inspect` (a Snapshot holds it); the scanners' fact readers and the views read items
// through it. Not a cache of bytes: reads go to the files each time.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/byte_source.h"
#include "core/io/lazy_file_source.h"
#include "core/io/source_tree.h"
#include "index/checkpoint.h"

namespace ucpfs::index {

using FileTable = std::shared_ptr<const std::vector<std::shared_ptr<const ByteSource>>>;

// The checkpoint's files by id, opened lazily through `tree` (SourceTree::OpenLazy), all sharing
// one bounded descriptor cache (core/io/lazy_file_source.h). `counters` may be null.
// Errors: kInvalidArgument for a file path the tree refuses (a record names the file).
Result<FileTable> OpenFileTable(const SourceTree& tree, const Checkpoint& checkpoint,
                                std::shared_ptr<IoCounters> counters);

}  // namespace ucpfs::index
