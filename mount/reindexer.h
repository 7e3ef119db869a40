// The re-indexer of a mount: after saves into the mount, it indexes the source again in the
// background and swaps the mount's views to the new generation (fs::Filesystem::Swap); and the
// snapshot the served views read, whose source files are opened before a save replaces them.
// Used by the daemon (mount/daemon.cc) only.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/status.h"
#include "fs/filesystem.h"
#include "fs/namespace.h"
#include "fs/tree.h"
#include "index/snapshot.h"

namespace ucpfs::mount {

// The file names whose durability completes a checkpoint. Any durable file triggers a try (a
// `cp -r` of a checkpoint lands in directory order, its pointer not necessarily last), but
// these are tried at once, the rest after a quiet spell.
bool IsCompletionMarker(const std::string& rel);

// Re-indexes the source in the background after saves into the mount and swaps the mount's
// views to the new generation (Filesystem::Swap); the views of an incomplete checkpoint never
// replace complete ones (a failed build keeps the served generation, logged once per reason).
// Once a checkpoint is served, a new generation replaces it only after a completion marker
// changed: a save over it writes its shards first, and an index of the old marker (DCP's
// .metadata) over a mix of new and old shards is valid-looking and wrong.
// One generation of the views, and the snapshot they read (null: no checkpoint yet).
struct Generation {
  std::shared_ptr<fs::Tree> tree;
  fs::NamespaceInfo info;
  std::shared_ptr<const index::Snapshot> snapshot;
  // A run directory's checkpoint with a completion marker that did not open (still being saved:
  // a copy such as `cp -r` may write the marker before the shards). Its marker stays pending, so
  // the generation that opens it once its shards land is served.
  bool incomplete = false;
};

// The snapshot whose views the root serves. Before a save renames a file over one of its source
// files, that file is opened (index::OpenSourceFile), so the served views, and readers who keep
// them, read the bytes indexed even after the next generation replaces them.
class ServedSnapshot {
 public:
  void Set(std::shared_ptr<const index::Snapshot> s) {
    std::lock_guard lock(mu_);
    snapshot_ = std::move(s);
  }
  void BeforeReplace(const std::string& rel) {
    std::shared_ptr<const index::Snapshot> s;
    {
      std::lock_guard lock(mu_);
      s = snapshot_;
    }
    if (s) index::OpenSourceFile(*s, rel);
  }

 private:
  std::mutex mu_;
  std::shared_ptr<const index::Snapshot> snapshot_;  // guarded by mu_
};

class Reindexer {
 public:
  using Build = std::function<Result<Generation>(uint64_t generation)>;
  // `marker_pending`: the first generation is incomplete (Generation::incomplete).
  Reindexer(Build build, bool serving_checkpoint, bool marker_pending, std::shared_ptr<ServedSnapshot> served)
      : build_(std::move(build)), marker_changed_(marker_pending), serving_checkpoint_(serving_checkpoint),
        served_(std::move(served)), thread_([this] { Loop(); }) {}
  ~Reindexer() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Attach(fs::Filesystem* filesystem) {
    std::lock_guard lock(mu_);
    fs_ = filesystem;
  }
  void Detach() { Attach(nullptr); }
  // A file became durable (or was renamed or removed) at `rel` beneath the source.
  void Changed(const std::string& rel) {
    {
      std::lock_guard lock(mu_);
      dirty_ = true;
      const bool marker = IsCompletionMarker(rel);
      urgent_ = urgent_ || marker;
      marker_changed_ = marker_changed_ || marker;
      last_change_ = std::chrono::steady_clock::now();
    }
    cv_.notify_all();
  }

 private:
  void Loop() {
    std::unique_lock lock(mu_);
    uint64_t generation = 1;
    std::string last_error;
    for (;;) {
      cv_.wait(lock, [&] { return stopping_ || dirty_; });
      if (stopping_) return;
      // Quiet for 200 ms, or a completion marker.
      while (!stopping_ && !urgent_ && std::chrono::steady_clock::now() - last_change_ < std::chrono::milliseconds(200)) {
        cv_.wait_for(lock, std::chrono::milliseconds(50));
      }
      if (stopping_) return;
      dirty_ = false;
      urgent_ = false;
      // Only a marker changed before the build started counts for what it reads.
      const bool marker = marker_changed_;
      marker_changed_ = false;
      lock.unlock();
      const auto t0 = std::chrono::steady_clock::now();
      auto built = build_(generation + 1);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      lock.lock();
      if (!built.ok()) {
        marker_changed_ = marker_changed_ || marker;  // still to be served once complete
        if (built.error().message() != last_error) {
          std::cerr << "ucpfs: views not updated (the source is not a complete checkpoint yet?): "
                    << built.error().ToString() << std::endl;
          last_error = built.error().message();
        }
        continue;
      }
      last_error.clear();
      if (fs_ == nullptr) {
        marker_changed_ = marker_changed_ || marker;
        continue;
      }
      if (serving_checkpoint_ && !marker) continue;  // shards of a save not finished yet
      auto& [tree, info, snapshot, incomplete] = *built;
      const Status swapped = fs_->Swap(std::move(tree), info.target_dir, info.resolve_target, info.list_target);
      if (!swapped.ok()) {
        std::cerr << "ucpfs: views not updated: " << swapped.ToString() << std::endl;
        continue;
      }
      ++generation;
      serving_checkpoint_ = true;
      // Served, but a run checkpoint whose marker arrived is not in it yet: its remaining
      // shards becoming durable (no marker change) must still bring it in.
      if (incomplete) marker_changed_ = true;
      served_->Set(std::move(snapshot));
      std::cerr << "ucpfs: generation " << generation << ": views of " << info.source_dir << " rebuilt in "
                << seconds << " s (" << info.n_atomic_files << " atomic files)" << std::endl;
    }
  }

  Build build_;
  std::mutex mu_;
  std::condition_variable cv_;
  fs::Filesystem* fs_ = nullptr;  // guarded by mu_; set while the mount serves
  bool dirty_ = false, urgent_ = false, stopping_ = false;
  bool marker_changed_ = false;  // a completion marker changed since the last build started
  bool serving_checkpoint_;      // the served generation holds a checkpoint (not only .ucpfs/)
  const std::shared_ptr<ServedSnapshot> served_;
  std::chrono::steady_clock::time_point last_change_;
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace ucpfs::mount
