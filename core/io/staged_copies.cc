// See staged_copies.h.
#include "core/io/staged_copies.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/io/beneath.h"

namespace ucpfs::io {

bool StagedCopyRemover::Remove(const std::string& path, const Version& version, bool at_stop) {
  const size_t slash = path.rfind('/');
  const std::string parent = slash == std::string::npos ? "." : path.substr(0, slash);
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  const int dir = OpenBeneath(stage_fd_, parent, O_RDONLY | O_DIRECTORY);
  if (dir < 0) return false;
  bool removed = false;
  struct stat st = {};
  const auto same = [&] {
    return S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_ino) == version.ino &&
           static_cast<uint64_t>(st.st_size) == version.size && MtimeNs(st) == version.mtime_ns;
  };
  static constexpr char kRemoving[] = "removing";
  if (fstatat(dir, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && same() &&
      renameat(dir, name.c_str(), state_fd_, kRemoving) == 0) {
    if (fstatat(state_fd_, kRemoving, &st, AT_SYMLINK_NOFOLLOW) == 0 && same()) {
      removed = unlinkat(state_fd_, kRemoving, 0) == 0;
    } else if (renameat2(state_fd_, kRemoving, dir, name.c_str(), RENAME_NOREPLACE) != 0) {
      // The name was taken again meanwhile: the newer file stays; this one (not uploaded: it was
      // not the uploaded version) is kept in STATE under a name of its own.
      const std::string kept_name = "not-removed." + std::to_string(st.st_ino);
      if (renameat(state_fd_, kRemoving, state_fd_, kept_name.c_str()) == 0 && log_) {
        log_("ucpfs: upload: " + stage_dir_ + "/" + path + " was replaced while its uploaded copy was removed: "
             "the file in between is kept as " + state_dir_ + "/" + kept_name);
      }
    }
  }
  close(dir);
  if (!removed) return false;
  RemoveEmptyDirs(parent, at_stop);
  return true;
}

void StagedCopyRemover::RetryKeptDirs(bool at_stop) {
  for (auto it = kept_dirs_.begin(); it != kept_dirs_.end();) {
    if (!at_stop && DirInUse(*it)) {
      ++it;
      continue;
    }
    const std::string dir = *it;
    it = kept_dirs_.erase(it);
    RemoveEmptyDirs(dir, at_stop);
  }
}

void StagedCopyRemover::SetDirInUse(std::function<bool(dev_t, ino_t)> dir_in_use) {
  std::lock_guard lock(dir_in_use_mu_);
  dir_in_use_ = std::move(dir_in_use);
}

bool StagedCopyRemover::DirInUse(const std::string& dir) {
  struct stat st = {};
  if (fstatat(stage_fd_, dir.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode)) return false;
  std::lock_guard lock(dir_in_use_mu_);
  return dir_in_use_ && dir_in_use_(st.st_dev, st.st_ino);
}

void StagedCopyRemover::RemoveEmptyDirs(std::string dir, bool at_stop) {
  while (dir != "." && !dir.empty()) {
    if (!at_stop && DirInUse(dir)) {
      if (kept_dirs_.size() < kMaxKeptDirs) kept_dirs_.insert(dir);
      return;
    }
    if (unlinkat(stage_fd_, dir.c_str(), AT_REMOVEDIR) != 0) return;
    const size_t s = dir.rfind('/');
    dir = s == std::string::npos ? "." : dir.substr(0, s);
  }
}

}  // namespace ucpfs::io
