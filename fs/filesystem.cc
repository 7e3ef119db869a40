// See filesystem.h: the trees of views (lookup, inode lifetime, generations) and view reads.
// Not for: the read-write area's operations (filesystem_rw.cc), FUSE types or replies
// (fuse_mount.cc), building trees (tree.cc, namespace.cc).
#include "fs/filesystem.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <utility>

#include "fs/errno_map.h"

namespace ucpfs::fs {
namespace {

// Subtree slots live in the high 32 bits of an inode number.
constexpr int kSlotShift = 32;
constexpr Ino kLocalInoMask = (Ino{1} << kSlotShift) - 1;
constexpr uint64_t kMaxSlot = (uint64_t{1} << 30) - 1;  // below kPassthroughBit
constexpr size_t kMaxLiveSubtrees = size_t{1} << 20;
// st_blksize: what a disk file says (ext4's 4096). stdio and Python's buffered files size their
// buffer by it, and torch.load reads each record's header through one: at 1 MiB (the largest
// FUSE request, as it was) every header read copied a MiB, and a warm torch.load(mmap=True) of a
// 940 MB rank file took 4.5 ms against 2.1 ms from disk (2.6 ms at 4 KiB). Sequential readers are
// read ahead by the kernel either way: cat (128 KiB reads at least) measured the same.
constexpr blksize_t kStatBlockSize = 4096;
constexpr unsigned long kStatfsBlockSize = 4096;
constexpr unsigned long kNameMax = 255;
constexpr size_t kMaxLoggedDataLoss = 4096;

}  // namespace

Result<std::unique_ptr<Filesystem>> Filesystem::Make(std::shared_ptr<const Tree> tree,
                                                     FilesystemOptions options) {
  if (tree == nullptr) return InvalidArgumentError("Filesystem: no tree");
  if (tree->size() > kLocalInoMask) {
    return InvalidArgumentError("Filesystem: a tree must have fewer than 2^32 nodes");
  }
  if (options.dynamic_dir != 0) {
    const TreeNode* dir = tree->Get(options.dynamic_dir);
    if (dir == nullptr || !dir->is_dir || !options.resolve) {
      return InvalidArgumentError("Filesystem: dynamic_dir is not a directory or has no resolver");
    }
  }
  return std::unique_ptr<Filesystem>(new Filesystem(std::move(tree), std::move(options)));
}

Filesystem::Filesystem(std::shared_ptr<const Tree> tree, FilesystemOptions options)
    : tree_(std::move(tree)), options_(std::move(options)) {}

Filesystem::Current Filesystem::CurrentGeneration() const {
  std::shared_lock lock(mu_);
  if (current_slot_ == 0) return {tree_, 0};
  return {subtrees_.at(current_slot_)->tree, current_slot_ << kSlotShift};
}

Filesystem::Found Filesystem::Find(Ino ino, bool take_reference) const {
  Found f;
  if (Passthrough::Owns(ino)) return f;
  if (ino == kRootIno) {  // the mount's root: the served generation's root (never counted)
    const Current cur = CurrentGeneration();
    f.tree = cur.tree;
    f.base = cur.base;
    f.node = f.tree->Get(kRootIno);
    f.is_root = true;
    return f;
  }
  const uint64_t slot = ino >> kSlotShift;
  std::shared_lock<std::shared_mutex> lock;  // the first generation is pinned: no lock, no count
  if (slot == 0) {
    f.tree = tree_;
  } else {
    lock = std::shared_lock(mu_);
    const auto it = subtrees_.find(slot);
    if (it == subtrees_.end()) return f;
    // A generation's own root is served as kRootIno only.
    if (it->second->is_generation && (ino & kLocalInoMask) == kRootIno) return f;
    f.tree = it->second->tree;
    f.base = slot << kSlotShift;
  }
  f.node = f.tree->Get(ino & kLocalInoMask);
  // Counted under the lock, so an eviction re-checking the count cannot miss it.
  if (take_reference && slot != 0 && f.node != nullptr) {
    subtrees_.at(slot)->n_lookups.fetch_add(1, std::memory_order_relaxed);
  }
  return f;
}

Filesystem::Found Filesystem::ChildOf(const Found& dir, const TreeNode* local) const {
  return {dir.tree, local, dir.base, false};
}

Ino Filesystem::DynamicDirOf(uint64_t generation_slot) const {
  if (generation_slot == 0) return options_.dynamic_dir;
  std::shared_lock lock(mu_);
  const auto it = subtrees_.find(generation_slot);
  if (it == subtrees_.end()) return kRootIno;  // released: ".." goes to the root
  return generation_slot << kSlotShift | it->second->dynamic_dir;
}

Ino Filesystem::GlobalParent(const Found& f) const {
  if (f.is_root) return kRootIno;
  const uint64_t slot = f.base >> kSlotShift;
  bool dynamic_child = false;
  uint64_t generation_slot = 0;
  if (slot != 0) {
    std::shared_lock lock(mu_);
    const auto it = subtrees_.find(slot);
    if (it != subtrees_.end() && !it->second->is_generation) {
      dynamic_child = true;
      generation_slot = it->second->generation_slot;
    }
  }
  if (dynamic_child) {
    return f.node->ino == kRootIno ? DynamicDirOf(generation_slot) : (f.base | f.node->parent);
  }
  // A generation (or the first): children of its root are the mount root's.
  return f.node->parent == kRootIno ? kRootIno : (f.base | f.node->parent);
}

bool Filesystem::IsDynamicDir(const Found& dir, SubtreeResolver* resolve, SubtreeLister* list) const {
  if (dir.base == 0) {
    if (options_.dynamic_dir == 0 || dir.node->ino != options_.dynamic_dir) return false;
    if (resolve != nullptr) *resolve = options_.resolve;
    if (list != nullptr) *list = options_.list;
    return true;
  }
  std::shared_lock lock(mu_);
  const auto it = subtrees_.find(dir.base >> kSlotShift);
  if (it == subtrees_.end() || !it->second->is_generation || it->second->dynamic_dir == 0 ||
      dir.node->ino != it->second->dynamic_dir) {
    return false;
  }
  if (resolve != nullptr) *resolve = it->second->resolve;
  if (list != nullptr) *list = it->second->list;
  return true;
}

std::string Filesystem::PathOf(Ino ino) const {
  if (BucketFiles::Owns(ino) && options_.bucket) {
    const std::optional<BucketFiles::File> file = options_.bucket->Get(ino);
    return file ? "/" + file->rel : "<ino " + std::to_string(ino) + ">";
  }
  if (Passthrough::Owns(ino) && options_.passthrough) return options_.passthrough->PathOf(ino);
  if (ino == kRootIno) return "/";
  const uint64_t slot = ino >> kSlotShift;
  if (slot == 0) return tree_->PathOf(ino);
  std::shared_ptr<const Tree> tree;
  std::string name;
  bool is_generation = false;
  uint64_t generation_slot = 0;
  {
    std::shared_lock lock(mu_);
    const auto it = subtrees_.find(slot);
    if (it == subtrees_.end()) return "<ino " + std::to_string(ino) + ">";
    tree = it->second->tree;
    name = it->second->name;
    is_generation = it->second->is_generation;
    generation_slot = it->second->generation_slot;
  }
  const std::string rest = tree->PathOf(ino & kLocalInoMask);
  if (is_generation) return rest;
  const std::string base = PathOf(DynamicDirOf(generation_slot)) + "/" + name;
  return rest == "/" ? base : base + rest;
}

uint64_t Filesystem::Generation() const {
  std::shared_lock lock(mu_);
  return n_generations_;
}

Status Filesystem::Swap(std::shared_ptr<const Tree> tree, Ino dynamic_dir, SubtreeResolver resolve,
                        SubtreeLister list) {
  if (tree == nullptr || tree->size() > kLocalInoMask) return InvalidArgumentError("Filesystem::Swap: bad tree");
  if (dynamic_dir != 0) {
    const TreeNode* dir = tree->Get(dynamic_dir);
    if (dir == nullptr || !dir->is_dir || !resolve) {
      return InvalidArgumentError("Filesystem::Swap: dynamic_dir is not a directory or has no resolver");
    }
  }
  std::shared_ptr<const Tree> released;  // destroyed outside the lock
  std::unique_lock lock(mu_);
  if (subtrees_.size() >= kMaxLiveSubtrees || next_slot_ > kMaxSlot) {
    return PosixError(ENOSPC, "too many generations and directories resolved");
  }
  auto gen = std::make_unique<Subtree>();
  gen->tree = std::move(tree);
  gen->is_generation = true;
  gen->current = true;
  gen->dynamic_dir = dynamic_dir;
  gen->resolve = std::move(resolve);
  gen->list = std::move(list);
  const uint64_t slot = next_slot_++;
  subtrees_.emplace(slot, std::move(gen));
  const uint64_t old = current_slot_;
  current_slot_ = slot;
  ++n_generations_;
  if (old != 0) {
    Subtree& prev = *subtrees_.at(old);
    prev.current = false;
    if (prev.n_lookups.load(std::memory_order_acquire) == 0) {
      released = std::move(prev.tree);
      subtrees_.erase(old);
    }
  }
  return Status::Ok();
}

size_t Filesystem::NumSubtrees() const {
  std::shared_lock lock(mu_);
  return subtrees_.size();
}

struct stat Filesystem::Stat(const Found& found) const {
  const TreeNode& node = *found.node;
  struct stat st = {};
  st.st_ino = found.is_root ? kRootIno : (found.base | node.ino);
  st.st_mode = static_cast<mode_t>((node.is_dir ? S_IFDIR : S_IFREG) | (node.mode & 07777));
  // The dynamic directory's subdirectory count is unknown: 1 tells find(1) not to count.
  st.st_nlink = node.is_dir && IsDynamicDir(found, nullptr) ? 1 : node.nlink;
  st.st_uid = node.uid >= 0 ? static_cast<uid_t>(node.uid) : options_.uid;
  st.st_gid = node.gid >= 0 ? static_cast<gid_t>(node.gid) : options_.gid;
  st.st_size = static_cast<off_t>(node.size);
  // In 512-byte units whatever st_blksize says; `du` reports the virtual size from this.
  st.st_blocks = static_cast<blkcnt_t>(node.size / 512 + (node.size % 512 != 0 ? 1 : 0));
  st.st_blksize = kStatBlockSize;
  st.st_atim = node.mtime;
  st.st_mtim = node.mtime;
  st.st_ctim = node.mtime;
  if (options_.passthrough && found.is_root) {
    // The mount's root is the source's root: its owner, mode and times.
    if (Result<struct stat> src = options_.passthrough->GetAttr(kRootIno); src.ok()) {
      st.st_mode = S_IFDIR | (src->st_mode & 07777);
      st.st_uid = src->st_uid;
      st.st_gid = src->st_gid;
      st.st_atim = src->st_atim;
      st.st_mtim = src->st_mtim;
      st.st_ctim = src->st_ctim;
    }
  }
  return st;
}

Entry Filesystem::PtEntry(const struct stat& st) {
  Entry e;
  e.attr = st;
  e.ino = st.st_ino;
  return e;
}

Result<bool> Filesystem::ToSource(Ino parent, std::string_view name) const {
  if (!options_.passthrough) return false;
  if (Passthrough::Owns(parent)) return true;
  if (parent != kRootIno) {
    if (Find(parent).node == nullptr) return NotFoundError("no inode " + std::to_string(parent));
    return false;
  }
  return CurrentGeneration().tree->Lookup(kRootIno, std::string(name)) == nullptr;
}

Entry Filesystem::EntryOf(const Found& found) const {
  Entry e;
  if (found.node != nullptr) {
    e.attr = Stat(found);
    e.ino = e.attr.st_ino;
  }
  return e;
}

Result<Filesystem::Found> Filesystem::ResolveChild(uint64_t generation_slot, const std::string& name) {
  const auto key = std::make_pair(generation_slot, name);
  SubtreeResolver resolve;
  {
    std::shared_lock lock(mu_);
    const auto it = slot_of_.find(key);
    if (it != slot_of_.end()) {
      Subtree& sub = *subtrees_.at(it->second);
      sub.n_lookups.fetch_add(1, std::memory_order_relaxed);
      return Found{sub.tree, sub.tree->Get(kRootIno), it->second << kSlotShift, false};
    }
    if (generation_slot == 0) {
      resolve = options_.resolve;
    } else if (const auto g = subtrees_.find(generation_slot); g != subtrees_.end()) {
      resolve = g->second->resolve;
    }
  }
  std::string dir_path = PathOf(DynamicDirOf(generation_slot));
  if (!dir_path.empty() && dir_path[0] == '/') dir_path.erase(0, 1);
  const std::string label = dir_path.empty() ? name : dir_path + "/" + name;
  if (!resolve) return NotFoundError(label + ": its generation was released");
  Result<std::shared_ptr<const Tree>> made = resolve(name);  // outside the lock
  if (!made.ok()) {
    LogError(label + ": " + made.error().ToString());
    return NotFoundError(label + ": " + made.error().message());
  }
  std::shared_ptr<const Tree> tree = std::move(*made);
  if (tree == nullptr || tree->size() > kLocalInoMask) {
    LogError(label + ": resolver returned " + (tree == nullptr ? "no tree" : "too many nodes"));
    return NotFoundError(label + ": no tree");
  }
  std::unique_lock lock(mu_);
  auto it = slot_of_.find(key);
  if (it == slot_of_.end()) {  // else another thread won the race: use theirs, drop ours
    if (subtrees_.size() >= kMaxLiveSubtrees || next_slot_ > kMaxSlot) {
      LogError(label + ": too many directories resolved (" + std::to_string(subtrees_.size()) + ")");
      return PosixError(ENOSPC, label + ": too many directories resolved");
    }
    auto sub = std::make_unique<Subtree>();
    sub->tree = std::move(tree);
    sub->name = name;
    sub->generation_slot = generation_slot;
    it = slot_of_.emplace(key, next_slot_).first;
    subtrees_.emplace(next_slot_++, std::move(sub));
  }
  Subtree& sub = *subtrees_.at(it->second);
  sub.n_lookups.fetch_add(1, std::memory_order_relaxed);
  return Found{sub.tree, sub.tree->Get(kRootIno), it->second << kSlotShift, false};
}

Result<Entry> Filesystem::Lookup(Ino parent, std::string_view name) {
  if (name != "." && name != "..") {
    UCPFS_ASSIGN_OR_RETURN(const bool to_source, ToSource(parent, name));
    if (to_source) {
      UCPFS_ASSIGN_OR_RETURN(const struct stat st, options_.passthrough->Lookup(parent, name));
      if (st.st_ino == 0 && options_.bucket) return BucketLookup(parent, name);
      return PtEntry(st);
    }
  }
  const Found dir = Find(parent);
  if (dir.node == nullptr) return NotFoundError("no inode " + std::to_string(parent));
  if (!dir.node->is_dir) return PosixError(ENOTDIR, PathOf(parent) + " is not a directory");
  Found child;
  if (name == ".") {
    child = Find(parent, true);
  } else if (name == "..") {
    child = Find(GlobalParent(dir), true);
  } else {
    const TreeNode* local = dir.tree->Lookup(dir.node->ino, std::string(name));
    if (local != nullptr) {
      child = dir.base == 0 ? ChildOf(dir, local) : Find(dir.base | local->ino, true);
    } else if (IsDynamicDir(dir, nullptr)) {
      UCPFS_ASSIGN_OR_RETURN(child, ResolveChild(dir.base >> kSlotShift, std::string(name)));
    }
  }
  // A node that vanished between Find and FindReferenced (its subtree was evicted) is absent.
  return EntryOf(child);
}

std::optional<Entry> Filesystem::Reference(Ino ino) {
  if (Passthrough::Owns(ino)) return std::nullopt;  // listed by name: looked up instead
  const Found found = Find(ino, true);
  if (found.node == nullptr) return std::nullopt;
  return EntryOf(found);
}

void Filesystem::Forget(Ino ino, uint64_t n_lookups) {
  if (BucketFiles::Owns(ino)) {
    const Ino shadow = options_.bucket ? options_.bucket->Forget(ino, n_lookups) : 0;
    if (shadow != 0) options_.passthrough->Forget(shadow, 1);
    return;
  }
  if (Passthrough::Owns(ino)) {
    if (options_.passthrough) options_.passthrough->Forget(ino, n_lookups);
    return;
  }
  const uint64_t slot = ino >> kSlotShift;
  if (slot == 0 || n_lookups == 0) return;  // the main tree is pinned
  {
    std::shared_lock lock(mu_);
    const auto it = subtrees_.find(slot);
    if (it == subtrees_.end()) return;
    std::atomic<uint64_t>& count = it->second->n_lookups;
    uint64_t now = count.load(std::memory_order_relaxed);
    // Never below zero, whatever the kernel sends.
    while (!count.compare_exchange_weak(now, now - std::min(now, n_lookups), std::memory_order_acq_rel)) {
    }
    if (now > n_lookups) return;
  }
  std::shared_ptr<const Tree> released;  // destroyed outside the lock
  std::unique_lock lock(mu_);
  const auto it = subtrees_.find(slot);
  if (it == subtrees_.end() || it->second->n_lookups.load(std::memory_order_acquire) != 0 ||
      it->second->current) {
    return;
  }
  released = std::move(it->second->tree);
  if (!it->second->is_generation) slot_of_.erase({it->second->generation_slot, it->second->name});
  subtrees_.erase(it);
  lock.unlock();
}

Result<struct stat> Filesystem::GetAttr(Ino ino) const {
  if (BucketFiles::Owns(ino)) {
    const std::optional<BucketFiles::File> file = options_.bucket ? options_.bucket->Get(ino) : std::nullopt;
    if (!file) return NotFoundError("no inode " + std::to_string(ino));
    if (file->shadow == 0) return options_.bucket->StatOf(ino, *file, options_.uid, options_.gid);
    UCPFS_ASSIGN_OR_RETURN(struct stat st, options_.passthrough->GetAttr(file->shadow));
    st.st_ino = ino;  // the inode the kernel knows
    return st;
  }
  if (Passthrough::Owns(ino)) {
    if (!options_.passthrough) return NotFoundError("no inode " + std::to_string(ino));
    Result<struct stat> st = options_.passthrough->GetAttr(ino);
    // A staged copy removed after its upload (ENOENT once the passthrough let go of it, or not
    // yet noticed: no link left): the object's attributes, as a fresh lookup gives.
    const bool removed = st.ok() ? st->st_nlink == 0 && S_ISREG(st->st_mode) : st.error().sys_errno() == ENOENT;
    if (removed && options_.bucket) {
      if (const std::optional<BucketFiles::File> object = RemovedCopyObject(ino)) {
        return options_.bucket->StatOf(ino, *object, options_.uid, options_.gid);
      }
    }
    return st;
  }
  const Found found = Find(ino);
  if (found.node == nullptr) return NotFoundError("no inode " + std::to_string(ino));
  return Stat(found);
}

std::optional<struct stat> Filesystem::StatOf(Ino ino) const {
  if (Passthrough::Owns(ino)) {
    Result<struct stat> st = GetAttr(ino);
    if (!st.ok()) return std::nullopt;
    return *st;
  }
  const Found found = Find(ino);
  if (found.node == nullptr) return std::nullopt;
  return Stat(found);
}

Result<OpenFile> Filesystem::Open(Ino ino, int flags, const Caller& caller) const {
  if (BucketFiles::Owns(ino)) return OpenBucketFile(ino, flags, caller);
  if (Passthrough::Owns(ino)) {
    if (!options_.passthrough) return NotFoundError("no inode " + std::to_string(ino));
    Result<std::unique_ptr<PassthroughHandle>> h = options_.passthrough->Open(caller, ino, flags);
    if (!h.ok() && h.error().sys_errno() == ENOENT && options_.bucket) return OpenRemovedCopy(ino, flags, caller, h.error());
    if (!h.ok()) return h.error();
    OpenFile file;
    file.ino = ino;
    file.passthrough = std::move(*h);
    return file;
  }
  const Found found = Find(ino);
  const TreeNode* node = found.node;
  if (node == nullptr) return NotFoundError("no inode " + std::to_string(ino));
  if (node->is_dir) return PosixError(EISDIR, PathOf(ino) + " is a directory");
  if ((flags & O_ACCMODE) != O_RDONLY || (flags & (O_TRUNC | O_APPEND)) != 0) {
    return PosixError(EROFS, PathOf(ino) + " is read-only");
  }
  const std::string path = PathOf(ino);
  if (!node->open) {
    LogError("open " + path + ": file has no opener");
    return PosixError(EIO, path + ": no opener");
  }
  Result<std::shared_ptr<const ByteSource>> source = node->open();
  if (!source.ok()) {
    LogError("open " + path + ": " + source.error().ToString());
    return source.error();
  }
  if (*source == nullptr || (*source)->Size() != node->size) {
    LogError("open " + path + ": source has " + std::to_string(*source ? (*source)->Size() : 0) +
             " bytes but the file has " + std::to_string(node->size));
    return PosixError(EIO, path + ": source size differs");
  }
  OpenFile file{std::move(*source), ino, node->size, node->volatile_content, nullptr, nullptr,
                std::weak_ptr<const void>(std::shared_ptr<const void>(found.tree, node))};
  if (options_.read_ahead_bytes > 0 && !node->volatile_content) {
    file.prefetched_until = std::make_shared<std::atomic<uint64_t>>(0);
  }
  return file;
}

void Filesystem::LogError(const std::string& message) const {
  std::fprintf(stderr, "ucpfs: %s\n", message.c_str());
  if (options_.report) options_.report->RecordError(message);
}

void Filesystem::ReadAhead(const OpenFile& file, uint64_t byte_offset, uint64_t n_bytes) const {
  if (!file.prefetched_until || n_bytes == 0) return;
  const uint64_t window = options_.read_ahead_bytes;
  const uint64_t end = byte_offset + n_bytes;
  if (end >= file.n_bytes) return;
  // Announce up to end + window once the announced part just ahead of this read has shrunk by
  // a step (an eighth of the window, at least kReadAheadMinStepBytes, at most half: 4 MiB of
  // the default 32M), so the source gets hints of a few MiB rather than one per request, and
  // keeps fetching as the reader goes: with half-window steps an s3:// source's GETs ran in
  // waves (all finishing together, then the link idle while the reader drained them: 15-35 ms
  // of every 130 ms over a 2 Gbit/s link). A read elsewhere (torch.load reads the zip's
  // directory at the end first; a seek) starts over from where it is.
  const uint64_t step = std::min(window / 2, std::max(window / 8, kReadAheadMinStepBytes));
  uint64_t until = file.prefetched_until->load(std::memory_order_relaxed);
  uint64_t from;
  bool first;
  do {
    const bool ahead = until > end && until <= end + window;
    if (ahead && until - end > window - step) return;
    from = ahead ? until : end;
    first = until == 0;
  } while (!file.prefetched_until->compare_exchange_weak(until, end + window, std::memory_order_relaxed));
  const uint64_t to = std::min(end + window, file.n_bytes);
  // A reader that starts at the front of an open file gets the file's tail announced before
  // the window: torch.load reads a zip's directory at the end right after the head, and that
  // read, queued behind the window's source reads, waited for them (24 ms of a 0.08 s cold
  // load of a 49 MB atomic file). The kernel's read-ahead sends the first reads together, so
  // whichever of them is answered first announces.
  if (first && byte_offset < step && file.n_bytes - end > kReadAheadTailBytes) {
    const uint64_t tail = file.n_bytes - kReadAheadTailBytes;
    file.source->Prefetch(tail, file.n_bytes - tail);
  }
  if (to > from) file.source->Prefetch(from, to - from);
}

Result<size_t> Filesystem::Read(const OpenFile& file, uint64_t byte_offset, std::span<std::byte> buffer) {
  if (file.passthrough) {
    Result<size_t> n = options_.passthrough->Read(*file.passthrough, byte_offset, buffer);
    if (!n.ok()) {
      LogError("read " + PathOf(file.ino) + " offset " + std::to_string(byte_offset) + ": " + n.error().ToString());
    }
    return n;
  }
  if (byte_offset >= file.n_bytes || buffer.empty()) return size_t{0};
  const auto n_bytes = static_cast<size_t>(std::min<uint64_t>(buffer.size(), file.n_bytes - byte_offset));
  const Status status = file.source->ReadAt(byte_offset, buffer.first(n_bytes));
  if (status.ok()) {
    if (options_.report) options_.report->CountViewRead(n_bytes);
    return n_bytes;
  }
  bool log = true;
  if (status.code() == StatusCode::kDataLoss) {
    std::lock_guard lock(logged_mu_);
    log = logged_data_loss_.size() < kMaxLoggedDataLoss && logged_data_loss_.insert(status.message()).second;
  }
  const std::string message = "read " + PathOf(file.ino) + " offset " + std::to_string(byte_offset) + ": " +
                              status.ToString();
  if (log) {
    LogError(message);
  } else if (options_.report) {
    options_.report->RecordError(message, /*keep_message=*/false);
  }
  return status;
}

Result<DirListing> Filesystem::OpenDir(Ino ino) const {
  if (Passthrough::Owns(ino)) {
    if (!options_.passthrough) return NotFoundError("no inode " + std::to_string(ino));
    UCPFS_ASSIGN_OR_RETURN(auto items, options_.passthrough->List(ino));
    DirListing listing;
    listing.cacheable = false;
    listing.items.push_back({".", ino});
    listing.items.push_back({"..", ino});  // the kernel answers ".." itself
    for (auto& item : items) listing.items.push_back({std::move(item.name), item.ino, true, item.type});
    if (options_.bucket) UCPFS_RETURN_IF_ERROR(AddBucketNames(ino, listing));
    return listing;
  }
  const Found found = Find(ino);
  const TreeNode* node = found.node;
  if (node == nullptr) return NotFoundError("no inode " + std::to_string(ino));
  if (!node->is_dir) return PosixError(ENOTDIR, PathOf(ino) + " is not a directory");
  DirListing listing;
  listing.items.reserve(node->children.size() + 2);
  listing.items.push_back({".", found.is_root ? kRootIno : (found.base | node->ino)});
  listing.items.push_back({"..", GlobalParent(found)});
  for (const auto& [name, child] : node->children) listing.items.push_back({name, found.base | child});
  if (found.is_root && found.base != 0) listing.cacheable = false;  // a later generation: swapped again
  if (options_.passthrough && found.is_root) {
    // The source's top-level entries beside the views' names.
    listing.cacheable = false;
    UCPFS_ASSIGN_OR_RETURN(auto items, options_.passthrough->List(kRootIno));
    for (auto& item : items) {
      if (node->children.contains(item.name)) continue;
      listing.items.push_back({std::move(item.name), item.ino, true, item.type});
    }
    std::sort(listing.items.begin() + 2, listing.items.end(),
              [](const DirListing::Item& a, const DirListing::Item& b) { return a.name < b.name; });
    if (options_.bucket) UCPFS_RETURN_IF_ERROR(AddBucketNames(kRootIno, listing));
  }
  SubtreeLister list;
  if (IsDynamicDir(found, nullptr, &list)) {
    listing.cacheable = false;  // plus the subtrees built so far, merged in name order
    std::set<std::string> listed;  // names already in the listing
    {
      const uint64_t generation_slot = found.base >> kSlotShift;
      std::shared_lock lock(mu_);
      for (const auto& [key, slot] : slot_of_) {
        if (key.first != generation_slot) continue;
        if (node->children.contains(key.second)) continue;  // shadowed (never resolved, in fact)
        listing.items.push_back({key.second, slot << kSlotShift | kRootIno});
        listed.insert(key.second);
      }
    }
    // The lister's names not resolved yet: files, looked up by name (outside the lock).
    for (std::string& name : list ? list() : std::vector<std::string>()) {
      if (node->children.contains(name) || listed.contains(name)) continue;
      listing.items.push_back({std::move(name), 0, true, S_IFREG});
    }
    std::sort(listing.items.begin() + 2, listing.items.end(),
              [](const DirListing::Item& a, const DirListing::Item& b) { return a.name < b.name; });
  }
  return listing;
}

struct statvfs Filesystem::StatFs() const {
  if (options_.passthrough) return options_.passthrough->StatFs();  // the source's space: df
  const uint64_t n_bytes = CurrentGeneration().tree->TotalFileBytes();
  struct statvfs sv = {};
  sv.f_bsize = kStatfsBlockSize;
  sv.f_frsize = kStatfsBlockSize;
  sv.f_blocks = n_bytes / kStatfsBlockSize + (n_bytes % kStatfsBlockSize != 0 ? 1 : 0);
  sv.f_files = CurrentGeneration().tree->size();
  sv.f_namemax = kNameMax;
  sv.f_flag = ST_RDONLY;  // informational: statvfs(2) reports the mount's "ro" flag
  return sv;
}

Status Filesystem::Access(Ino ino, int mask) const {
  if (Passthrough::Owns(ino)) return GetAttr(ino).status();  // permissions: default_permissions
  if (Find(ino).node == nullptr) return NotFoundError("no inode " + std::to_string(ino));
  const bool writable_root = options_.passthrough && ino == kRootIno;
  if ((mask & W_OK) != 0 && !writable_root) return PosixError(EROFS, PathOf(ino) + " is read-only");
  return Status::Ok();
}

}  // namespace ucpfs::fs
