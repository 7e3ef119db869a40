// MemoryTree: a SourceTree (core/io/source_tree.h) held in memory, for tests: a copy of a real
// directory's files, directories and symlink names, read without touching the disk again. It
// behaves as an object store would: no descriptors, no device or ctime, and the inode of a file
// a hash of its bytes (an ETag). Scanning a checkpoint through it while the directory it was
// copied from is moved away proves that a scanner reads the source only through the seam.
#pragma once

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/io/source_tree.h"

namespace ucpfs::testing {

class MemoryTree final : public SourceTree {
 public:
  struct Node {
    EntryKind kind = EntryKind::kOther;
    FileIdentity identity;
    std::shared_ptr<const std::vector<std::byte>> bytes;  // kFile
  };
  using Nodes = std::map<std::string, Node>;  // by path relative to the copied directory

  // A copy of `dir` (files read whole, symlinks recorded by name and never followed, special
  // files as kOther), whose Root() is `root` (e.g. `dir` itself, for identical messages).
  static std::shared_ptr<const MemoryTree> CopyOf(const std::filesystem::path& dir, std::string root) {
    auto nodes = std::make_shared<Nodes>();
    (*nodes)[""] = Node{EntryKind::kDirectory, {}, nullptr};
    for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
      const std::string rel = e.path().lexically_relative(dir).string();  // never resolving a symlink
      struct stat st;
      if (::lstat(e.path().c_str(), &st) != 0) continue;
      Node n;
      n.identity.n_bytes = static_cast<uint64_t>(st.st_size);
      n.identity.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
      if (S_ISREG(st.st_mode)) {
        n.kind = EntryKind::kFile;
        std::ifstream in(e.path(), std::ios::binary);
        std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        auto bytes = std::make_shared<std::vector<std::byte>>(chars.size());
        std::memcpy(bytes->data(), chars.data(), chars.size());
        n.identity.ino = Fnv1a(*bytes) | 1;  // an "ETag": never 0 (0 means not recorded)
        n.bytes = std::move(bytes);
      } else if (S_ISDIR(st.st_mode)) {
        n.kind = EntryKind::kDirectory;
        n.identity = {};  // a prefix has no size or time
      } else if (S_ISLNK(st.st_mode)) {
        n.kind = EntryKind::kSymlink;
      }
      (*nodes)[rel] = std::move(n);
    }
    return std::make_shared<const MemoryTree>(std::move(nodes), "", std::move(root));
  }

  MemoryTree(std::shared_ptr<const Nodes> nodes, std::string prefix, std::string root)
      : nodes_(std::move(nodes)), prefix_(std::move(prefix)), root_(std::move(root)) {}

  const std::string& Root() const override { return root_; }

  Result<std::vector<TreeEntry>> List(std::string_view rel_dir) const override {
    if (!SafeTreePath(rel_dir)) return InvalidArgumentError(root_ + ": bad path '" + std::string(rel_dir) + "'");
    const std::string key = Key(rel_dir);
    auto it = nodes_->find(key);
    if (it == nodes_->end() || it->second.kind != EntryKind::kDirectory) {
      return NotFoundError(PathOf(rel_dir) + ": no such directory");
    }
    const std::string under = key.empty() ? "" : key + "/";
    std::vector<TreeEntry> out;
    for (auto c = nodes_->lower_bound(under); c != nodes_->end() && c->first.starts_with(under); ++c) {
      if (c->first.empty()) continue;
      const std::string name = c->first.substr(under.size());
      if (name.find('/') != std::string::npos) continue;
      out.push_back(EntryOf(name, c->second));
    }
    std::sort(out.begin(), out.end(), [](const TreeEntry& a, const TreeEntry& b) { return a.name < b.name; });
    ++lists;
    return out;
  }

  Result<TreeEntry> Stat(std::string_view rel) const override {
    if (!SafeTreePath(rel)) return InvalidArgumentError(root_ + ": bad path '" + std::string(rel) + "'");
    auto it = nodes_->find(Key(rel));
    if (it == nodes_->end()) return NotFoundError(PathOf(rel) + ": no such file or directory");
    const size_t slash = rel.rfind('/');
    return EntryOf(std::string(slash == std::string_view::npos ? rel : rel.substr(slash + 1)), it->second);
  }

  Result<OpenedFile> Open(std::string_view rel) const override {
    if (rel.empty() || !SafeTreePath(rel)) return InvalidArgumentError(root_ + ": bad path '" + std::string(rel) + "'");
    auto it = nodes_->find(Key(rel));
    if (it == nodes_->end()) return NotFoundError(PathOf(rel) + ": no such file");
    if (it->second.kind != EntryKind::kFile) {
      return InvalidArgumentError(PathOf(rel) + ": not a regular file (" + EntryKindName(it->second.kind) + ")");
    }
    ++opens;
    return OpenedFile{std::make_shared<MemorySource>(PathOf(rel), *it->second.bytes), it->second.identity};
  }

  Result<std::shared_ptr<const LazySource>> OpenLazy(std::string_view rel, const FileIdentity& expected,
                                                     std::shared_ptr<IoCounters> counters,
                                                     std::shared_ptr<FdCache> /*cache: no descriptors*/) const override {
    if (rel.empty() || !SafeTreePath(rel)) return InvalidArgumentError(root_ + ": bad path '" + std::string(rel) + "'");
    return std::shared_ptr<const LazySource>(
        std::make_shared<Lazy>(nodes_, Key(rel), PathOf(rel), expected, std::move(counters)));
  }

  Result<std::shared_ptr<const SourceTree>> Subtree(std::string_view rel_dir) const override {
    if (!SafeTreePath(rel_dir)) return InvalidArgumentError(root_ + ": bad path '" + std::string(rel_dir) + "'");
    return std::shared_ptr<const SourceTree>(std::make_shared<MemoryTree>(nodes_, Key(rel_dir), PathOf(rel_dir)));
  }

  // Calls made (for tests that want to see the seam used).
  mutable std::atomic<uint64_t> lists{0}, opens{0};

 private:
  // Reads check the recorded identity, as LazyFileSource does: another version is kDataLoss.
  class Lazy final : public LazySource {
   public:
    Lazy(std::shared_ptr<const Nodes> nodes, std::string key, std::string name, FileIdentity expected,
         std::shared_ptr<IoCounters> counters)
        : nodes_(std::move(nodes)), key_(std::move(key)), name_(std::move(name)), expected_(expected),
          counters_(std::move(counters)) {}
    uint64_t Size() const override { return expected_.n_bytes; }
    const std::string& Name() const override { return name_; }
    Status Open() const override { return Get().status(); }
    Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override {
      UCPFS_ASSIGN_OR_RETURN(const std::vector<std::byte>* bytes, Get());
      if (byte_offset > bytes->size() || out.size() > bytes->size() - byte_offset) {
        return OutOfRangeError(name_ + ": read past the end");
      }
      std::memcpy(out.data(), bytes->data() + byte_offset, out.size());
      if (counters_) {
        counters_->source_reads.fetch_add(1);
        counters_->source_bytes_read.fetch_add(out.size());
      }
      return Status::Ok();
    }

   private:
    Result<const std::vector<std::byte>*> Get() const {
      auto it = nodes_->find(key_);
      if (it == nodes_->end() || it->second.kind != EntryKind::kFile) return NotFoundError(name_ + ": no such file");
      const std::string diff = expected_.Differences(it->second.identity);
      if (!diff.empty()) return Status(StatusCode::kDataLoss, name_ + ": not the file that was indexed (" + diff + ")");
      return it->second.bytes.get();
    }
    std::shared_ptr<const Nodes> nodes_;
    std::string key_, name_;
    FileIdentity expected_;
    std::shared_ptr<IoCounters> counters_;
  };

  static uint64_t Fnv1a(const std::vector<std::byte>& bytes) {
    uint64_t h = 1469598103934665603ull;
    for (std::byte b : bytes) h = (h ^ static_cast<uint8_t>(b)) * 1099511628211ull;
    return h;
  }
  static TreeEntry EntryOf(std::string name, const Node& n) {
    TreeEntry e;
    e.name = std::move(name);
    e.kind = n.kind;
    e.identity = n.identity;
    return e;
  }
  std::string Key(std::string_view rel) const {
    if (prefix_.empty()) return std::string(rel);
    return rel.empty() ? prefix_ : prefix_ + "/" + std::string(rel);
  }

  std::shared_ptr<const Nodes> nodes_;
  std::string prefix_;  // this tree's root inside nodes_ ("": the copied directory)
  std::string root_;
};

}  // namespace ucpfs::testing
