// libFuzzer target: a DeepSpeed save directory built from arbitrary bytes must scan into a
// Checkpoint or give a clean error, never crash, hang or allocate without bound; what scans must
// hold up: every fragment inside its file, every tensor covered exactly once
// (ValidateIndexRecords), facts that round-trip in bounded size, every record storable by the catalog
// codec, progress never past its total.
//
// Input: sections, each the marker kMarker, one role byte, then the file's bytes up to the next
// marker (bytes before the first marker are ignored; a role given twice: the last one wins). The
// role picks the file's name from kNames, in the tag directory global_step1/ or, with bit 0x80,
// in the directory itself (no tag). A name never comes from the input, so nothing is written
// outside the scratch directory. Seeds (tests/fuzz/seeds/deepspeed_*.bin) are real DeepSpeed
// saves of a tiny model packed this way by tests/fuzz/deepspeed_seeds.py, which reads kMarker,
// kTag and kNames from this file.
//
// Each run writes its files into one scratch directory per process ($TMPDIR, else /dev/shm,
// else /tmp), scans it, then removes them; the directory itself goes at exit (a crash leaves it
// behind with the crashing input's files, ready for `ucpfs inspect`).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "index/catalog.h"
#include "index/catalog_codec.h"
#include "index/deepspeed_scan.h"

namespace {

constexpr std::string_view kMarker = "#ucpfs-ds-file#";
constexpr std::string_view kTag = "global_step1";
// tests/fuzz/deepspeed_seeds.py reads kMarker, kTag and kNames from here: keep them one-line literals.
constexpr std::array<std::string_view, 13> kNames = {
    "latest",
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "zero_pp_rank_2_mp_rank_00_optim_states.pt",
    "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "zero_pp_rank_0_mp_rank_00_model_states.pt",
    "zero_pp_rank_1_mp_rank_00_model_states.pt",
    "zero_pp_rank_2_mp_rank_00_model_states.pt",
    "mp_rank_01_model_states.pt",
    "expp_rank_0_mp_rank_00_optim_states.pt",
    "layer_01-model_00-model_states.pt",
};

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "deepspeed_scan_fuzz: %s\n", what.c_str());
  std::abort();
}

std::string ScratchRoot() {
  for (const char* base : {static_cast<const char*>(std::getenv("TMPDIR")), "/dev/shm", "/tmp"}) {
    if (base == nullptr || *base == '\0') continue;
    std::string tmpl = std::string(base) + "/ucpfs-ds-fuzz-XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) return tmpl;
  }
  Fail("cannot create a scratch directory");
}

// The scratch directory, with its tag directory, made on first use and removed at exit.
const std::string& Scratch() {
  // Never destroyed: the atexit handler below still needs it.
  static const std::string& root = *new std::string([] {
    std::string r = ScratchRoot();
    const std::string tag_dir = r + "/" + std::string(kTag);
    if (::mkdir(tag_dir.c_str(), 0755) != 0) Fail("cannot create " + tag_dir);
    std::atexit([] {
      ::rmdir((Scratch() + "/" + std::string(kTag)).c_str());
      ::rmdir(Scratch().c_str());
    });
    return r;
  }());
  return root;
}

void WriteFile(const std::string& path, std::string_view bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) Fail("cannot create " + path);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) Fail("cannot write " + path);
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

// What a successful scan must satisfy beyond returning.
void CheckScan(const std::string& dir, const ucpfs::index::Checkpoint& cp) {
  using namespace ucpfs::index;
  if (ucpfs::Status valid = ValidateIndexRecords(ucpfs::LocalTree(dir), "(fuzz scan)", cp); !valid.ok()) Fail(valid.message());
  const std::string facts = EncodeSourceFacts(cp.facts);
  if (facts.size() > kMaxSourceFactsBytes || !DecodeSourceFacts(facts).ok()) {
    Fail("the scanner's facts do not round-trip in at most kMaxSourceFactsBytes");
  }
  for (const SourceFile& f : cp.files) {
    if (!codec::DecodeSourceFile(codec::EncodeSourceFile(f)).ok()) Fail("file " + f.rel_path + " does not round-trip");
  }
  for (const Item& item : cp.items) {
    const std::string record = codec::EncodeItem(item);
    ucpfs::Result<Item> back = codec::DecodeItem(record);
    if (!back.ok() || codec::EncodeItem(*back) != record) Fail("item " + item.key + " does not round-trip");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const std::string& dir = Scratch();
  std::map<std::string, std::string_view> files;  // path -> bytes
  for (size_t at = input.find(kMarker); at != std::string_view::npos && at + kMarker.size() < input.size();) {
    const auto role = static_cast<uint8_t>(input[at + kMarker.size()]);
    const size_t begin = at + kMarker.size() + 1;
    const size_t next = input.find(kMarker, begin);
    const std::string_view name = kNames[(role & 0x7f) % kNames.size()];
    const bool top = (role & 0x80) != 0 || name == "latest";
    files[dir + "/" + (top ? "" : std::string(kTag) + "/") + std::string(name)] =
        input.substr(begin, next == std::string_view::npos ? std::string_view::npos : next - begin);
    at = next;
  }
  for (const auto& [path, bytes] : files) WriteFile(path, bytes);

  uint64_t last_done = 0;
  auto progress = [&last_done](uint64_t done, uint64_t total) {
    if (done > total || done <= last_done) Fail("progress " + std::to_string(done) + "/" + std::to_string(total));
    last_done = done;
  };
  ucpfs::Result<ucpfs::index::Checkpoint> cp = ucpfs::index::ScanDeepSpeed(ucpfs::LocalTree(dir), progress);
  if (cp.ok()) CheckScan(dir, *cp);

  for (const auto& [path, bytes] : files) ::unlink(path.c_str());
  return 0;
}
