// NameOps: the namespace changes write capture makes in SRC (create a part, rename it into place,
// unlink, mkdir) and the fsyncs that make them durable, behind one seam so a test can watch them:
//   - RealNameOps(): the system calls, one each (what every mount uses);
//   - MakeFaultNameOps(plan): the same calls, each counted as an op of a FaultPlan (so a power cut
//     can fall between a rename and the fsync of its directory) and, once the plan tracks unsynced
//     state, remembered until a directory they changed is fsync'd; FaultPlan::DropUnsynced then
//     undoes the rest, as a power cut may (the model: io_engine.h, FaultPlan).
// Not for: file bytes (IoEngine), or opening what exists (callers open files themselves).
//
// Every method is the system call of the same name, with its return value and errno (-1 and
// errno on failure), so call sites read as the syscalls they are. Thread-safe.
#pragma once

#include <sys/types.h>

#include <memory>

namespace ucpfs::io {

class FaultPlan;

class NameOps {
 public:
  virtual ~NameOps() = default;
  // openat(dirfd, name, flags | O_CREAT, mode): a file that may be new.
  virtual int CreateAt(int dirfd, const char* name, int flags, mode_t mode) = 0;
  virtual int RenameAt(int old_dirfd, const char* old_name, int new_dirfd, const char* new_name, unsigned flags) = 0;
  virtual int UnlinkAt(int dirfd, const char* name, int flags) = 0;
  virtual int MkdirAt(int dirfd, const char* name, mode_t mode) = 0;
  // fsync of a directory (makes the changes of its entries durable) or of a file.
  virtual int Fsync(int fd) = 0;
};

// The system calls. Never null.
std::shared_ptr<NameOps> RealNameOps();

// The system calls under `plan`'s power cuts (see the header comment). Tests only.
std::shared_ptr<NameOps> MakeFaultNameOps(std::shared_ptr<FaultPlan> plan);

}  // namespace ucpfs::io
