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

void MountReport::SetKernel(Kernel kernel) {
  std::lock_guard lock(mu_);
  kernel_ = std::move(kernel);
}

void MountReport::CountPassthroughOpen(bool view) {
  (view ? n_passthrough_view_opens_ : n_passthrough_source_opens_).fetch_add(1, std::memory_order_relaxed);
}

void MountReport::SetMaterializeStats(std::function<nlohmann::ordered_json()> stats) {
  std::lock_guard lock(mu_);
  materialize_stats_ = std::move(stats);
}

void MountReport::AddTo(nlohmann::ordered_json& out) const {
  out["views"] = {{"reads", n_view_reads_.load(std::memory_order_relaxed)},
                  {"bytes_read", n_view_bytes_.load(std::memory_order_relaxed)}};
  nlohmann::ordered_json last = nlohmann::ordered_json::array();
  nlohmann::ordered_json kernel;
  {
    std::lock_guard lock(mu_);
    for (const std::string& m : last_) last.push_back(m);
    kernel["libfuse"] = kernel_.libfuse;
    kernel["passthrough"] = kernel_.passthrough ? "on" : "off: " + kernel_.passthrough_why;
    kernel["io_uring"] = kernel_.io_uring ? "on" : "off: " + kernel_.io_uring_why;
    kernel["splice"] = kernel_.splice ? "on" : "off: " + kernel_.splice_why;
    kernel["max_background"] = kernel_.max_background;
    kernel["passthrough_opens"] = {{"source", n_passthrough_source_opens_.load(std::memory_order_relaxed)},
                                   {"views", n_passthrough_view_opens_.load(std::memory_order_relaxed)}};
    kernel["io_uring_requests"] = n_uring_requests_.load(std::memory_order_relaxed);
    kernel["spliced"] = {{"replies", n_spliced_replies_.load(std::memory_order_relaxed)},
                         {"bytes", n_spliced_bytes_.load(std::memory_order_relaxed)}};
    if (materialize_stats_) kernel["materialize"] = materialize_stats_();
  }
  out["errors"] = {{"count", n_errors_.load(std::memory_order_relaxed)}, {"last", std::move(last)}};
  out["kernel"] = std::move(kernel);
}

}  // namespace ucpfs::fs
