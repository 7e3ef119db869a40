// Materializer: view files computed once into a bounded cache directory (`ucpfs mount
// --materialize DIR --materialize-size N`), so later opens are served by the kernel straight
// from the cached file (FUSE passthrough, fuse_mount.cc): warm reads and mmap then run on the
// backing file system's page cache, never through the daemon. Knows no FUSE types.
//
// Not for: deciding whether an open may pass through (fuse_mount.cc does: the kernel's rules on
// mixing modes), views' bytes (their ByteSource computes them).
//
// Invariants:
// - A cached file belongs to one view file of one generation: the entry is keyed by the view's
//   node and holds a weak reference to the tree that node is part of, so a new generation (a
//   new tree), or a dynamic subtree built again, misses and computes afresh; nothing of a
//   replaced generation is ever served.
// - The directory is untrusted like everything on disk: it must be a real directory (no
//   symlink followed) owned by the daemon's user, and is made mode 0700; every file is made
//   with O_CREAT|O_EXCL|O_NOFOLLOW beneath it (openat on its descriptor). Files this process
//   did not make there are not read: names of an earlier daemon (`ucpfs-view-*`) are removed at
//   start, others left alone.
// - The cache holds at most max_bytes of finished files: least recently opened out (unlinked;
//   a file still passed through stays readable through its open descriptors); copies whose
//   tree is gone go before any other. A view larger than max_bytes is not materialised
//   (kUnsupported).
//
// Thread-safety: every method may be called from any thread. Builds of different views run at
// once; two opens of one view being built wait for the one build.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <nlohmann/json.hpp>

#include "core/byte_source.h"
#include "core/status.h"

namespace ucpfs::fs {

class Materializer {
 public:
  // Errors: kInvalidArgument (max_bytes 0; DIR a symlink, not a directory, or owned by another
  // user), kIo naming DIR. `read_ahead_bytes`: how far ahead of a build's reads the source is
  // announced (ByteSource::Prefetch, as --prefetch does for reads through the mount; 0: not).
  static Result<std::unique_ptr<Materializer>> Make(const std::string& dir, uint64_t max_bytes,
                                                    uint64_t read_ahead_bytes = 0);
  ~Materializer();

  // A read-only descriptor (the caller closes it) of the file holding `source`'s bytes, the view
  // file `node` (its identity: an aliasing pointer owned by the tree it belongs to). Computed now
  // when not cached. Errors: kUnsupported (larger than the cache), the source's read errors, kIo
  // (writing the cache, naming the file).
  Result<int> Open(const std::shared_ptr<const void>& node, const ByteSource& source);

  // {"dir", "max_bytes", "bytes", "files", "builds", "hits", "evictions"}.
  nlohmann::ordered_json Stats() const;

 private:
  struct Entry {
    std::weak_ptr<const void> node;
    std::string name;  // in dir_
    uint64_t n_bytes = 0;
    bool ready = false;     // built; false while being built
    std::list<const void*>::iterator lru;
  };
  Materializer(int dir_fd, std::string dir, uint64_t max_bytes, uint64_t read_ahead_bytes);
  // Computes `source` into a new file; returns its name. No lock held.
  Result<std::string> Build(const ByteSource& source, uint64_t id);
  // Unlinks least recently used ready entries until `n_bytes` more fit. mu_ held.
  void MakeRoom(uint64_t n_bytes);
  void Drop(std::map<const void*, Entry>::iterator it);  // mu_ held

  const int dir_fd_;
  const std::string dir_;
  const uint64_t max_bytes_;
  const uint64_t read_ahead_bytes_;
  mutable std::mutex mu_;
  std::condition_variable built_;
  std::map<const void*, Entry> entries_;  // guarded by mu_
  std::list<const void*> lru_;            // most recent at the front; ready entries; mu_
  uint64_t n_bytes_ = 0;                  // of ready and reserved entries; mu_
  uint64_t next_id_ = 0;                  // mu_
  uint64_t n_builds_ = 0, n_hits_ = 0, n_evictions_ = 0;  // mu_
};

}  // namespace ucpfs::fs
