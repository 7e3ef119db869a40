#include "fs/namespace.h"
#include "core/json_text.h"

#include <cstdio>
#include <ctime>
#include <mutex>
#include <nlohmann/json.hpp>

namespace ucpfs::fs {
namespace {

constexpr uint64_t kStatsJsonBytes = 16384;  // MountReport's messages fit

}  // namespace

struct timespec Now() {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts;
}

Opener FixedSource(std::shared_ptr<const ByteSource> src) {
  return [src]() -> Result<std::shared_ptr<const ByteSource>> { return src; };
}

Opener BuiltOnOpen(Builder build, uint64_t n_bytes) {
  struct Held {
    Builder build;
    uint64_t n_bytes;
    std::mutex mu;
    std::weak_ptr<const ByteSource> open;  // guarded by mu
  };
  auto held = std::make_shared<Held>(std::move(build), n_bytes);
  return [held]() -> Result<std::shared_ptr<const ByteSource>> {
    std::lock_guard lock(held->mu);
    if (auto src = held->open.lock()) return src;
    UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<const ByteSource> src, CheckBuiltAgain(held->build(), held->n_bytes));
    held->open = src;
    return src;
  };
}

Result<std::shared_ptr<const ByteSource>> CheckBuiltAgain(Result<std::shared_ptr<const ByteSource>> built,
                                                          uint64_t n_bytes) {
  if (!built.ok()) return built;
  const std::shared_ptr<const ByteSource>& src = *built;
  if (src == nullptr) return InternalError("a file listed in the tree is not built again");
  if (src->Size() != n_bytes) {
    return InternalError(src->Name() + " built again has " + std::to_string(src->Size()) + " bytes, not the " +
                         std::to_string(n_bytes) + " listed");
  }
  return built;
}

Status AddMetaDir(Tree& tree, struct timespec mtime, const std::string& status_text,
                  std::function<void(nlohmann::ordered_json&)> counters, const MountHooks& hooks,
                  std::function<std::string(uint64_t)> status_live, uint64_t live_room_bytes) {
  UCPFS_ASSIGN_OR_RETURN(Ino meta, tree.AddDir(kRootIno, ".ucpfs", mtime));
  if (status_live) {
    const uint64_t n_bytes = status_text.size() + live_room_bytes;
    Opener open = [status_live, n_bytes]() -> Result<std::shared_ptr<const ByteSource>> {
      std::string text = status_live(n_bytes);
      if (text.size() >= n_bytes) return InternalError("status.json outgrew its " + std::to_string(n_bytes) + " bytes");
      text.pop_back();  // the newline goes last, after the padding
      text.resize(n_bytes - 1, ' ');
      text.push_back('\n');
      return std::shared_ptr<const ByteSource>(std::make_shared<MemorySource>(
          ".ucpfs/status.json", std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size())));
    };
    UCPFS_ASSIGN_OR_RETURN(Ino status_ino, tree.AddFile(meta, "status.json", n_bytes, Now(), std::move(open)));
    UCPFS_RETURN_IF_ERROR(tree.MarkVolatile(status_ino));
  } else {
    auto status_src = std::make_shared<MemorySource>(
        ".ucpfs/status.json",
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(status_text.data()), status_text.size()));
    const uint64_t status_n_bytes = status_src->Size();
    UCPFS_RETURN_IF_ERROR(
        tree.AddFile(meta, "status.json", status_n_bytes, Now(), FixedSource(std::move(status_src))).status());
  }
  Opener stats_open = [counters, capture = hooks.capture_stats, s3 = hooks.s3_stats,
                       report = hooks.report]() -> Result<std::shared_ptr<const ByteSource>> {
    nlohmann::ordered_json j;
    if (counters) counters(j);
    if (report) report->AddTo(j);
    if (capture) j["capture"] = capture();
    if (s3) j["s3"] = s3();
    std::string text = JsonText(j) + "\n";
    if (text.size() > kStatsJsonBytes) return InternalError("stats.json outgrew its " + std::to_string(kStatsJsonBytes) + " bytes");
    text.resize(kStatsJsonBytes, ' ');
    text.back() = '\n';
    return std::shared_ptr<const ByteSource>(std::make_shared<MemorySource>(
        ".ucpfs/stats.json",
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size())));
  };
  UCPFS_ASSIGN_OR_RETURN(Ino stats_ino,
                         tree.AddFile(meta, "stats.json", kStatsJsonBytes, Now(), std::move(stats_open)));
  UCPFS_RETURN_IF_ERROR(tree.MarkVolatile(stats_ino));
  if (hooks.sync) {
    Opener sync_open = [sync = hooks.sync]() -> Result<std::shared_ptr<const ByteSource>> {
      UCPFS_RETURN_IF_ERROR(sync());
      return std::shared_ptr<const ByteSource>(std::make_shared<MemorySource>(".ucpfs/sync", std::vector<std::byte>{}));
    };
    UCPFS_ASSIGN_OR_RETURN(Ino sync_ino, tree.AddFile(meta, "sync", 0, Now(), std::move(sync_open)));
    UCPFS_RETURN_IF_ERROR(tree.MarkVolatile(sync_ino));
  }
  return Status::Ok();
}

Result<std::shared_ptr<Tree>> BuildEmptyNamespace(const std::string& source_dir, const std::string& why,
                                                  uint64_t generation, const MountHooks& hooks, NamespaceInfo* info) {
  auto tree = std::make_shared<Tree>();
  const struct timespec mtime = Now();
  nlohmann::ordered_json status;
  status["source"] = source_dir;
  status["format"] = "none";
  status["no_checkpoint"] = why;
  status["generation"] = generation;
  // What the daemon adds (its pid, which `ucpfs umount` waits on; an object store's staging).
  for (const auto& [key, value] : hooks.status_extra.items()) status[key] = value;
  const std::string status_text = JsonText(status) + "\n";
  UCPFS_RETURN_IF_ERROR(AddMetaDir(*tree, mtime, status_text, nullptr, hooks));
  if (info != nullptr) {
    info->source_dir = source_dir;
    info->status_json = status_text;
  }
  return tree;
}

}  // namespace ucpfs::fs
