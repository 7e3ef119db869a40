/* null_fuse_server: the FUSE ceiling of this machine for read_path_bench.py. A libfuse low-level
 * server with one read-only file, /zeros, of SIZE bytes whose reads are answered from one static
 * buffer of zeros: no computation and no source read, so `cat` of it measures only the kernel's
 * request round trips and copies. It is configured as the ucpfs daemon is (max_read 1 MiB, the
 * same loop and capabilities, no splice), so the two differ only in the work behind a read.
 *
 *   cc -O2 -o null_fuse_server null_fuse_server.c $(pkg-config --cflags --libs fuse3)
 *   ./null_fuse_server MNT SIZE &     # serves until unmounted (fusermount3 -u MNT)
 */
#define FUSE_USE_VERSION 312
#include <errno.h>
#include <fuse_lowlevel.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const fuse_ino_t kFileIno = 2;
static unsigned long long g_size;
static char g_zeros[1 << 20];

static void Stat(fuse_ino_t ino, struct stat* st) {
  memset(st, 0, sizeof *st);
  st->st_ino = ino;
  if (ino == FUSE_ROOT_ID) {
    st->st_mode = S_IFDIR | 0555;
    st->st_nlink = 2;
  } else {
    st->st_mode = S_IFREG | 0444;
    st->st_nlink = 1;
    st->st_size = (off_t)g_size;
  }
}

static void OpInit(void* userdata, struct fuse_conn_info* conn) {
  (void)userdata;
  conn->max_read = sizeof g_zeros;
  conn->max_readahead = sizeof g_zeros;
  conn->want |= FUSE_CAP_ASYNC_READ & conn->capable;
  conn->want &= ~(unsigned)(FUSE_CAP_SPLICE_READ | FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE);
}

static void OpLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (parent != FUSE_ROOT_ID || strcmp(name, "zeros") != 0) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  struct fuse_entry_param e;
  memset(&e, 0, sizeof e);
  e.ino = kFileIno;
  e.attr_timeout = e.entry_timeout = 3600.0;
  Stat(kFileIno, &e.attr);
  fuse_reply_entry(req, &e);
}

static void OpGetattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info* fi) {
  (void)fi;
  if (ino != FUSE_ROOT_ID && ino != kFileIno) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  struct stat st;
  Stat(ino, &st);
  fuse_reply_attr(req, &st, 3600.0);
}

static void OpOpen(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info* fi) {
  if (ino != kFileIno) {
    fuse_reply_err(req, EISDIR);
    return;
  }
  fi->keep_cache = 1; /* as ucpfs opens a view */
  fuse_reply_open(req, fi);
}

static void OpRead(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info* fi) {
  (void)ino;
  (void)fi;
  size_t n = 0;
  if ((unsigned long long)off < g_size) {
    n = size < sizeof g_zeros ? size : sizeof g_zeros;
    if (g_size - (unsigned long long)off < n) n = (size_t)(g_size - (unsigned long long)off);
  }
  fuse_reply_buf(req, g_zeros, n);
}

static const struct fuse_lowlevel_ops kOps = {
    .init = OpInit, .lookup = OpLookup, .getattr = OpGetattr, .open = OpOpen, .read = OpRead,
};

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s MNT SIZE\n", argv[0]);
    return 2;
  }
  g_size = strtoull(argv[2], NULL, 10);
  char* fargv[] = {argv[0], "-o", "ro", "-o", "max_read=1048576", "-o", "fsname=nullfuse", NULL};
  struct fuse_args args = FUSE_ARGS_INIT(7, fargv);
  struct fuse_session* se = fuse_session_new(&args, &kOps, sizeof kOps, NULL);
  if (se == NULL) return 1;
  if (fuse_set_signal_handlers(se) != 0 || fuse_session_mount(se, argv[1]) != 0) return 1;
  struct fuse_loop_config* config = fuse_loop_cfg_create();
  fuse_loop_cfg_set_clone_fd(config, 0);
  fuse_loop_cfg_set_max_threads(config, 16); /* ucpfs's default */
  const int rc = fuse_session_loop_mt(se, config);
  fuse_loop_cfg_destroy(config);
  fuse_session_unmount(se);
  fuse_remove_signal_handlers(se);
  fuse_session_destroy(se);
  return rc < 0 ? 1 : 0;
}
