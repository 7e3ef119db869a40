// StagedCopyRemover: the file system side of removing an s3:// mount's uploaded staged copies
// (BucketUploader decides which copies are due and when; bucket_uploader.h).
//
// A copy is removed only while it is still the uploaded version (inode, size, mtime): its name is
// moved into STATE first and checked there, so a file renamed onto the name meanwhile is put back,
// never lost (or, when the name was taken again, kept in STATE under a name of its own, logged).
// Then its directories, each while empty and not known to the mount (dir_in_use: the kernel may
// still create in one through a name or descriptor it holds, and that create would fail with
// ENOENT); a directory known to the mount is remembered (at most kMaxKeptDirs) and tried again by
// RetryKeptDirs once it is no longer known. At Stop (at_stop) every empty one goes. Never the
// staging root.
//
// Thread-safety: Remove and RetryKeptDirs from one thread at a time (the uploader's, then Stop's);
// SetDirInUse from any thread.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <set>
#include <string>

namespace ucpfs::io {

class StagedCopyRemover {
 public:
  static constexpr size_t kMaxKeptDirs = 4096;

  struct Version {
    uint64_t ino = 0, size = 0;
    int64_t mtime_ns = 0;
    bool operator==(const Version&) const = default;
  };

  // The descriptors stay the caller's and must outlive this; the names are for messages.
  StagedCopyRemover(int stage_fd, int state_fd, std::string stage_dir, std::string state_dir,
                    std::function<void(const std::string&)> log)
      : stage_fd_(stage_fd), state_fd_(state_fd), stage_dir_(std::move(stage_dir)), state_dir_(std::move(state_dir)),
        log_(std::move(log)) {}

  // Removes the copy at `path` (relative to the staging root) when it is still `version`, then its
  // directories as above; whether the copy was removed.
  bool Remove(const std::string& path, const Version& version, bool at_stop);
  // The directories kept because the mount knew them: removed now where it no longer does (all
  // at Stop), when still empty.
  void RetryKeptDirs(bool at_stop);
  bool HasKeptDirs() const { return !kept_dirs_.empty(); }
  // Whether an empty staging directory (its st_dev, st_ino) is still known to the mount. Unset:
  // none is. Returns once no earlier function is being called.
  void SetDirInUse(std::function<bool(dev_t, ino_t)> dir_in_use);

 private:
  bool DirInUse(const std::string& dir);
  void RemoveEmptyDirs(std::string dir, bool at_stop);

  const int stage_fd_;
  const int state_fd_;
  const std::string stage_dir_;
  const std::string state_dir_;
  const std::function<void(const std::string&)> log_;
  std::mutex dir_in_use_mu_;  // held while dir_in_use_ is called or set
  std::function<bool(dev_t, ino_t)> dir_in_use_;
  std::set<std::string> kept_dirs_;
};

}  // namespace ucpfs::io
