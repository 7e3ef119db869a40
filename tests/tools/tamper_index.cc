// tamper_index: rewrites one record of an existing ucpfs index while keeping its fingerprint,
// as an attacker who ships a prebuilt `.ucpfs/` with a checkpoint would, so end-to-end tests
// can check that a crafted index is validated record by record (rebuilt or refused, never
// served).
//
//   tamper_index INDEX_DIR path FILE_ID NEW_REL_PATH   file FILE_ID's path (e.g. "../x.distcp")
//   tamper_index INDEX_DIR grow FILE_ID                 file FILE_ID's size + 1 MiB
//   tamper_index INDEX_DIR offset KEY_SUFFIX            moves the first fragment of the first
//                                                        tensor item whose key ends in KEY_SUFFIX
//                                                        to the last byte of its file
// Errors go to stderr with a non-zero exit. Not for: anything but tests.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "index/catalog.h"

namespace {

int Fail(const std::string& msg) {
  std::fprintf(stderr, "tamper_index: %s\n", msg.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ucpfs;
  if (argc < 4) return Fail("usage: tamper_index INDEX_DIR path|grow|offset ARGS... (see the source)");
  const std::string dir = argv[1];
  const std::string what = argv[2];
  uint64_t fingerprint = 0;
  Result<index::Checkpoint> loaded = index::LoadCheckpoint(dir, /*read_only=*/true, &fingerprint);
  if (!loaded.ok()) return Fail(loaded.error().ToString());
  index::Checkpoint cp = std::move(loaded).value();
  if (what == "path" || what == "grow") {
    const unsigned long file_id = std::strtoul(argv[3], nullptr, 10);
    if (file_id >= cp.files.size()) return Fail("no file " + std::to_string(file_id));
    if (what == "path") {
      if (argc != 5) return Fail("path needs FILE_ID NEW_REL_PATH");
      cp.files[file_id].rel_path = argv[4];
    } else {
      cp.files[file_id].n_bytes += 1 << 20;
    }
  } else if (what == "offset") {
    const std::string suffix = argv[3];
    bool done = false;
    for (index::Item& item : cp.items) {
      if (item.kind != index::ItemKind::kTensor || item.layout.fragments.empty()) continue;
      if (item.key.size() < suffix.size() || item.key.compare(item.key.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
      auto& frag = item.layout.fragments[0];
      frag.byte_offset = cp.files.at(frag.file_id).n_bytes - 1;
      done = true;
      break;
    }
    if (!done) return Fail("no tensor item ends in " + suffix);
  } else {
    return Fail("unknown change " + what);
  }
  Status stored = index::StoreCheckpoint(dir, cp, fingerprint);
  if (!stored.ok()) return Fail(stored.ToString());
  return 0;
}
