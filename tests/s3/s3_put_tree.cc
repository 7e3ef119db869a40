// s3_put_tree SRC s3://BUCKET/PREFIX: the tests' uploader (no s3fs or AWS CLI needed). Creates
// the bucket when missing, then PUTs SRC (a file: to the key PREFIX; a directory: every regular
// file below it, as PREFIX/REL, symlinks and special files skipped) through the project's own
// client (core/io/s3_client.h), configured from the AWS environment (tests/s3/rgw.sh exec).
// Prints "N objects, B bytes". Exit 1 with the error on any failure.
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "core/io/s3_client.h"

namespace {

int Fail(const std::string& what) {
  std::cerr << "s3_put_tree: " << what << '\n';
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  using namespace ucpfs::s3;
  if (argc != 3) return Fail("usage: s3_put_tree SRC s3://BUCKET/PREFIX");
  auto url = ParseS3Url(argv[2]);
  if (!url.ok()) return Fail(url.error().ToString());
  auto env = LoadS3Environment();
  if (!env.ok()) return Fail(env.error().ToString());
  auto options = ResolveOptions(*env);
  if (!options.ok()) return Fail(options.error().ToString());
  auto client = Client::Make(*options);
  if (!client.ok()) return Fail(client.error().ToString());
  if (auto head = (*client)->ListObjectsPage(url->bucket, "", "/", 1, ""); !head.ok()) {
    if (auto made = (*client)->CreateBucket(url->bucket); !made.ok()) return Fail(made.ToString());
  }
  std::string prefix = url->key;
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  std::vector<std::pair<fs::path, std::string>> files;  // local file, key
  const fs::path src = argv[1];
  if (fs::is_regular_file(fs::symlink_status(src))) {
    files.emplace_back(src, prefix);
  } else {
    for (const auto& e : fs::recursive_directory_iterator(src)) {
      if (e.is_symlink() || !e.is_regular_file()) continue;
      const std::string rel = fs::relative(e.path(), src).generic_string();
      files.emplace_back(e.path(), prefix.empty() ? rel : prefix + "/" + rel);
    }
  }
  uint64_t n_bytes = 0;
  for (const auto& [path, key] : files) {
    std::ifstream in(path, std::ios::binary);
    std::string body((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) return Fail(path.string() + ": cannot read");
    auto etag = (*client)->PutObject(url->bucket, key, std::as_bytes(std::span<const char>(body.data(), body.size())));
    if (!etag.ok()) return Fail(etag.error().ToString());
    n_bytes += body.size();
  }
  std::cout << files.size() << " objects, " << n_bytes << " bytes\n";
  return 0;
}
