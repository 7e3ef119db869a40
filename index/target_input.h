// Builds the input of target views (core/views/target.h) from an indexed checkpoint: each
// mapped parameter's tensor states, and the optimizer hyper-parameters torchtitan flattens into
// BYTE_IO items `optimizer.param_groups.<fqn>.<field>`. Used by `ucpfs convert` and the mount.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/byte_source.h"
#include "core/status.h"
#include "core/views/target.h"
#include "index/checkpoint.h"
#include "index/key_map.h"

namespace ucpfs::index {

using FileTable = std::shared_ptr<const std::vector<std::shared_ptr<const ByteSource>>>;

// `warn` receives one line per hyper-parameter item that cannot be read (it is left out of
// param_groups). Errors: kOutOfRange when a BYTE_IO item lies outside its file.
Result<std::shared_ptr<views::TargetInput>> MakeTargetInput(
    const Checkpoint& checkpoint, const KeyMapping& mapping, const FileTable& files,
    const std::function<void(const std::string&)>& warn);

}  // namespace ucpfs::index
