// The registry of source formats (see scanner.h).
#include "index/scanner.h"

#include <array>

#include "index/dcp_scan.h"
#include "index/deepspeed_scan.h"
#include "index/megatron_scan.h"
#include "index/torch_state_scan.h"
#include "index/weights_scan.h"

namespace ucpfs::index {
namespace {

class DcpScanner final : public Scanner {
 public:
  std::string_view Name() const override { return "dcp"; }
  bool Recognizes(const SourceTree& tree) const override {
    return IsDcpDirectory(tree) || !DcpCompositeParts(tree).empty();
  }
  Result<Checkpoint> Scan(const SourceTree& tree, const ScanProgress& progress) const override {
    return ScanDcp(tree, progress);
  }
};

class DeepSpeedFormatScanner final : public Scanner {
 public:
  std::string_view Name() const override { return "deepspeed"; }
  bool Recognizes(const SourceTree& tree) const override { return IsDeepSpeedDirectory(tree); }
  Result<Checkpoint> Scan(const SourceTree& tree, const ScanProgress& progress) const override {
    return ScanDeepSpeed(tree, progress);
  }
};

class MegatronLegacyScanner final : public Scanner {
 public:
  std::string_view Name() const override { return "megatron"; }
  bool Recognizes(const SourceTree& tree) const override { return IsMegatronLegacyDirectory(tree); }
  Result<Checkpoint> Scan(const SourceTree& tree, const ScanProgress& progress) const override {
    return ScanMegatronLegacy(tree, progress);
  }
};

class TorchStateScanner final : public Scanner {
 public:
  std::string_view Name() const override { return "torch_state"; }
  bool Recognizes(const SourceTree& tree) const override { return IsTorchStateDirectory(tree); }
  Result<Checkpoint> Scan(const SourceTree& tree, const ScanProgress& progress) const override {
    return ScanTorchState(tree, progress);
  }
};

class WeightsScanner final : public Scanner {
 public:
  std::string_view Name() const override { return "weights"; }
  bool Recognizes(const SourceTree& tree) const override { return IsWeightsDirectory(tree); }
  Result<Checkpoint> Scan(const SourceTree& tree, const ScanProgress& progress) const override {
    return ScanWeights(tree, progress);
  }
};

}  // namespace

std::span<const Scanner* const> Scanners() {
  static const DcpScanner dcp;
  static const DeepSpeedFormatScanner deepspeed;
  static const MegatronLegacyScanner megatron;
  static const TorchStateScanner torch_state;
  static const WeightsScanner weights;
  // Weights last: other formats' directories may hold .pt or .safetensors files too; before it,
  // torch.save files with an optimizer state dict beside the weights.
  static const std::array<const Scanner*, 5> all = {&dcp, &deepspeed, &megatron, &torch_state, &weights};
  return all;
}

Result<const Scanner*> ScannerFor(const SourceTree& tree) {
  for (const Scanner* s : Scanners()) {
    if (s->Recognizes(tree)) return s;
  }
  return NotFoundError(tree.Root() + " is not a checkpoint ucpfs reads: no DCP metadata (.metadata, __<r>.metadata), "
                       "no DeepSpeed save (latest, mp_rank_XX_model_states.pt), no Megatron-LM save "
                       "(latest_checkpointed_iteration.txt, mp_rank_XX/model_optim_rng.pt), no optimizer state "
                       "dict or Lightning .ckpt and no weights "
                       "(*.safetensors, model.safetensors.index.json, a .pt/.pth/.bin state dict)");
}

Result<Checkpoint> ScanCheckpoint(const SourceTree& tree, const ScanProgress& progress) {
  UCPFS_ASSIGN_OR_RETURN(const Scanner* scanner, ScannerFor(tree));
  return scanner->Scan(tree, progress);
}

}  // namespace ucpfs::index
