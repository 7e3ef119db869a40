#include "fs/mount_report.h"

namespace ucpfs::fs {

void MountReport::CountViewRead(uint64_t n_bytes) {
  n_view_reads_.fetch_add(1, std::memory_order_relaxed);
  n_view_bytes_.fetch_add(n_bytes, std::memory_order_relaxed);
}

void MountReport::RecordError(const std::string& message, bool keep_message) {
  n_errors_.fetch_add(1, std::memory_order_relaxed);
  if (!keep_message) return;
  std::string text = message.size() > kMaxMessageBytes ? message.substr(0, kMaxMessageBytes - 3) + "..." : message;
  std::lock_guard lock(mu_);
  if (last_.size() == kMaxMessages) last_.pop_front();
  last_.push_back(std::move(text));
}

void MountReport::AddTo(nlohmann::ordered_json& out) const {
  out["views"] = {{"reads", n_view_reads_.load(std::memory_order_relaxed)},
                  {"bytes_read", n_view_bytes_.load(std::memory_order_relaxed)}};
  nlohmann::ordered_json last = nlohmann::ordered_json::array();
  {
    std::lock_guard lock(mu_);
    for (const std::string& m : last_) last.push_back(m);
  }
  out["errors"] = {{"count", n_errors_.load(std::memory_order_relaxed)}, {"last", std::move(last)}};
}

}  // namespace ucpfs::fs
