// `ucpfs inspect FILE [--json]`: what a torch.save file holds and where each tensor's bytes are.
#pragma once

#include <iosfwd>
#include <string>

namespace ucpfs::cli {

// Prints the report to `out`; errors go to `err`. Returns the process exit code.
int RunInspect(const std::string& path, bool json, std::ostream& out, std::ostream& err);

}  // namespace ucpfs::cli
