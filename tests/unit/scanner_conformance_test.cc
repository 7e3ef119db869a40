// One contract for every registered scanner (index/scanner.h), run over one minimal sample of
// each format (kSamples: one row per scanner):
//  - its own sample is recognised, ScannerFor picks it, and every scanner tried before it
//    declines it (scanners after it may recognise it: the weights scanner takes any directory
//    with a state dict, so it is tried last);
//  - the scan gives a checkpoint whose format is the scanner's name, whose item keys are unique,
//    whose records match the real files (ValidateIndexRecords: paths inside the directory,
//    every byte item and fragment inside its file, every tensor covered exactly once), and whose
//    facts (index/source_facts.h) round-trip through their stored form;
//  - a corrupt-file catalogue (each file of the sample truncated, bit-flipped, emptied, grown to
//    a huge sparse size, replaced by a symlink) scans in a child process under a memory and time
//    limit: it ends with an error naming the directory or the file, or with a checkpoint that
//    still keeps the contract and never reads through the symlink;
//  - the source is read only through its SourceTree (core/io/source_tree.h): each sample, and a
//    run folder of Hugging Face Trainer-style `checkpoint-N/` directories, is scanned once
//    through a LocalTree and once through an in-memory copy (memory_tree.h) while the directory
//    on disk is moved away, and both give the same checkpoint (files, items, replicas, facts),
//    the same catalog once stored and loaded, and the same file bytes.
// Samples are written at test time by torch 1.13 (/usr/bin/python3: DCP, Megatron-LM legacy,
// torch.save training state), unpacked from the DeepSpeed fuzz seed (a real DeepSpeed save,
// tests/fuzz/seeds/deepspeed_zero1.bin) or copied from tests/data/safetensors.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "index/catalog.h"
#include "index/catalog_codec.h"
#include "index/file_table.h"
#include "index/run_dir.h"
#include "index/scanner.h"
#include "index/source_facts.h"
#include "tests/unit/memory_tree.h"

namespace ucpfs::index {
namespace {

namespace fs = std::filesystem;

constexpr const char* kPython = "/usr/bin/python3";

fs::path TestsDir() {
  if (const char* env = std::getenv("UCPFS_TEST_DATA"); env != nullptr && *env != '\0') {
    return fs::path(env).parent_path();
  }
  return fs::path(__FILE__).parent_path().parent_path();
}

std::string Quote(const std::string& s) {
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

// Writes ROOT/dcp (torch 1.13 DCP), ROOT/megatron (a Megatron-LM legacy tp1 pp1 save with an
// FP32Optimizer state dict) and ROOT/torch_state (a script's model.pt + optim.pt, one AdamW step).
constexpr const char* kWriter = R"PY(
import argparse, os, sys
root = sys.argv[1]
sys.path.insert(0, sys.argv[2])
import torch113_compat  # noqa: F401 (must precede torch.distributed)
import torch
import torch.distributed as dist
from torch.distributed._shard.checkpoint import FileSystemWriter, save_state_dict
torch.manual_seed(0)

d = os.path.join(root, "dcp")
os.makedirs(d)
dist.init_process_group("gloo", init_method="file://" + os.path.join(root, "pg"), rank=0, world_size=1)
save_state_dict({"model.w": torch.arange(12.).view(3, 4), "model.b": torch.ones(3), "step": 3},
                storage_writer=FileSystemWriter(d))
dist.destroy_process_group()

H, FFN, VOCAB = 4, 8, 8
model = {"embedding.word_embeddings.weight": torch.randn(VOCAB, H),
         "decoder.layers.0.input_layernorm.weight": torch.ones(H),
         "decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(3 * H, H),
         "decoder.layers.0.self_attention.linear_proj.weight": torch.randn(H, H),
         "decoder.layers.0.mlp.linear_fc1.weight": torch.randn(FFN, H),
         "decoder.layers.0.mlp.linear_fc2.weight": torch.randn(H, FFN),
         "decoder.final_layernorm.weight": torch.ones(H)}
state, groups = {}, [[], []]
for i, (n, t) in enumerate(model.items()):
    state[i] = {"exp_avg": t * 2, "exp_avg_sq": t * 3, "step": torch.tensor(3.0)}
    groups[1 if t.dim() == 1 else 0].append(i)
args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, num_layers=1,
    hidden_size=H, num_attention_heads=2, group_query_attention=False, num_query_groups=None, kv_channels=2,
    ffn_hidden_size=FFN, padded_vocab_size=VOCAB, make_vocab_size_divisible_by=8, vocab_size=7, swiglu=False,
    untie_embeddings_and_output_weights=False, use_distributed_optimizer=False, expert_model_parallel_size=1,
    num_experts=None)
opt = {"state": state, "param_groups": [
    {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "lr": 0.1, "params": groups[0]},
    {"wd_mult": 0.0, "lr_mult": 1.0, "is_expert_parallel": False, "lr": 0.1, "params": groups[1]}]}
d = os.path.join(root, "megatron", "iter_0000003", "mp_rank_00")
os.makedirs(d)
torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 3, "model": model, "optimizer": opt,
            "rng_state": [{"torch_rng_state": torch.get_rng_state()}]}, os.path.join(d, "model_optim_rng.pt"))
open(os.path.join(root, "megatron", "latest_checkpointed_iteration.txt"), "w").write("3\n")

d = os.path.join(root, "torch_state")
os.makedirs(d)
net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
o = torch.optim.AdamW(net.parameters(), lr=0.01)
net(torch.randn(2, 4)).sum().backward()
o.step()
torch.save(net.state_dict(), os.path.join(d, "model.pt"))
torch.save(o.state_dict(), os.path.join(d, "optim.pt"))
)PY";

// The DeepSpeed fuzz seed's packing (tests/fuzz/deepspeed_scan_fuzz.cc): sections of kMarker,
// a role byte (the file's index in kNames; bit 0x80: in the directory itself, else in the tag
// directory; `latest` always there) and the file's bytes.
constexpr std::string_view kDsMarker = "#ucpfs-ds-file#";
constexpr std::string_view kDsTag = "global_step1";
const std::vector<std::string> kDsNames = {
    "latest", "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_2_mp_rank_00_optim_states.pt",
    "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
    "zero_pp_rank_2_mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
    "expp_rank_0_mp_rank_00_optim_states.pt", "layer_01-model_00-model_states.pt"};

bool UnpackDeepSpeedSeed(const fs::path& seed, const fs::path& dir) {
  std::ifstream in(seed, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t at = bytes.find(kDsMarker);
  if (at == std::string::npos) return false;
  fs::create_directories(dir / kDsTag);
  while (at != std::string::npos && at + kDsMarker.size() < bytes.size()) {
    const auto role = static_cast<unsigned char>(bytes[at + kDsMarker.size()]);
    const size_t begin = at + kDsMarker.size() + 1;
    const size_t next = bytes.find(kDsMarker, begin);
    const size_t end = next == std::string::npos ? bytes.size() : next;
    const std::string& name = kDsNames[(role & 0x7f) % kDsNames.size()];
    const fs::path where = (role & 0x80) || name == "latest" ? dir : dir / kDsTag;
    std::ofstream(where / name, std::ios::binary).write(bytes.data() + begin, end - begin);
    at = next;
  }
  return true;
}

// The matrix: one row per registered scanner, its name and how its sample is made under `root`
// (false: the sample could not be made, reported as a failure).
struct Sample {
  const char* scanner;
  std::function<bool(const fs::path& root, fs::path* dir)> make;
};

bool FromWriter(const fs::path& root, const char* name, fs::path* dir) {
  *dir = root / name;
  return fs::is_directory(*dir);
}

const std::vector<Sample>& Samples() {
  static const std::vector<Sample> rows = {
      {"dcp", [](const fs::path& r, fs::path* d) { return FromWriter(r, "dcp", d); }},
      {"deepspeed",
       [](const fs::path& r, fs::path* d) {
         *d = r / "deepspeed";
         return UnpackDeepSpeedSeed(TestsDir() / "fuzz" / "seeds" / "deepspeed_zero1.bin", *d);
       }},
      {"megatron", [](const fs::path& r, fs::path* d) { return FromWriter(r, "megatron", d); }},
      {"torch_state", [](const fs::path& r, fs::path* d) { return FromWriter(r, "torch_state", d); }},
      {"weights",
       [](const fs::path& r, fs::path* d) {
         *d = r / "weights";
         fs::create_directories(*d);
         std::error_code ec;
         fs::copy_file(TestsDir() / "data" / "safetensors" / "mixed.safetensors", *d / "model.safetensors",
                       fs::copy_options::overwrite_existing, ec);
         return !ec;
       }},
  };
  return rows;
}

class ScannerConformance : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string tmpl = (fs::temp_directory_path() / "ucpfs-conformance-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) return;
    root_ = new fs::path(tmpl);
    if (std::system((std::string(kPython) + " -c 'import torch' >/dev/null 2>&1").c_str()) == 0) {
      std::ofstream(*root_ / "writer.py") << kWriter;
      const std::string cmd = std::string(kPython) + " " + Quote((*root_ / "writer.py").string()) + " " +
                              Quote((*root_ / "samples").string()) + " " +
                              Quote((TestsDir() / "e2e" / "fixtures").string()) + " >" +
                              Quote((*root_ / "writer.log").string()) + " 2>&1";
      torch_ = true;
      writer_ok_ = std::system(cmd.c_str()) == 0;
    }
  }
  static void TearDownTestSuite() {
    if (root_ != nullptr && std::getenv("UCPFS_KEEP_FIXTURES") == nullptr) fs::remove_all(*root_);
    delete root_;
    root_ = nullptr;
  }
  void SetUp() override {
    if (root_ == nullptr) GTEST_SKIP() << "no temporary directory";
    if (!torch_) GTEST_SKIP() << "torch 1.13 at /usr/bin/python3 is needed to write the samples";
    if (!writer_ok_) {
      std::ifstream log(*root_ / "writer.log");
      FAIL() << "the sample writer failed:\n" << std::string((std::istreambuf_iterator<char>(log)), {});
    }
  }
  static const Scanner* ByName(std::string_view name) {
    for (const Scanner* s : Scanners()) {
      if (s->Name() == name) return s;
    }
    return nullptr;
  }
  static fs::path SampleDir(const Sample& row) {
    fs::path dir;
    EXPECT_TRUE(row.make(*root_ / "samples", &dir)) << row.scanner << ": its sample could not be made";
    return dir;
  }
  static inline fs::path* root_ = nullptr;
  static inline bool torch_ = false;
  static inline bool writer_ok_ = false;
};

// What every scan that succeeds must give (the contract's invariants).
void ExpectContract(const Scanner& scanner, const fs::path& dir, const Checkpoint& c, const std::string& what) {
  EXPECT_EQ(c.format, scanner.Name()) << what;
  EXPECT_FALSE(c.items.empty()) << what;
  std::set<std::string> keys;
  for (const Item& it : c.items) EXPECT_TRUE(keys.insert(it.key).second) << what << ": key '" << it.key << "' twice";
  for (const SourceFile& f : c.files) EXPECT_TRUE(SafeRelativePath(f.rel_path)) << what << ": " << f.rel_path;
  const Status valid = ValidateIndexRecords(LocalTree(dir.string()), "(conformance)", c);
  EXPECT_TRUE(valid.ok()) << what << ": " << valid.message();
  const std::string stored = EncodeSourceFacts(c.facts);
  EXPECT_LE(stored.size(), kMaxSourceFactsBytes) << what;
  Result<SourceFacts> decoded = DecodeSourceFacts(stored);
  ASSERT_TRUE(decoded.ok()) << what << ": the facts do not decode: " << decoded.error().message();
  EXPECT_EQ(EncodeSourceFacts(*decoded), stored) << what << ": the facts do not round-trip";
  EXPECT_EQ(decoded->index(), c.facts.index()) << what;
}

TEST_F(ScannerConformance, EveryScannerHasARow) {
  std::set<std::string> rows;
  for (const Sample& row : Samples()) rows.insert(row.scanner);
  for (const Scanner* s : Scanners()) {
    EXPECT_EQ(rows.count(std::string(s->Name())), 1u)
        << "scanner '" << s->Name() << "' has no row in this suite's matrix (Samples())";
  }
  EXPECT_EQ(rows.size(), Scanners().size());
}

TEST_F(ScannerConformance, RecognisesItsOwnAndEarlierScannersDeclineIt) {
  for (const Sample& row : Samples()) {
    const fs::path dir = SampleDir(row);
    const Scanner* own = ByName(row.scanner);
    ASSERT_NE(own, nullptr) << row.scanner;
    EXPECT_TRUE(own->Recognizes(LocalTree(dir.string()))) << row.scanner << " does not recognise its own sample";
    for (const Scanner* s : Scanners()) {
      if (s == own) break;
      EXPECT_FALSE(s->Recognizes(LocalTree(dir.string()))) << s->Name() << " recognises " << row.scanner << "'s sample";
    }
    Result<const Scanner*> picked = ScannerFor(LocalTree(dir.string()));
    ASSERT_TRUE(picked.ok()) << row.scanner << ": " << picked.error().message();
    EXPECT_EQ((*picked)->Name(), own->Name()) << row.scanner << "'s sample";
  }
}

TEST_F(ScannerConformance, ScansKeepTheContract) {
  for (const Sample& row : Samples()) {
    const fs::path dir = SampleDir(row);
    const Scanner* own = ByName(row.scanner);
    ASSERT_NE(own, nullptr);
    Result<Checkpoint> c = own->Scan(LocalTree(dir.string()), nullptr);
    ASSERT_TRUE(c.ok()) << row.scanner << ": " << c.error().message();
    EXPECT_FALSE(std::holds_alternative<std::monostate>(c->facts)) << row.scanner << " hands over no facts";
    ExpectContract(*own, dir, *c, row.scanner);
  }
}

// ---- one seam: the same checkpoint through any SourceTree -----------------------------------

// The catalog's content of a checkpoint, as comparable text: every file (path, size, mtime:
// device, inode and ctime are the store's own), every item and replica as the catalog encodes
// it (and whether it is a model tensor), and the facts in their stored form.
std::vector<std::string> CatalogContent(const Checkpoint& c) {
  std::vector<std::string> out = {"format " + c.format, "flavor " + c.flavor, "facts " + EncodeSourceFacts(c.facts)};
  for (const SourceFile& f : c.files) {
    out.push_back("file " + f.rel_path + " " + std::to_string(f.n_bytes) + " " + std::to_string(f.mtime_ns));
  }
  for (const Item& it : c.items) out.push_back("item " + codec::EncodeItem(it) + (it.model_tensor ? " model" : ""));
  for (const Item& it : c.replicas) out.push_back("replica " + codec::EncodeItem(it));
  return out;
}

// Every file of the checkpoint read whole through a file table.
std::vector<std::vector<std::byte>> FileBytes(const FileTable& table) {
  std::vector<std::vector<std::byte>> out;
  for (const auto& src : *table) {
    Result<std::vector<std::byte>> bytes = ReadRange(*src, 0, src->Size());
    EXPECT_TRUE(bytes.ok()) << src->Name() << ": " << (bytes.ok() ? "" : bytes.error().message());
    out.push_back(bytes.ok() ? std::move(*bytes) : std::vector<std::byte>{});
  }
  return out;
}

// Moves `dir` away for its lifetime, so nothing can read it by path.
class MovedAway {
 public:
  explicit MovedAway(fs::path dir) : dir_(std::move(dir)), away_(dir_.string() + ".away") { fs::rename(dir_, away_); }
  ~MovedAway() { fs::rename(away_, dir_); }

 private:
  fs::path dir_, away_;
};

// Scans `dir` through a LocalTree, then through an in-memory copy of it with the directory
// moved away (Root() the same path, so messages and facts may name it), and requires the same
// catalog content; then stores both through the catalog (IndexOptions::tree), loads them back and
// reads every file through OpenFileTable.
void ExpectSameThroughMemory(const Scanner& scanner, const fs::path& dir, const fs::path& index_root,
                             const std::string& what) {
  const LocalTree local(dir.string());
  Result<Checkpoint> on_disk = scanner.Scan(local, nullptr);
  ASSERT_TRUE(on_disk.ok()) << what << ": " << on_disk.error().message();
  Result<FileTable> disk_table = OpenFileTable(local, *on_disk, nullptr);
  ASSERT_TRUE(disk_table.ok()) << what;
  const std::vector<std::vector<std::byte>> disk_bytes = FileBytes(*disk_table);

  const std::shared_ptr<const testing::MemoryTree> memory = testing::MemoryTree::CopyOf(dir, dir.string());
  MovedAway away(dir);
  ASSERT_FALSE(local.IsDirectory("")) << what << ": the directory is still there";
  EXPECT_TRUE(scanner.Recognizes(*memory)) << what << ": not recognised in memory";
  Result<const Scanner*> picked = ScannerFor(*memory);
  ASSERT_TRUE(picked.ok()) << what << ": " << picked.error().message();
  EXPECT_EQ((*picked)->Name(), scanner.Name()) << what;
  Result<Checkpoint> in_memory = scanner.Scan(*memory, nullptr);
  ASSERT_TRUE(in_memory.ok()) << what << " (in memory): " << in_memory.error().message();
  EXPECT_EQ(CatalogContent(*in_memory), CatalogContent(*on_disk)) << what;
  EXPECT_GT(memory->opens.load(), 0u) << what;

  // The catalog through the tree: fingerprint, scan, store; then reuse (records checked against
  // the tree's files).
  IndexOptions io;
  io.index_dir = (index_root / scanner.Name()).string();
  io.tree = memory;
  Result<OpenedIndex> built = OpenOrBuildIndex(dir.string(), io);
  ASSERT_TRUE(built.ok()) << what << ": " << built.error().message();
  EXPECT_EQ(built->state, IndexState::kBuilt) << what;
  Result<OpenedIndex> reused = OpenOrBuildIndex(dir.string(), io);
  ASSERT_TRUE(reused.ok()) << what << ": " << reused.error().message();
  EXPECT_EQ(reused->state, IndexState::kReused) << what;
  EXPECT_EQ(CatalogContent(reused->checkpoint), CatalogContent(*on_disk)) << what;

  Result<FileTable> memory_table = OpenFileTable(*memory, reused->checkpoint, nullptr);
  ASSERT_TRUE(memory_table.ok()) << what;
  EXPECT_TRUE(FileBytes(*memory_table) == disk_bytes) << what << ": the files read differ";
}

TEST_F(ScannerConformance, ScansReadTheSourceOnlyThroughItsTree) {
  for (const Sample& row : Samples()) {
    const fs::path dir = SampleDir(row);
    const Scanner* own = ByName(row.scanner);
    ASSERT_NE(own, nullptr);
    ExpectSameThroughMemory(*own, dir, *root_ / "tree-index", row.scanner);
  }
}

// A run folder (index/run_dir.h) of two Hugging Face Trainer-style `checkpoint-N/` directories
// (weights and trainer_state.json, the Trainer's completion marker): the same checkpoints, the
// newest last, through both trees, and each scans the same through its subtree.
TEST_F(ScannerConformance, RunFoldersAreTheSameThroughAnyTree) {
  const Sample* weights = nullptr;
  for (const Sample& row : Samples()) {
    if (std::string_view(row.scanner) == "weights") weights = &row;
  }
  ASSERT_NE(weights, nullptr);
  const fs::path sample = SampleDir(*weights);
  const fs::path run = *root_ / "run";
  fs::remove_all(run);
  for (int step : {1, 2}) {
    const fs::path c = run / ("checkpoint-" + std::to_string(step));
    fs::create_directories(c);
    fs::copy(sample, c, fs::copy_options::recursive);
    std::ofstream(c / "trainer_state.json") << "{\"global_step\": " << step << "}\n";
    // checkpoint-1 older, whatever the clock did while copying.
    fs::last_write_time(c / "trainer_state.json", fs::file_time_type::clock::now() + std::chrono::hours(step));
  }
  const LocalTree local(run.string());
  Result<RunCheckpoints> on_disk = FindRunCheckpoints(local);
  ASSERT_TRUE(on_disk.ok()) << on_disk.error().message();
  ASSERT_EQ(on_disk->checkpoints.size(), 2u);
  EXPECT_EQ(on_disk->checkpoints.back().name, "checkpoint-2");
  std::vector<Checkpoint> scanned;
  for (const RunCheckpoint& c : on_disk->checkpoints) {
    Result<Checkpoint> one = ScanCheckpoint(LocalTree(run / c.name));
    ASSERT_TRUE(one.ok()) << c.name << ": " << one.error().message();
    scanned.push_back(std::move(*one));
  }

  const std::shared_ptr<const testing::MemoryTree> memory = testing::MemoryTree::CopyOf(run, run.string());
  MovedAway away(run);
  Result<RunCheckpoints> in_memory = FindRunCheckpoints(*memory);
  ASSERT_TRUE(in_memory.ok()) << in_memory.error().message();
  ASSERT_EQ(in_memory->checkpoints.size(), on_disk->checkpoints.size());
  for (size_t i = 0; i < in_memory->checkpoints.size(); ++i) {
    const RunCheckpoint& m = in_memory->checkpoints[i];
    const RunCheckpoint& d = on_disk->checkpoints[i];
    EXPECT_EQ(m.name, d.name);
    EXPECT_EQ(m.marker, d.marker);
    EXPECT_EQ(m.marker_mtime_ns, d.marker_mtime_ns);
    Result<std::shared_ptr<const SourceTree>> sub = memory->Subtree(m.name);
    ASSERT_TRUE(sub.ok());
    Result<Checkpoint> one = ScanCheckpoint(**sub);
    ASSERT_TRUE(one.ok()) << m.name << ": " << one.error().message();
    EXPECT_EQ(CatalogContent(*one), CatalogContent(scanned[i])) << m.name;
  }
}

// ---- the corrupt-file catalogue -------------------------------------------------------------

enum class Damage { kTruncate, kBitFlip, kEmpty, kHuge, kSymlink };
constexpr Damage kDamages[] = {Damage::kTruncate, Damage::kBitFlip, Damage::kEmpty, Damage::kHuge, Damage::kSymlink};
const char* DamageName(Damage d) {
  switch (d) {
    case Damage::kTruncate: return "truncated";
    case Damage::kBitFlip: return "bit-flipped";
    case Damage::kEmpty: return "empty";
    case Damage::kHuge: return "huge";
    case Damage::kSymlink: return "symlink";
  }
  return "?";
}

constexpr uint64_t kHugeBytes = uint64_t{1} << 36;  // 64 GiB, sparse
constexpr rlim_t kChildMemoryBytes = rlim_t{1} << 31;
constexpr unsigned kChildSeconds = 60;

void ApplyDamage(const fs::path& file, Damage d, const fs::path& outside) {
  const uint64_t size = fs::file_size(file);
  switch (d) {
    case Damage::kTruncate: fs::resize_file(file, size / 2); break;
    case Damage::kEmpty: fs::resize_file(file, 0); break;
    case Damage::kHuge: fs::resize_file(file, kHugeBytes); break;
    case Damage::kBitFlip: {
      std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
      // Bits spread over the file: headers, the middle, the tail (zip directory, metadata).
      for (const uint64_t at : {uint64_t{0}, uint64_t{9}, size / 3, size / 2, size - size / 5, size - 23, size - 1}) {
        if (at >= size) continue;
        char c = 0;
        f.seekg(static_cast<std::streamoff>(at));
        f.get(c);
        f.seekp(static_cast<std::streamoff>(at));
        f.put(static_cast<char>(c ^ 0x5a));
      }
      break;
    }
    case Damage::kSymlink: {
      fs::copy_file(file, outside, fs::copy_options::overwrite_existing);
      fs::remove(file);
      fs::create_symlink(outside, file);
      break;
    }
  }
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitizerBuild = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitizerBuild = true;
#else
constexpr bool kSanitizerBuild = false;
#endif
#else
constexpr bool kSanitizerBuild = false;
#endif

// The scan of `dir` in a child process with bounded memory and time: "ok" + the stored
// checkpoint's checks done in the child, or "error" + the message. A child killed by a signal
// (a crash, the memory or time limit) returns its description.
struct ChildScan {
  bool exited = false;
  std::string outcome;  // "ok", "error: <message>", or "contract: <what failed>"
};

ChildScan ScanInChild(const Scanner& scanner, const fs::path& dir, const std::string& damaged_rel, bool symlink) {
  int fds[2];
  if (::pipe(fds) != 0) return {false, "pipe failed"};
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    // The address-space limit bounds memory; sanitizer builds reserve terabytes of shadow
    // address space, so there the time limit alone bounds the child (the memory bound is
    // checked by the plain build).
    if (!kSanitizerBuild) {
      rlimit mem{kChildMemoryBytes, kChildMemoryBytes};
      ::setrlimit(RLIMIT_AS, &mem);
    }
    ::alarm(kChildSeconds);
    std::string out;
    Result<Checkpoint> c = scanner.Scan(LocalTree(dir.string()), nullptr);
    if (!c.ok()) {
      out = "error: " + c.error().message();
    } else {
      out = "ok";
      std::set<std::string> keys;
      for (const Item& it : c->items) {
        if (!keys.insert(it.key).second) out = "contract: key '" + it.key + "' twice";
      }
      const Status valid = ValidateIndexRecords(LocalTree(dir.string()), "(conformance)", *c);
      if (!valid.ok()) out = "contract: " + valid.message();
      if (!DecodeSourceFacts(EncodeSourceFacts(c->facts)).ok()) out = "contract: the facts do not round-trip";
      for (const SourceFile& f : c->files) {
        if (symlink && f.rel_path == damaged_rel) out = "contract: the symlinked file is in the file table";
      }
    }
    (void)!::write(fds[1], out.data(), out.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) {
    return {false, std::string("killed by signal ") + std::to_string(WTERMSIG(status)) + " (" +
                       strsignal(WTERMSIG(status)) + ")"};
  }
  return {WIFEXITED(status) && WEXITSTATUS(status) == 0, out};
}

TEST_F(ScannerConformance, CorruptFilesGiveClearErrorsInBoundedMemory) {
  for (const Sample& row : Samples()) {
    const fs::path sample = SampleDir(row);
    const Scanner* own = ByName(row.scanner);
    ASSERT_NE(own, nullptr);
    std::vector<fs::path> rels;
    for (const auto& e : fs::recursive_directory_iterator(sample)) {
      if (e.is_regular_file() && e.file_size() > 0) rels.push_back(fs::relative(e.path(), sample));
    }
    ASSERT_FALSE(rels.empty()) << row.scanner;
    int n_ok = 0, n_error = 0;
    for (const fs::path& rel : rels) {
      for (const Damage d : kDamages) {
        const std::string what = std::string(row.scanner) + ": " + rel.string() + " " + DamageName(d);
        const fs::path dir = *root_ / "damaged" / row.scanner;
        fs::remove_all(dir);
        fs::create_directories(dir.parent_path());
        fs::copy(sample, dir, fs::copy_options::recursive);
        ApplyDamage(dir / rel, d, *root_ / "outside.bin");
        const ChildScan r = ScanInChild(*own, dir, rel.string(), d == Damage::kSymlink);
        if (std::getenv("UCPFS_CONFORMANCE_VERBOSE") != nullptr) std::cout << what << ": " << r.outcome << "\n";
        ++(r.outcome == "ok" ? n_ok : n_error);
        ASSERT_TRUE(r.exited) << what << ": the scan did not end cleanly: " << r.outcome;
        EXPECT_EQ(r.outcome.rfind("contract:", 0), std::string::npos) << what << ": " << r.outcome;
        if (r.outcome.rfind("error: ", 0) == 0) {
          // A clear error names where it failed: the directory or the file.
          const bool named = r.outcome.find(dir.string()) != std::string::npos ||
                             r.outcome.find(rel.filename().string()) != std::string::npos;
          EXPECT_TRUE(named) << what << ": the error names neither the directory nor the file: " << r.outcome;
        }
      }
    }
    fs::remove_all(*root_ / "damaged" / row.scanner);
    std::cout << row.scanner << ": " << rels.size() << " files x " << std::size(kDamages) << " damages: " << n_error
              << " refused, " << n_ok << " scanned\n";
  }
}

}  // namespace
}  // namespace ucpfs::index
