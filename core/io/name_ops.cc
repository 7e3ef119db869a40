// The real NameOps: one system call each (see name_ops.h). The fault-injecting one is in
// fault_engine.cc, beside the FaultPlan it reports to.
#include "core/io/name_ops.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace ucpfs::io {
namespace {

class RealNames final : public NameOps {
 public:
  int CreateAt(int dirfd, const char* name, int flags, mode_t mode) override {
    return openat(dirfd, name, flags | O_CREAT, mode);
  }
  int RenameAt(int old_dirfd, const char* old_name, int new_dirfd, const char* new_name, unsigned flags) override {
    return renameat2(old_dirfd, old_name, new_dirfd, new_name, flags);
  }
  int UnlinkAt(int dirfd, const char* name, int flags) override { return unlinkat(dirfd, name, flags); }
  int MkdirAt(int dirfd, const char* name, mode_t mode) override { return mkdirat(dirfd, name, mode); }
  int Fsync(int fd) override { return fsync(fd); }
};

}  // namespace

std::shared_ptr<NameOps> RealNameOps() {
  static const std::shared_ptr<NameOps> real = std::make_shared<RealNames>();
  return real;
}

}  // namespace ucpfs::io
