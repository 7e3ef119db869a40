// `ucpfs verify SRC`: reads every view once and checks it against the index and the source,
// without FUSE and without writing anything (the index is not built or rebuilt):
//   - index: the stored index names files that exist, unchanged since it was built (size,
//     mtime, ctime, inode), and the source's fingerprint is the one indexed;
//   - coverage and replicas: a fresh scan of the source (the index builders' own checks: every
//     tensor's shards tile its global shape exactly once; replicated shards hold equal bytes);
//   - sizes: every view file yields exactly its declared size, and parses with core/format
//     (torch zip with every tensor record of its expected length; safetensors header; JSON);
//   - checksums: the CRC-32 of every record of every torch.save source file the views read.
//     DCP .distcp files carry none (torch 2.x stores raw bytes; torch 1.13's per-item blobs
//     are not walked yet): reported as unchecked, never as passed.
// Each problem names the file and what is wrong; exit 1 on any problem, 0 with a summary.
#pragma once

#include <string>
#include <vector>

#include "cli/checkpoint_cmds.h"
#include "cli/view_args.h"

namespace CLI {
class App;
}

namespace ucpfs::cli {

struct VerifyArgs {
  SourceArgs source;  // SRC, --index-dir, --rules, --read-only-index, --quiet
  ViewArgs views;     // --layout..., atomic (on unless --no-atomic), --safetensors, --view
  bool json = false;
};

// Registers `verify` and its view options on `app` (the source options are the caller's).
CLI::App* AddVerifyCommand(CLI::App& app, VerifyArgs& args);

// Exit status: 0 all well, 1 a problem found (or SRC not readable), 2 bad arguments.
int RunVerify(const VerifyArgs& args);

}  // namespace ucpfs::cli
