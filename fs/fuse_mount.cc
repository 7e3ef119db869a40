// Serves a Filesystem through the libfuse3 low-level API (multi-threaded loop). See
// fuse_mount.h.
//
// Not for: what is served (filesystem.cc), building the namespace (tree.cc, namespace.cc) or
// producing file bytes (ByteSource openers).
//
// The request handlers and the session's state are fuse_server.h's (with their invariants);
// this file mounts, runs the session loop, and unmounts.
#include "fs/fuse_mount.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "fs/direct_mount.h"
#include "fs/errno_map.h"
#include "fs/filesystem.h"
#include "fs/fuse_server.h"
#include "fs/passthrough.h"

extern char** environ;

namespace ucpfs::fs {
namespace {

using namespace fuse_server;  // NOLINT: the server's own state and handlers

// ---- /dev/fuse I/O: FUSE_PARALLEL_DIROPS reaches the kernel ----
//
// libfuse before 3.17 (commit c9905341, "Pass FUSE_PARALLEL_DIROPS to kernel") enables
// FUSE_CAP_PARALLEL_DIROPS in conn->want but never sets the flag in its INIT reply, so the
// kernel takes a per-directory mutex around every lookup and readdir (fuse_lock_inode): one
// slow lookup, such as a large layout built in target/, makes every other lookup in that
// directory wait for it (measured: 2.3 s for a lookup of another layout beside a 4096-rank
// build). The session's reads and writes go through these hooks (fuse_session_custom_io on the
// fd fuse_session_mount opened); they only note the INIT request and set the flag in the INIT
// reply when the kernel offered it (OpInit always asks for it). Every other message passes as is.
// Wire layout (linux/fuse.h, which libfuse does not install): fuse_in_header is
// {u32 len, u32 opcode, u64 unique, ...} (40 bytes), fuse_out_header {u32 len, i32 error,
// u64 unique} (16 bytes), fuse_init_in and fuse_init_out both start {u32 major, u32 minor,
// u32 max_readahead, u32 flags}. libfuse 3.17 and later send the flag themselves.
#if FUSE_VERSION < FUSE_MAKE_VERSION(3, 17)
#define UCPFS_PATCH_PARALLEL_DIROPS 1
constexpr uint32_t kFuseInitOpcode = 26;
constexpr uint32_t kFuseParallelDirops = 1u << 18;
constexpr size_t kInHeaderBytes = 40;
constexpr size_t kOutHeaderBytes = 16;
constexpr size_t kInitFlagsOffset = 12;

ssize_t DeviceRead(int fd, void* buf, size_t buf_len, void* userdata) {
  const ssize_t n = ::read(fd, buf, buf_len);
  if (n >= static_cast<ssize_t>(kInHeaderBytes + kInitFlagsOffset + 4)) {
    const auto* bytes = static_cast<const unsigned char*>(buf);
    uint32_t opcode = 0;
    std::memcpy(&opcode, bytes + 4, 4);
    if (opcode == kFuseInitOpcode) {
      auto& server = *static_cast<Server*>(userdata);
      uint64_t unique = 0;
      uint32_t flags = 0;
      std::memcpy(&unique, bytes + 8, 8);
      std::memcpy(&flags, bytes + kInHeaderBytes + kInitFlagsOffset, 4);
      server.kernel_parallel_dirops.store((flags & kFuseParallelDirops) != 0);
      server.init_unique.store(unique);
    }
  }
  return n;  // errno is read()'s: libfuse looks at it
}

ssize_t DeviceWritev(int fd, struct iovec* iov, int count, void* userdata) {
  auto& server = *static_cast<Server*>(userdata);
  const uint64_t init_unique = server.init_unique.load();
  // The INIT reply: libfuse sends it as {out header, fuse_init_out}.
  if (init_unique != 0 && count == 2 && iov[0].iov_len == kOutHeaderBytes &&
      iov[1].iov_len >= kInitFlagsOffset + 4) {
    uint64_t unique = 0;
    int32_t error = 0;
    std::memcpy(&error, static_cast<const char*>(iov[0].iov_base) + 4, 4);
    std::memcpy(&unique, static_cast<const char*>(iov[0].iov_base) + 8, 8);
    if (unique == init_unique && error == 0 && server.kernel_parallel_dirops.load()) {
      server.init_unique.store(0);
      std::vector<char> init_out(static_cast<const char*>(iov[1].iov_base),
                                 static_cast<const char*>(iov[1].iov_base) + iov[1].iov_len);
      uint32_t flags = 0;
      std::memcpy(&flags, init_out.data() + kInitFlagsOffset, 4);
      flags |= kFuseParallelDirops;
      std::memcpy(init_out.data() + kInitFlagsOffset, &flags, 4);
      struct iovec patched[2] = {iov[0], {init_out.data(), init_out.size()}};
      return ::writev(fd, patched, 2);
    }
  }
  return ::writev(fd, iov, count);
}
#endif  // FUSE_VERSION < 3.17

// ---- mounting ----

// libfuse splits -o values on ',' and treats '\' as an escape.
std::string EscapeOptionValue(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == ',' || c == '\\') out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

// Finds "max_read=N" among the comma-separated options; 0 when absent.
Result<uint32_t> MaxReadFromOptions(const std::vector<std::string>& options) {
  uint32_t max_read = 0;
  for (const std::string& group : options) {
    std::string_view rest = group;
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      const std::string_view opt = rest.substr(0, comma);
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
      constexpr std::string_view kKey = "max_read=";
      if (!opt.starts_with(kKey)) continue;
      const std::string_view value = opt.substr(kKey.size());
      uint32_t parsed = 0;
      const auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), parsed);
      if (ec != std::errc() || ptr != value.data() + value.size() || parsed == 0) {
        return InvalidArgumentError("bad mount option '" + std::string(opt) + "'");
      }
      max_read = parsed;
    }
  }
  return max_read;
}

// Runs once the session loop is up: waits until the mount answers (stat of its root goes
// through INIT and GETATTR), raises the mount's readahead window to the request size (the
// kernel sets the bdi's window at INIT, so it can only be raised afterwards; needs root, else
// silently skipped), then signals readiness on ready_fd (see MountOptions::ready_fd).
// Returns 0 once live, else the errno of the failed stat.
int AnnounceWhenLive(const std::string& mountpoint, int ready_fd, uint32_t readahead_bytes) {
  // Signals belong to the loop threads (libfuse's handlers end the session).
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);

  struct stat st = {};
  int rc;
  do {
    rc = stat(mountpoint.c_str(), &st);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return errno;
  const std::string bdi = "/sys/class/bdi/" + std::to_string(major(st.st_dev)) + ":" +
                          std::to_string(minor(st.st_dev)) + "/read_ahead_kb";
  if (FILE* f = std::fopen(bdi.c_str(), "w")) {
    std::fprintf(f, "%u\n", readahead_bytes / 1024);
    std::fclose(f);
  }
  if (ready_fd >= 0) {
    const char byte = 'R';
    while (write(ready_fd, &byte, 1) < 0 && errno == EINTR) {
    }
    // Release the pipe but keep the number valid: it belongs to the caller.
    const int devnull = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (devnull >= 0) {
      dup3(devnull, ready_fd, O_CLOEXEC);
      close(devnull);
    }
  }
  return 0;
}

}  // namespace

Status ServeTree(std::shared_ptr<const Tree> tree, const MountOptions& options) {
  // Failures before the mount is live leave options.ready_fd untouched (the caller reports).
  if (tree == nullptr) return InvalidArgumentError("ServeTree: no tree");
  const std::string& mountpoint = options.mountpoint;
  if (mountpoint.empty()) return InvalidArgumentError("no mountpoint given");
  struct stat st = {};
  if (stat(mountpoint.c_str(), &st) != 0) {
    const int err = errno;
    return Status(StatusCode::kInvalidArgument,
                  "mountpoint " + mountpoint + ": " + std::strerror(err), err);
  }
  if (!S_ISDIR(st.st_mode)) {
    return Status(StatusCode::kInvalidArgument,
                  "mountpoint " + mountpoint + ": not a directory", ENOTDIR);
  }
  Result<uint32_t> user_max_read = MaxReadFromOptions(options.fuse_options);
  if (!user_max_read.ok()) return user_max_read.error();

  FilesystemOptions fs_options;
  fs_options.uid = getuid();
  fs_options.gid = getgid();
  fs_options.dynamic_dir = options.dynamic_dir;
  fs_options.resolve = options.resolve;
  fs_options.list = options.list;
  fs_options.passthrough = options.passthrough;
  fs_options.bucket = options.passthrough ? options.bucket : nullptr;
  fs_options.read_ahead_bytes = options.source_read_ahead_bytes;
  fs_options.report = options.report;
  Server server;
  UCPFS_ASSIGN_OR_RETURN(server.fs, Filesystem::Make(std::move(tree), std::move(fs_options)));
#ifdef UCPFS_HAVE_PASSTHROUGH
  server.passthrough_wanted = options.kernel_passthrough;
#endif
  server.materialize = options.materialize;
  server.report = options.report;
  if (server.report && server.materialize) {
    server.report->SetMaterializeStats([m = server.materialize] { return m->Stats(); });
  }
  server.max_read_bytes = *user_max_read != 0 ? *user_max_read : kDefaultMaxReadBytes;
  // Spliced replies need a pipe that holds a whole reply (see "spliced replies").
  if (SpliceRepliesOff()) {
    server.splice_why = "turned off (UCPFS_READ_PATH in the environment)";
  } else if (!options.spliceable_sources) {
    server.splice_why = "the sources are not local files";
  } else {
    const size_t pipe_bytes = PipeCapacityBytes(server.max_read_bytes + kSpliceSlackBytes);
    if (pipe_bytes < server.max_read_bytes + kSpliceSlackBytes && *user_max_read == 0 &&
        pipe_bytes >= kMinSplicedMaxReadBytes + kSpliceSlackBytes) {
      server.max_read_bytes = static_cast<uint32_t>((pipe_bytes - kSpliceSlackBytes) & ~size_t{0xffff});
    }
    if (pipe_bytes >= server.max_read_bytes + kSpliceSlackBytes) {
      // Slots a reply may take besides its payload's pages: the header, and per piece up to two
      // partial pages of its own and one of the memory buffer after it.
      const size_t spare_slots = (pipe_bytes - server.max_read_bytes) / kPipePageBytes;
      server.max_spliced_pieces = std::min(kMaxSplicedPieces, (spare_slots - 3) / 3);
      server.splice_wanted = true;
    } else {
      server.splice_why = "a pipe of " + std::to_string(pipe_bytes) + " bytes cannot hold a reply of max_read " +
                          std::to_string(server.max_read_bytes) +
                          " (fs.pipe-max-size, or CAP_SYS_RESOURCE, would allow a larger pipe)";
    }
  }
  const uint32_t readahead_bytes = options.readahead_bytes != 0 ? options.readahead_bytes : server.max_read_bytes;
  server.max_background = MaxBackground(readahead_bytes, server.max_read_bytes);
  if (options.started) options.started(server.fs.get());

  std::vector<std::string> arg_strings = {
      "ucpfs",
      "-o", "fsname=" + EscapeOptionValue(options.fsname.empty() ? "ucpfs" : options.fsname),
      "-o", "subtype=ucpfs",
      "-o", "default_permissions",
  };
  if (!options.passthrough) arg_strings.insert(arg_strings.end(), {"-o", "ro"});
#if FUSE_VERSION >= FUSE_MAKE_VERSION(3, 18) && UCPFS_LIBFUSE_URING
  // FUSE over io_uring where the kernel offers it (OpInit says whether it did).
  arg_strings.insert(arg_strings.end(), {"-o", "io_uring"});
#endif
  if (*user_max_read == 0) {
    arg_strings.insert(arg_strings.end(),
                       {"-o", "max_read=" + std::to_string(server.max_read_bytes)});
  }
  for (const std::string& opt : options.fuse_options) {
    if (!opt.empty()) arg_strings.insert(arg_strings.end(), {"-o", opt});
  }
  std::vector<char*> argv;
  for (std::string& s : arg_strings) argv.push_back(s.data());
  argv.push_back(nullptr);
  fuse_args args = FUSE_ARGS_INIT(static_cast<int>(arg_strings.size()), argv.data());

  fuse_session* se = fuse_session_new(&args, &kOps, sizeof(kOps), &server);
  fuse_opt_free_args(&args);
  if (se == nullptr) {
    std::string joined;
    for (const std::string& opt : options.fuse_options) joined += " -o " + opt;
    return InvalidArgumentError("fuse_session_new failed (bad mount option?):" + joined);
  }
  if (fuse_set_signal_handlers(se) != 0) {
    fuse_session_destroy(se);
    return InternalError("fuse_set_signal_handlers failed");
  }
  // As root, mount(2) here and give libfuse the descriptor (direct_mount.h): no mount(8) run.
  DirectMountRequest direct;
  direct.mountpoint = mountpoint;
  direct.fsname = options.fsname.empty() ? "ucpfs" : options.fsname;
  direct.subtype = "ucpfs";
  // "ro" (a read-only mount: no write capture) is MS_RDONLY, which DirectMount sets itself; any
  // other option is the user's, whose split into kernel and session options is libfuse's.
  const bool ro = std::find(options.fuse_options.begin(), options.fuse_options.end(), "ro") != options.fuse_options.end();
  direct.read_only = !options.passthrough || ro;
  direct.max_read_bytes = server.max_read_bytes;
  direct.user_options = std::any_of(options.fuse_options.begin(), options.fuse_options.end(),
                                    [](const std::string& o) { return !o.empty() && o != "ro"; });
  const int direct_fd = DirectMount(direct);
  const std::string session_mountpoint = direct_fd >= 0 ? "/dev/fd/" + std::to_string(direct_fd) : mountpoint;
  errno = 0;
  if (fuse_session_mount(se, session_mountpoint.c_str()) != 0) {
    const int err = errno != 0 ? errno : EIO;
    if (direct_fd >= 0) {
      DirectUnmount(direct_fd, mountpoint);
      ::close(direct_fd);
    }
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    return IoError("mounting at " + mountpoint + " failed", err);
  }
#ifdef UCPFS_PATCH_PARALLEL_DIROPS
  // Same fd, libfuse's own mount and unmount: only the reads and writes go through the hooks.
  const fuse_custom_io device_io = {.writev = DeviceWritev, .read = DeviceRead, .splice_receive = nullptr,
                                    .splice_send = nullptr};
  if (const int rc = fuse_session_custom_io(se, &device_io, fuse_session_fd(se)); rc != 0) {
    fuse_session_unmount(se);
    if (direct_fd >= 0) DirectUnmount(direct_fd, mountpoint);
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    return IoError("fuse_session_custom_io failed", -rc);
  }
#endif

  int announce_errno = EIO;
  std::thread announcer([&] {
    announce_errno = AnnounceWhenLive(mountpoint, options.ready_fd, readahead_bytes);
  });

  fuse_loop_config* config = fuse_loop_cfg_create();
  fuse_loop_cfg_set_clone_fd(config, 0);
  fuse_loop_cfg_set_max_threads(config, static_cast<unsigned>(std::max(1, options.max_threads)));
  // max_idle_threads stays at libfuse's default (-1: idle workers are kept, never re-spawned
  // per request burst; libfuse discourages other values).
  const int loop_rc = fuse_session_loop_mt(se, config);
  fuse_loop_cfg_destroy(config);

  fuse_session_unmount(se);  // nothing, for a direct mount (libfuse never knew its path)
  if (direct_fd >= 0) DirectUnmount(direct_fd, mountpoint);
  fuse_remove_signal_handlers(se);
  // Closing /dev/fuse aborts the connection, so an announcer still waiting in stat() returns.
  fuse_session_destroy(se);
  announcer.join();
  // The builds read the views' sources: stopped before the Filesystem goes (the caller may
  // keep the Materializer itself).
  if (server.materialize) server.materialize->Stop();
  server.handles.DestroyAll();  // files still open at unmount get no RELEASE

  // loop_rc > 0 is the signal that ended the session (SIGINT/SIGTERM): a clean shutdown.
  if (loop_rc < 0) return IoError("serving " + mountpoint + " failed", -loop_rc);
  if (announce_errno != 0) {
    return IoError("the mount at " + mountpoint + " never answered: " +
                       std::strerror(announce_errno),
                   announce_errno);
  }
  return Status::Ok();
}

std::string LinkedFuseText() {
  std::string text = std::string("libfuse ") + fuse_pkgversion();
  std::vector<std::string> paths;
#ifdef UCPFS_HAVE_PASSTHROUGH
  paths.push_back("passthrough");
#endif
#if FUSE_VERSION >= FUSE_MAKE_VERSION(3, 18) && UCPFS_LIBFUSE_URING
  paths.push_back("io_uring");
#endif
  if (paths.empty()) return text + " (the kernel's fast paths off: passthrough needs libfuse >= 3.17, io_uring >= 3.18)";
  text += " (fast paths: ";
  for (size_t i = 0; i < paths.size(); ++i) text += (i == 0 ? "" : ", ") + paths[i];
  return text + "; each used where the kernel offers it)";
}

Status Unmount(const std::string& mountpoint) {
  if (umount2(mountpoint.c_str(), 0) == 0) return Status::Ok();
  const int err = errno;
  // Not root (EPERM), or a mount only fusermount3 may remove: let the setuid helper try.
  if (err != EBUSY && err != EINVAL && err != EPERM) {
    return IoError("unmounting " + mountpoint + ": " + std::strerror(err), err);
  }
  std::string target = mountpoint;
  if (!target.empty() && target[0] == '-') target = "./" + target;  // not an option
  std::string prog = "fusermount3", flag = "-u";
  char* argv[] = {prog.data(), flag.data(), target.data(), nullptr};
  pid_t pid = 0;
  const int spawn_err = posix_spawnp(&pid, "fusermount3", nullptr, nullptr, argv, environ);
  if (spawn_err != 0) {
    return IoError("unmounting " + mountpoint + ": " + std::strerror(err) +
                       "; cannot run fusermount3: " + std::strerror(spawn_err),
                   err);
  }
  int wstatus = 0;
  while (waitpid(pid, &wstatus, 0) < 0) {
    if (errno != EINTR) return IoError("unmounting " + mountpoint + ": waitpid", errno);
  }
  if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) return Status::Ok();
  return IoError("unmounting " + mountpoint + ": " + std::strerror(err) +
                     "; fusermount3 -u failed too",
                 err);
}

}  // namespace ucpfs::fs
