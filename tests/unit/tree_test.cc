// Tree: inode numbering, lookup, name validation and clashes, MakeDirs, hard links, sizes.
#include "fs/tree.h"
#include "fs/namespace.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

namespace ucpfs::fs {
namespace {

constexpr struct timespec kMtime = {1700000000, 5};

Opener BytesOpener(size_t n_bytes) {
  return [n_bytes]() -> Result<std::shared_ptr<const ByteSource>> {
    return std::shared_ptr<const ByteSource>(
        std::make_shared<MemorySource>("f", std::vector<std::byte>(n_bytes)));
  };
}

TEST(TreeTest, NewTreeHasOnlyTheRoot) {
  Tree tree;
  EXPECT_EQ(tree.size(), 1u);
  const TreeNode* root = tree.Get(kRootIno);
  ASSERT_NE(root, nullptr);
  EXPECT_EQ(root->ino, kRootIno);
  EXPECT_TRUE(root->is_dir);
  EXPECT_EQ(root->mode, 0555u);
  EXPECT_EQ(root->nlink, 2u);
  EXPECT_EQ(root->parent, kRootIno);
  EXPECT_TRUE(root->children.empty());
  EXPECT_EQ(tree.Get(0), nullptr);
  EXPECT_EQ(tree.Get(2), nullptr);
  EXPECT_EQ(tree.TotalFileBytes(), 0u);
  EXPECT_EQ(tree.PathOf(kRootIno), "/");
}

TEST(TreeTest, InodesAreAssignedInBuildOrderAndStable) {
  auto build = [] {
    auto tree = std::make_unique<Tree>();
    std::vector<Ino> inos;
    inos.push_back(*tree->AddDir(kRootIno, "z", kMtime));
    inos.push_back(*tree->AddFile(kRootIno, "a.bin", 10, kMtime, BytesOpener(10)));
    inos.push_back(*tree->AddFile(inos[0], "b.bin", 20, kMtime, BytesOpener(20)));
    inos.push_back(*tree->MakeDirs(kRootIno, "m/n", kMtime));
    return std::make_pair(std::move(tree), inos);
  };
  auto [tree1, inos1] = build();
  auto [tree2, inos2] = build();
  EXPECT_EQ(inos1, (std::vector<Ino>{2, 3, 4, 6}));  // "m" is 5, "m/n" is 6
  EXPECT_EQ(inos1, inos2);
  for (Ino ino = 1; ino <= tree1->size(); ++ino) {
    ASSERT_NE(tree1->Get(ino), nullptr);
    EXPECT_EQ(tree1->Get(ino)->ino, ino);
    EXPECT_EQ(tree1->PathOf(ino), tree2->PathOf(ino));
  }
  EXPECT_EQ(tree1->size(), 6u);
}

TEST(TreeTest, AddFileAndLookup) {
  Tree tree;
  Result<Ino> dir = tree.AddDir(kRootIno, "dir", kMtime);
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  Result<Ino> file = tree.AddFile(*dir, "x.bin", 1234, kMtime, BytesOpener(1234));
  ASSERT_TRUE(file.ok()) << file.status().ToString();

  const TreeNode* found = tree.Lookup(*dir, "x.bin");
  ASSERT_NE(found, nullptr);
  EXPECT_EQ(found->ino, *file);
  EXPECT_FALSE(found->is_dir);
  EXPECT_EQ(found->mode, 0444u);
  EXPECT_EQ(found->size, 1234u);
  EXPECT_EQ(found->nlink, 1u);
  EXPECT_EQ(found->parent, *dir);
  EXPECT_EQ(found->name, "x.bin");
  EXPECT_EQ(found->mtime.tv_sec, kMtime.tv_sec);
  EXPECT_EQ(found->mtime.tv_nsec, kMtime.tv_nsec);
  ASSERT_TRUE(found->open);
  Result<std::shared_ptr<const ByteSource>> src = found->open();
  ASSERT_TRUE(src.ok());
  EXPECT_EQ((*src)->Size(), 1234u);

  EXPECT_EQ(tree.Lookup(*dir, "missing"), nullptr);
  EXPECT_EQ(tree.Lookup(kRootIno, "x.bin"), nullptr);
  EXPECT_EQ(tree.Lookup(*file, "anything"), nullptr);  // not a directory
  EXPECT_EQ(tree.Lookup(999, "x.bin"), nullptr);       // no such inode
  EXPECT_EQ(tree.Lookup(kRootIno, "dir")->ino, *dir);
  EXPECT_EQ(tree.PathOf(*file), "/dir/x.bin");
  EXPECT_EQ(tree.PathOf(999), "<ino 999>");
}

TEST(TreeTest, ChildrenAreSortedByName) {
  Tree tree;
  for (const char* name : {"c", "a", "b", "B", "aa"}) {
    ASSERT_TRUE(tree.AddFile(kRootIno, name, 0, kMtime, BytesOpener(0)).ok());
  }
  std::vector<std::string> names;
  for (const auto& [name, ino] : tree.Get(kRootIno)->children) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"B", "a", "aa", "b", "c"}));
}

TEST(TreeTest, RejectsBadNames) {
  Tree tree;
  for (const std::string& bad :
       {std::string(), std::string("."), std::string(".."), std::string("a/b"),
        std::string("/"), std::string("a\0b", 3), std::string(256, 'x')}) {
    Result<Ino> file = tree.AddFile(kRootIno, bad, 0, kMtime, BytesOpener(0));
    EXPECT_FALSE(file.ok()) << "name of " << bad.size() << " bytes accepted";
    if (!file.ok()) {
      EXPECT_EQ(file.status().code(), StatusCode::kInvalidArgument);
    }
    EXPECT_FALSE(tree.AddDir(kRootIno, bad, kMtime).ok());
  }
  EXPECT_TRUE(tree.AddFile(kRootIno, std::string(255, 'x'), 0, kMtime, BytesOpener(0)).ok());
  EXPECT_TRUE(tree.AddFile(kRootIno, "...", 0, kMtime, BytesOpener(0)).ok());
  EXPECT_TRUE(tree.AddFile(kRootIno, ".hidden", 0, kMtime, BytesOpener(0)).ok());
  EXPECT_EQ(tree.size(), 4u);  // failed adds leave no nodes behind
}

TEST(TreeTest, NameClashesAreErrors) {
  Tree tree;
  Ino dir = *tree.AddDir(kRootIno, "d", kMtime);
  Ino file = *tree.AddFile(kRootIno, "f", 5, kMtime, BytesOpener(5));
  const size_t n_nodes = tree.size();

  Result<Ino> again = tree.AddFile(kRootIno, "f", 5, kMtime, BytesOpener(5));
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(again.status().message().find("already exists"), std::string::npos)
      << again.status().message();
  EXPECT_FALSE(tree.AddDir(kRootIno, "f", kMtime).ok());
  EXPECT_FALSE(tree.AddDir(kRootIno, "d", kMtime).ok());
  EXPECT_FALSE(tree.AddFile(kRootIno, "d", 0, kMtime, BytesOpener(0)).ok());
  EXPECT_FALSE(tree.AddLink(kRootIno, "d", file).ok());
  EXPECT_FALSE(tree.AddLink(kRootIno, "f", file).ok());
  EXPECT_EQ(tree.size(), n_nodes);
  EXPECT_EQ(tree.Get(file)->nlink, 1u);
  EXPECT_EQ(tree.Get(kRootIno)->nlink, 3u);  // unchanged by the failed AddDir
  // The same name in another directory is fine.
  EXPECT_TRUE(tree.AddFile(dir, "f", 1, kMtime, BytesOpener(1)).ok());
}

TEST(TreeTest, ParentMustBeAnExistingDirectory) {
  Tree tree;
  Ino file = *tree.AddFile(kRootIno, "f", 0, kMtime, BytesOpener(0));
  EXPECT_FALSE(tree.AddFile(file, "x", 0, kMtime, BytesOpener(0)).ok());
  EXPECT_FALSE(tree.AddDir(file, "x", kMtime).ok());
  EXPECT_FALSE(tree.AddFile(0, "x", 0, kMtime, BytesOpener(0)).ok());
  EXPECT_FALSE(tree.AddDir(42, "x", kMtime).ok());
  EXPECT_FALSE(tree.AddLink(file, "x", file).ok());
  EXPECT_FALSE(tree.MakeDirs(file, "x", kMtime).ok());
  EXPECT_FALSE(tree.MakeDirs(42, "x", kMtime).ok());
  EXPECT_EQ(tree.size(), 2u);
}

TEST(TreeTest, DirectoryNlinkCountsSubdirectories) {
  Tree tree;
  Ino a = *tree.AddDir(kRootIno, "a", kMtime);
  ASSERT_TRUE(tree.AddDir(kRootIno, "b", kMtime).ok());
  ASSERT_TRUE(tree.AddFile(kRootIno, "f", 0, kMtime, BytesOpener(0)).ok());
  ASSERT_TRUE(tree.AddDir(a, "x", kMtime).ok());
  EXPECT_EQ(tree.Get(kRootIno)->nlink, 4u);  // 2 + a, b
  EXPECT_EQ(tree.Get(a)->nlink, 3u);         // 2 + x
  EXPECT_EQ(tree.Lookup(kRootIno, "b")->nlink, 2u);
  EXPECT_EQ(tree.Lookup(kRootIno, "a")->mode, 0555u);
  EXPECT_EQ(tree.Lookup(kRootIno, "a")->parent, kRootIno);
}

TEST(TreeTest, MakeDirsCreatesMissingAndReusesExisting) {
  Tree tree;
  Result<Ino> c = tree.MakeDirs(kRootIno, "a/b/c", kMtime);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(tree.size(), 4u);
  EXPECT_EQ(tree.PathOf(*c), "/a/b/c");
  const TreeNode* a = tree.Lookup(kRootIno, "a");
  ASSERT_NE(a, nullptr);
  EXPECT_TRUE(a->is_dir);
  const TreeNode* b = tree.Lookup(a->ino, "b");
  ASSERT_NE(b, nullptr);
  const Ino b_ino = b->ino;  // node pointers are valid only until the tree grows
  EXPECT_EQ(tree.Lookup(b_ino, "c")->ino, *c);

  // Existing prefixes are reused; empty components are skipped.
  Result<Ino> d = tree.MakeDirs(kRootIno, "/a//b/d/", kMtime);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(tree.size(), 5u);
  EXPECT_EQ(tree.PathOf(*d), "/a/b/d");
  EXPECT_EQ(tree.Get(b_ino)->nlink, 4u);  // 2 + c, d

  Result<Ino> same = tree.MakeDirs(kRootIno, "a/b/c", kMtime);
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(*same, *c);
  EXPECT_EQ(tree.size(), 5u);

  Result<Ino> here = tree.MakeDirs(*c, "", kMtime);
  ASSERT_TRUE(here.ok());
  EXPECT_EQ(*here, *c);

  Result<Ino> relative = tree.MakeDirs(*c, "e", kMtime);
  ASSERT_TRUE(relative.ok());
  EXPECT_EQ(tree.PathOf(*relative), "/a/b/c/e");
}

TEST(TreeTest, MakeDirsRefusesFilesAndBadComponents) {
  Tree tree;
  Ino a = *tree.AddDir(kRootIno, "a", kMtime);
  ASSERT_TRUE(tree.AddFile(a, "file", 3, kMtime, BytesOpener(3)).ok());
  const size_t n_nodes = tree.size();
  Result<Ino> through_file = tree.MakeDirs(kRootIno, "a/file/x", kMtime);
  ASSERT_FALSE(through_file.ok());
  EXPECT_EQ(through_file.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(through_file.status().message().find("/a/file"), std::string::npos)
      << through_file.status().message();
  EXPECT_FALSE(tree.MakeDirs(kRootIno, "a/file", kMtime).ok());
  EXPECT_FALSE(tree.MakeDirs(kRootIno, "a/../x", kMtime).ok());
  EXPECT_FALSE(tree.MakeDirs(kRootIno, "./x", kMtime).ok());
  EXPECT_EQ(tree.size(), n_nodes);
}

TEST(TreeTest, HardLinksShareTheInode) {
  Tree tree;
  Ino dir = *tree.AddDir(kRootIno, "d", kMtime);
  Ino file = *tree.AddFile(kRootIno, "f", 100, kMtime, BytesOpener(100));
  const size_t n_nodes = tree.size();

  ASSERT_TRUE(tree.AddLink(dir, "g", file).ok());
  ASSERT_TRUE(tree.AddLink(kRootIno, "h", file).ok());
  EXPECT_EQ(tree.size(), n_nodes);  // no new inode
  EXPECT_EQ(tree.Lookup(dir, "g")->ino, file);
  EXPECT_EQ(tree.Lookup(kRootIno, "h")->ino, file);
  EXPECT_EQ(tree.Get(file)->nlink, 3u);
  EXPECT_EQ(tree.PathOf(file), "/f");  // the first name
  EXPECT_EQ(tree.Get(kRootIno)->nlink, 3u);  // links to files do not count
  EXPECT_EQ(tree.TotalFileBytes(), 100u);  // counted once, as du does

  EXPECT_FALSE(tree.AddLink(kRootIno, "to_dir", dir).ok());  // no directory hard links
  EXPECT_FALSE(tree.AddLink(kRootIno, "to_nothing", 999).ok());
  EXPECT_FALSE(tree.AddLink(kRootIno, "bad/name", file).ok());
  EXPECT_EQ(tree.Get(file)->nlink, 3u);
}

TEST(TreeTest, TotalFileBytesSumsFilesOnly) {
  Tree tree;
  Ino d = *tree.MakeDirs(kRootIno, "x/y", kMtime);
  ASSERT_TRUE(tree.AddFile(kRootIno, "a", 1, kMtime, BytesOpener(1)).ok());
  ASSERT_TRUE(tree.AddFile(d, "b", 4096, kMtime, BytesOpener(4096)).ok());
  const uint64_t big = 5ull << 40;  // sizes are not limited by memory: openers are lazy
  ASSERT_TRUE(tree.AddFile(d, "c", big, kMtime, Opener()).ok());
  EXPECT_EQ(tree.TotalFileBytes(), 1 + 4096 + big);
}

TEST(TreeTest, OpenersAreNotCalledWhileBuilding) {
  Tree tree;
  int calls = 0;
  ASSERT_TRUE(tree.AddFile(kRootIno, "lazy", 7, kMtime,
                           [&calls]() -> Result<std::shared_ptr<const ByteSource>> {
                             ++calls;
                             return NotFoundError("gone");
                           })
                  .ok());
  EXPECT_EQ(calls, 0);
  EXPECT_NE(tree.Lookup(kRootIno, "lazy"), nullptr);
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(tree.Lookup(kRootIno, "lazy")->open().status().code(), StatusCode::kNotFound);
  EXPECT_EQ(calls, 1);
}


// fs::BuiltOnOpen: the file is built at each open that finds no earlier open holding it, shared
// by opens while one holds it, and refused (not served) when built with another size.
TEST(BuiltOnOpenTest, BuildsOnOpenSharesWhileHeldAndChecksTheSize) {
  int builds = 0;
  size_t n = 5;
  Opener open = BuiltOnOpen(
      [&]() -> Result<std::shared_ptr<const ByteSource>> {
        ++builds;
        if (n == 0) return NotFoundError("source gone");
        return std::shared_ptr<const ByteSource>(
            std::make_shared<MemorySource>("atomic/w/fp32.pt", std::vector<std::byte>(n, std::byte{7})));
      },
      5);
  EXPECT_EQ(builds, 0);  // nothing built before the first open
  auto a = open();
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto b = open();
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(builds, 1);
  EXPECT_EQ(a->get(), b->get());
  a = NotFoundError("closed");
  b = NotFoundError("closed");
  auto c = open();  // every open closed: built again
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(builds, 2);
  EXPECT_EQ((*c)->Size(), 5u);
  c = NotFoundError("closed");

  n = 6;  // built again with another size: an internal error naming the file
  auto d = open();
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInternal);
  EXPECT_NE(d.status().ToString().find("atomic/w/fp32.pt built again has 6 bytes, not the 5 listed"), std::string::npos)
      << d.status().ToString();
  n = 0;  // the builder's own error passes through
  EXPECT_EQ(open().status().code(), StatusCode::kNotFound);
  EXPECT_EQ(builds, 4);
}

}  // namespace
}  // namespace ucpfs::fs
