// See run_dir.h.
#include "index/run_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <iterator>

#include "index/dcp_scan.h"

namespace ucpfs::index {

Result<RunCheckpoints> FindRunCheckpoints(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return IoError("list " + dir, errno);
  DIR* d = fdopendir(fd);
  if (d == nullptr) {
    const int err = errno;
    close(fd);
    return IoError("list " + dir, err);
  }
  std::vector<std::string> names;
  while (const dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name.empty() || name[0] == '.') continue;
    struct stat st = {};
    if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode)) continue;
    names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  RunCheckpoints out;
  static const char* const kMarkers[] = {".metadata", "__0.metadata", "latest", "latest_checkpointed_iteration.txt",
                                         "mp_rank_00_model_states.pt", "trainer_state.json"};
  for (const std::string& name : names) {
    const int sub = openat(dirfd(d), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (sub < 0) continue;
    std::vector<std::string> markers(std::begin(kMarkers), std::end(kMarkers));
    struct stat any = {};
    if (std::none_of(std::begin(kMarkers), std::end(kMarkers),
                     [&](const char* m) { return fstatat(sub, m, &any, AT_SYMLINK_NOFOLLOW) == 0; })) {
      // One checkpoint saved as several DCP directories (Accelerate's save_state folder): its
      // first part's metadata.
      for (const std::string& part : DcpCompositeParts(dir + "/" + name)) markers.push_back(part + "/.metadata");
    }
    for (const std::string& marker : markers) {
      struct stat st = {};
      if (fstatat(sub, marker.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) continue;
      if (out.checkpoints.size() >= kMaxRunCheckpoints) {
        ++out.n_left_out;
      } else {
        out.checkpoints.push_back({name, marker, static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec});
      }
      break;
    }
    close(sub);
  }
  closedir(d);
  std::stable_sort(out.checkpoints.begin(), out.checkpoints.end(), [](const RunCheckpoint& a, const RunCheckpoint& b) {
    return a.marker_mtime_ns != b.marker_mtime_ns ? a.marker_mtime_ns < b.marker_mtime_ns : a.name < b.name;
  });
  return out;
}

}  // namespace ucpfs::index
