// Counts how a file's cached pages are held by the kernel: as order-0 (4 KiB) folios or as
// large folios (compound head + tail pages). Warm reads through FUSE on kernel 6.18 are bounded
// by its page cache being order-0 only (large folios for FUSE reached linux-next in 2026), while
// ext4 caches the same bytes in 2 MiB folios; this shows which one a file gets.
//
//   cc -O2 -o /tmp/page_cache_folios tests/bench/page_cache_folios.c
//   cat FILE >/dev/null; /tmp/page_cache_folios FILE      (root: reads /proc/kpageflags)
//
// Looks at the first 256 MiB: maps the file, touches every page, then reads each page's PFN
// from /proc/self/pagemap and its flags (KPF_COMPOUND_HEAD = 15, KPF_COMPOUND_TAIL = 16) from
// /proc/kpageflags.
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s FILE\n", argv[0]);
    return 2;
  }
  const int fd = open(argv[1], O_RDONLY);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) {
    perror(argv[1]);
    return 1;
  }
  const size_t page = 4096;
  const size_t size = (size_t)st.st_size > ((size_t)256 << 20) ? ((size_t)256 << 20) : (size_t)st.st_size;
  const size_t n_pages = size / page;
  if (n_pages == 0) {
    fprintf(stderr, "%s: smaller than a page\n", argv[1]);
    return 1;
  }
  const volatile char* p = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  for (size_t i = 0; i < n_pages; i++) (void)p[i * page];
  const int pagemap = open("/proc/self/pagemap", O_RDONLY);
  const int kpageflags = open("/proc/kpageflags", O_RDONLY);
  if (pagemap < 0 || kpageflags < 0) {
    perror("/proc/self/pagemap or /proc/kpageflags (run as root)");
    return 1;
  }
  size_t heads = 0, tails = 0, order0 = 0;
  for (size_t i = 0; i < n_pages; i++) {
    uint64_t entry = 0, flags = 0;
    if (pread(pagemap, &entry, 8, (off_t)(((uintptr_t)p / page + i) * 8)) != 8) return 1;
    const uint64_t pfn = entry & ((1ull << 55) - 1);
    if (pread(kpageflags, &flags, 8, (off_t)(pfn * 8)) != 8) return 1;
    if (flags & (1ull << 15)) {
      heads++;
    } else if (flags & (1ull << 16)) {
      tails++;
    } else {
      order0++;
    }
  }
  printf("%s: %zu pages: %zu in large folios (%zu folios), %zu order-0\n", argv[1], n_pages, heads + tails, heads,
         order0);
  return 0;
}
