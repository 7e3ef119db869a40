// Builds the namespace of a mount from an opened index: the source's own files passed through
// read-only, `atomic/<param>/{fp32,exp_avg,exp_avg_sq}.pt`, and `.ucpfs/status.json`.
// Knows no FUSE types. Everything is sized here, before the mount goes live; no tensor byte is
// read until a file is read.
#pragma once

#include <memory>
#include <string>

#include "core/status.h"
#include "fs/tree.h"
#include "index/catalog.h"
#include "index/key_map.h"

namespace ucpfs::fs {

struct NamespaceInfo {
  std::string source_dir;  // absolute
  size_t n_atomic_files = 0;
  size_t n_passthrough_files = 0;
  std::string status_json;  // the content of .ucpfs/status.json
};

// `<param>` directory name: the fqn with '/' written as "%2F" (and '%' as "%25").
std::string ParamDirName(const std::string& fqn);

// Errors: kIo when the source directory cannot be listed; kUnsupported when a state's stored
// dtype cannot be converted to fp32 (names the parameter).
Result<std::shared_ptr<Tree>> BuildNamespace(const std::string& source_dir,
                                             const index::OpenedIndex& opened,
                                             const index::KeyMapping& mapping,
                                             NamespaceInfo* info);

}  // namespace ucpfs::fs
