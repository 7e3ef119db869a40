// LMDB catalog: record codec (round trip, every truncation, corrupt fields), store/load,
// schema and record corruption, fingerprinting, OpenOrBuildIndex states (built, reused,
// rebuilt after a change or corruption, read-only), the build lock across processes, the
// untrusted index location (symlinks, FIFOs, hard links, publishing through a temporary file
// with and without O_TMPFILE, read-only mounts), and the default index location.
#include "index/catalog.h"

#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <lmdb.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "index/catalog_codec.h"
#include "index/dcp_scan.h"
#include "index/key_map.h"
#include "tests/unit/test_seed.h"

namespace ucpfs::index {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "ucpfs_catalog_XXXXXX").string();
    char* p = ::mkdtemp(tmpl.data());
    EXPECT_NE(p, nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    // Make everything writable again (tests chmod directories read-only) before removing.
    for (auto it = fs::recursive_directory_iterator(path_, ec); !ec && it != fs::recursive_directory_iterator();
         it.increment(ec)) {
      fs::permissions(it->path(), fs::perms::owner_all, fs::perm_options::add, ec);
    }
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& rel) const { return path_ + "/" + rel; }

 private:
  std::string path_;
};

void WriteFile(const std::string& path, const std::string& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
  ASSERT_TRUE(out.good()) << path;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The names in `dir`, sorted (symlinks listed, not followed).
std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// What a file outside the checkpoint must keep: its bytes and its mtime.
struct FileSnapshot {
  std::string bytes;
  int64_t mtime_ns = -1;
  bool operator==(const FileSnapshot&) const = default;
};

FileSnapshot Snapshot(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return {};
  return {ReadFile(path), int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec};
}

void SetMtime(const std::string& path, int64_t sec, int64_t nsec) {
  struct timespec ts[2];
  ts[0].tv_sec = sec;
  ts[0].tv_nsec = nsec;
  ts[1] = ts[0];
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), ts, 0), 0) << path;
}

slice::Fragment Frag(std::vector<int64_t> offsets, std::vector<int64_t> sizes, uint32_t file_id,
                     uint64_t byte_offset, DType dtype = DType::kFloat32) {
  slice::Fragment f;
  f.box.offsets = std::move(offsets);
  f.box.sizes = std::move(sizes);
  f.flat_lo = 0;
  f.flat_hi = f.box.Volume();
  f.file_id = file_id;
  f.byte_offset = byte_offset;
  f.dtype = dtype;
  return f;
}

Item Tensor(std::string key, DType dtype, std::vector<int64_t> shape, std::vector<slice::Fragment> frags) {
  Item item;
  item.key = std::move(key);
  item.kind = ItemKind::kTensor;
  item.dtype = dtype;
  item.layout.shape = std::move(shape);
  item.layout.fragments = std::move(frags);
  return item;
}

Item Bytes(std::string key, uint32_t file_id, uint64_t byte_offset, uint64_t n_bytes) {
  Item item;
  item.key = std::move(key);
  item.kind = ItemKind::kBytes;
  item.file_id = file_id;
  item.byte_offset = byte_offset;
  item.n_bytes = n_bytes;
  return item;
}

// Every field the model has, with values that would expose a swapped or narrowed field.
Checkpoint RichCheckpoint() {
  Checkpoint cp;
  cp.format = "dcp";
  cp.flavor = "megatron-torch_dist";
  DcpSourceFacts facts;
  facts.megatron_core = true;
  facts.args = MegatronCoreArgs{};
  facts.args->vocab_size = 50257;
  facts.args->num_query_groups = 8;
  facts.args->apply_wd_to_qk_layernorm = true;
  cp.facts = facts;
  cp.files = {{"__0_0.distcp", 5156, 1700000000123456789},
              {"__1_0.distcp", 2369, -5},  // pre-epoch mtimes exist (e.g. restored archives)
              {"sub dir/ünïcode.distcp", (uint64_t{1} << 40) + 7, 0},
              {"common.pt", 0, 42}};
  // Row shards in two files.
  cp.items.push_back(Tensor("model.w", DType::kFloat32, {8, 6},
                            {Frag({0, 0}, {4, 6}, 0, 1293), Frag({4, 0}, {4, 6}, 1, 0)}));
  // Bytes items between tensors keep their order.
  cp.items.push_back(Bytes("step", 0, 0, 431));
  // A transposed (strided) chunk stored in bf16.
  {
    slice::Fragment a = Frag({0, 0}, {3, 5}, 0, 4096, DType::kBFloat16);
    a.strides = {1, 3};
    slice::Fragment b = Frag({0, 5}, {3, 5}, 1, 1558, DType::kBFloat16);
    b.strides = {1, 3};
    cp.items.push_back(Tensor("model.col", DType::kBFloat16, {3, 10}, {a, b}));
    cp.items.back().model_tensor = true;
  }
  // Megatron flattened ranges over an ND-reformulated shape.
  {
    slice::Fragment a = Frag({0, 0, 0}, {1, 1, 24}, 2, uint64_t{1} << 39, DType::kFloat32);
    a.flat_lo = 0;
    a.flat_hi = 10;
    slice::Fragment b = Frag({0, 0, 0}, {1, 1, 24}, 3, 77, DType::kFloat32);
    b.flat_lo = 10;
    b.flat_hi = 24;
    slice::Fragment c = Frag({1, 0, 0}, {1, 1, 24}, 2, 999, DType::kFloat32);
    cp.items.push_back(Tensor("optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight",
                              DType::kFloat32, {2, 1, 24}, {a, b, c}));
  }
  // A mean of three tp ranks' copies (parameter_to_average_patterns), in two ZeRO flat ranges.
  {
    slice::Fragment a = Frag({0}, {6}, 0, 64);
    a.flat_hi = 4;
    a.mean_with = {{1, 128, DType::kFloat32}, {2, 8, DType::kBFloat16}};
    slice::Fragment b = Frag({0}, {6}, 1, 0);
    b.flat_lo = 4;
    b.mean_with = {{0, 200, DType::kFloat32}, {2, 4, DType::kFloat32}};
    cp.items.push_back(Tensor("optimizer.state.3.input_layernorm.weight.exp_avg", DType::kFloat32, {6}, {a, b}));
  }
  // 0-d tensor.
  cp.items.push_back(Tensor("model.scalar", DType::kFloat64, {}, {Frag({}, {}, 0, 4409, DType::kFloat64)}));
  // Many fragments.
  {
    std::vector<slice::Fragment> frags;
    for (int64_t r = 0; r < 200; ++r) frags.push_back(Frag({r, 0}, {1, 4}, static_cast<uint32_t>(r % 4),
                                                           static_cast<uint64_t>(r) * 16, DType::kInt64));
    cp.items.push_back(Tensor("model.many", DType::kInt64, {200, 4}, std::move(frags)));
  }
  // An empty tensor (a dim of 0) and an empty key.
  cp.items.push_back(Tensor("model.empty", DType::kFloat8E4M3FN, {0, 3}, {}));
  cp.items.push_back(Bytes("", 3, UINT64_MAX - 1, UINT64_MAX));
  return cp;
}

void ExpectFragmentEq(const slice::Fragment& a, const slice::Fragment& b, const std::string& what) {
  EXPECT_EQ(a.box.offsets, b.box.offsets) << what;
  EXPECT_EQ(a.box.sizes, b.box.sizes) << what;
  EXPECT_EQ(a.flat_lo, b.flat_lo) << what;
  EXPECT_EQ(a.flat_hi, b.flat_hi) << what;
  EXPECT_EQ(a.file_id, b.file_id) << what;
  EXPECT_EQ(a.byte_offset, b.byte_offset) << what;
  EXPECT_EQ(a.dtype, b.dtype) << what;
  EXPECT_EQ(a.strides, b.strides) << what;
  EXPECT_EQ(a.mean_with, b.mean_with) << what;
}

void ExpectItemEq(const Item& a, const Item& b) {
  EXPECT_EQ(a.key, b.key);
  EXPECT_EQ(a.kind, b.kind) << a.key;
  if (a.kind == ItemKind::kTensor) {
    EXPECT_EQ(a.dtype, b.dtype) << a.key;
    EXPECT_EQ(a.model_tensor, b.model_tensor) << a.key;
    EXPECT_EQ(a.layout.shape, b.layout.shape) << a.key;
    ASSERT_EQ(a.layout.fragments.size(), b.layout.fragments.size()) << a.key;
    for (size_t j = 0; j < a.layout.fragments.size(); ++j) {
      ExpectFragmentEq(a.layout.fragments[j], b.layout.fragments[j], a.key + " fragment " + std::to_string(j));
    }
  } else {
    EXPECT_EQ(a.file_id, b.file_id) << a.key;
    EXPECT_EQ(a.byte_offset, b.byte_offset) << a.key;
    EXPECT_EQ(a.n_bytes, b.n_bytes) << a.key;
  }
}

void ExpectCheckpointEq(const Checkpoint& a, const Checkpoint& b) {
  EXPECT_EQ(a.format, b.format);
  EXPECT_EQ(a.flavor, b.flavor);
  EXPECT_EQ(EncodeSourceFacts(a.facts), EncodeSourceFacts(b.facts));
  ASSERT_EQ(a.files.size(), b.files.size());
  for (size_t i = 0; i < a.files.size(); ++i) {
    EXPECT_EQ(a.files[i].rel_path, b.files[i].rel_path);
    EXPECT_EQ(a.files[i].n_bytes, b.files[i].n_bytes);
    EXPECT_EQ(a.files[i].mtime_ns, b.files[i].mtime_ns);
  }
  ASSERT_EQ(a.items.size(), b.items.size());
  for (size_t i = 0; i < a.items.size(); ++i) ExpectItemEq(a.items[i], b.items[i]);
}

// Rewrites one value in an existing environment, bypassing the catalog.
void PutRaw(const std::string& index_dir, const char* db, const std::string& key, const std::string& value) {
  MDB_env* env = nullptr;
  ASSERT_EQ(mdb_env_create(&env), 0);
  ASSERT_EQ(mdb_env_set_maxdbs(env, 4), 0);
  ASSERT_EQ(mdb_env_set_mapsize(env, size_t{1} << 30), 0);
  ASSERT_EQ(mdb_env_open(env, index_dir.c_str(), MDB_NOTLS, 0644), 0);
  MDB_txn* txn = nullptr;
  ASSERT_EQ(mdb_txn_begin(env, nullptr, 0, &txn), 0);
  MDB_dbi dbi;
  ASSERT_EQ(mdb_dbi_open(txn, db, 0, &dbi), 0);
  MDB_val k{key.size(), const_cast<char*>(key.data())};
  MDB_val v{value.size(), const_cast<char*>(value.data())};
  ASSERT_EQ(mdb_put(txn, dbi, &k, &v, 0), 0);
  ASSERT_EQ(mdb_txn_commit(txn), 0);
  mdb_env_close(env);
}

// ---- codec ----

TEST(CatalogCodec, RoundTripsEveryRecord) {
  Checkpoint cp = RichCheckpoint();
  for (const SourceFile& f : cp.files) {
    Result<SourceFile> back = codec::DecodeSourceFile(codec::EncodeSourceFile(f));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->rel_path, f.rel_path);
    EXPECT_EQ(back->n_bytes, f.n_bytes);
    EXPECT_EQ(back->mtime_ns, f.mtime_ns);
  }
  for (const Item& item : cp.items) {
    Result<Item> back = codec::DecodeItem(codec::EncodeItem(item));
    ASSERT_TRUE(back.ok()) << item.key << ": " << back.status().ToString();
    ExpectItemEq(item, *back);
  }
}

TEST(CatalogCodec, EveryTruncationAndTrailingByteIsDataLoss) {
  Checkpoint cp = RichCheckpoint();
  for (const Item& item : cp.items) {
    const std::string rec = codec::EncodeItem(item);
    for (size_t n = 0; n < rec.size(); ++n) {
      Result<Item> r = codec::DecodeItem(std::string_view(rec).substr(0, n));
      ASSERT_FALSE(r.ok()) << item.key << " truncated to " << n << " of " << rec.size();
      EXPECT_EQ(r.error().code(), StatusCode::kDataLoss);
    }
    Result<Item> longer = codec::DecodeItem(rec + '\0');
    ASSERT_FALSE(longer.ok());
    EXPECT_NE(longer.error().message().find("trailing"), std::string::npos) << longer.error().message();
  }
  for (const SourceFile& f : cp.files) {
    const std::string rec = codec::EncodeSourceFile(f);
    for (size_t n = 0; n < rec.size(); ++n) {
      Result<SourceFile> r = codec::DecodeSourceFile(std::string_view(rec).substr(0, n));
      ASSERT_FALSE(r.ok()) << f.rel_path << " truncated to " << n;
      EXPECT_EQ(r.error().code(), StatusCode::kDataLoss);
    }
    EXPECT_FALSE(codec::DecodeSourceFile(rec + "x").ok());
  }
}

TEST(CatalogCodec, InconsistentFieldsAreDataLossNotCrashes) {
  // Hand-built records: kind, dtype, counts and strides that cannot be.
  Item t = Tensor("k", DType::kFloat32, {2, 3}, {Frag({0, 0}, {2, 3}, 0, 0)});
  const std::string good = codec::EncodeItem(t);
  ASSERT_TRUE(codec::DecodeItem(good).ok());
  // Layout: [0]=kind, [1..4]=key len, [5]='k', [6]=dtype, [7..10]=rank, [11..26]=shape,
  // [27..30]=n_fragments, then the fragment.
  auto expect_bad = [](std::string rec, const char* what) {
    Result<Item> r = codec::DecodeItem(rec);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.error().code(), StatusCode::kDataLoss) << what;
    EXPECT_NE(r.error().message().find("undecodable"), std::string::npos) << r.error().message();
  };
  std::string bad = good;
  bad[0] = 7;
  expect_bad(bad, "kind");
  bad = good;
  bad[6] = static_cast<char>(kNumDTypes);
  expect_bad(bad, "dtype");
  bad = good;
  bad[1] = static_cast<char>(0xFF);  // key length past the end
  expect_bad(bad, "key length");
  bad = good;
  bad[7] = static_cast<char>(0xFF);
  bad[8] = static_cast<char>(0xFF);
  bad[9] = static_cast<char>(0xFF);
  bad[10] = static_cast<char>(0x7F);  // rank 2^31: must not allocate
  expect_bad(bad, "rank");
  bad = good;
  for (int i = 27; i < 31; ++i) bad[i] = static_cast<char>(0xFF);  // 4G fragments
  expect_bad(bad, "fragment count");
  {
    // flat_lo > flat_hi
    slice::Fragment f = Frag({0, 0}, {2, 3}, 0, 0);
    f.flat_lo = 5;
    f.flat_hi = 4;
    expect_bad(codec::EncodeItem(Tensor("k", DType::kFloat32, {2, 3}, {f})), "flat range");
  }
  {
    // stride count neither 0 nor rank
    slice::Fragment f = Frag({0, 0}, {2, 3}, 0, 0);
    f.strides = {1};
    expect_bad(codec::EncodeItem(Tensor("k", DType::kFloat32, {2, 3}, {f})), "strides");
  }
  // Random single-byte corruptions of a rich record: never a crash, ok or kDataLoss only.
  const uint64_t seed = std::getenv("UCPFS_TEST_SEED") ? std::strtoull(std::getenv("UCPFS_TEST_SEED"), nullptr, 10)
                                                        : std::random_device{}();
  std::printf("CatalogCodec corruption seed %llu (UCPFS_TEST_SEED replays)\n",
              static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  const std::string rich = codec::EncodeItem(RichCheckpoint().items[3]);
  for (int iter = 0; iter < 2000; ++iter) {
    std::string rec = rich;
    rec[rng() % rec.size()] = static_cast<char>(rng());
    Result<Item> r = codec::DecodeItem(rec);
    if (!r.ok()) {
      EXPECT_EQ(r.error().code(), StatusCode::kDataLoss);
    }
  }
}

// ---- store / load ----

TEST(Catalog, StoreLoadRoundTrip) {
  TempDir tmp;
  const std::string dir = tmp / "idx/nested";  // created as needed
  Checkpoint cp = RichCheckpoint();
  ASSERT_TRUE(StoreCheckpoint(dir, cp, 0xDEADBEEFCAFEF00Dull).ok());
  for (bool read_only : {false, true}) {
    uint64_t fp = 0;
    Result<Checkpoint> back = LoadCheckpoint(dir, read_only, &fp);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(fp, 0xDEADBEEFCAFEF00Dull);
    ExpectCheckpointEq(cp, *back);
  }
  // Storing again replaces, not merges.
  Checkpoint small;
  small.format = "dcp";
  small.flavor = "torch-2.x";
  small.files = {{"a.distcp", 1, 2}};
  small.items = {Bytes("only", 0, 0, 1)};
  ASSERT_TRUE(StoreCheckpoint(dir, small, 7).ok());
  uint64_t fp = 0;
  Result<Checkpoint> back = LoadCheckpoint(dir, false, &fp);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(fp, 7u);
  ExpectCheckpointEq(small, *back);
  // An empty checkpoint is a valid one.
  ASSERT_TRUE(StoreCheckpoint(dir, Checkpoint{}, 8).ok());
  back = LoadCheckpoint(dir, true, &fp);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(back->items.empty());
  EXPECT_TRUE(back->files.empty());
}

TEST(Catalog, MissingIndexIsNotFound) {
  TempDir tmp;
  for (const std::string& dir : {tmp / "absent", tmp.path()}) {
    Result<Checkpoint> r = LoadCheckpoint(dir, false, nullptr);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code(), StatusCode::kNotFound) << r.error().ToString();
  }
  EXPECT_FALSE(fs::exists(tmp / "data.mdb"));  // loading never creates an environment
}

TEST(Catalog, StoreRefusesOutOfRangeFileIds) {
  TempDir tmp;
  Checkpoint cp = RichCheckpoint();
  cp.items[0].layout.fragments[1].file_id = 4;  // 4 files: ids 0..3
  Status s = StoreCheckpoint(tmp / "idx", cp, 1);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("model.w"), std::string::npos) << s.message();
}

TEST(Catalog, SchemaMismatchIsDataLoss) {
  TempDir tmp;
  const std::string dir = tmp / "idx";
  ASSERT_TRUE(StoreCheckpoint(dir, RichCheckpoint(), 1).ok());
  PutRaw(dir, "meta", "schema_version", codec::EncodeU32Le(kCatalogSchemaVersion + 1));
  Result<Checkpoint> r = LoadCheckpoint(dir, false, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.error().message().find("schema version"), std::string::npos) << r.error().message();
  // A schema_version of the wrong width is just as undecodable.
  PutRaw(dir, "meta", "schema_version", "x");
  r = LoadCheckpoint(dir, true, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), StatusCode::kDataLoss);
}

TEST(Catalog, CorruptRecordsAreDataLoss) {
  TempDir tmp;
  const std::string dir = tmp / "idx";
  const Checkpoint cp = RichCheckpoint();
  {
    ASSERT_TRUE(StoreCheckpoint(dir, cp, 1).ok());
    const std::string rec = codec::EncodeItem(cp.items[2]);
    PutRaw(dir, "items", codec::EncodeU64Be(2), rec.substr(0, rec.size() - 3));
    Result<Checkpoint> r = LoadCheckpoint(dir, false, nullptr);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code(), StatusCode::kDataLoss);
    EXPECT_NE(r.error().message().find("index record 2 (items) undecodable"), std::string::npos)
        << r.error().message();
  }
  {
    // A file record cut short.
    ASSERT_TRUE(StoreCheckpoint(dir, cp, 1).ok());
    PutRaw(dir, "files", codec::EncodeU32Be(1), "\x03");
    Result<Checkpoint> r = LoadCheckpoint(dir, false, nullptr);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code(), StatusCode::kDataLoss);
    EXPECT_NE(r.error().message().find("index record 1 (files) undecodable"), std::string::npos)
        << r.error().message();
  }
  {
    // A decodable item whose file id is past the file table.
    ASSERT_TRUE(StoreCheckpoint(dir, cp, 1).ok());
    PutRaw(dir, "items", codec::EncodeU64Be(1), codec::EncodeItem(Bytes("step", 99, 0, 1)));
    Result<Checkpoint> r = LoadCheckpoint(dir, false, nullptr);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code(), StatusCode::kDataLoss);
    EXPECT_NE(r.error().message().find("out of range"), std::string::npos) << r.error().message();
  }
  {
    // An extra record the meta counts do not know about.
    ASSERT_TRUE(StoreCheckpoint(dir, cp, 1).ok());
    PutRaw(dir, "items", codec::EncodeU64Be(1000), codec::EncodeItem(Bytes("extra", 0, 0, 1)));
    Result<Checkpoint> r = LoadCheckpoint(dir, false, nullptr);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code(), StatusCode::kDataLoss) << r.error().ToString();
  }
  {
    // meta counts larger than the tables.
    ASSERT_TRUE(StoreCheckpoint(dir, cp, 1).ok());
    PutRaw(dir, "meta", "n_items", codec::EncodeU64Le(UINT64_MAX));
    Result<Checkpoint> r = LoadCheckpoint(dir, false, nullptr);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code(), StatusCode::kDataLoss) << r.error().ToString();
  }
}

TEST(Catalog, GarbageEnvironmentIsACleanError) {
  TempDir tmp;
  std::mt19937_64 rng(12345);
  // Sizes: shorter than an LMDB meta page, a few pages, and an empty file.
  for (size_t n_bytes : {size_t{100}, size_t{3 * 4096 + 17}, size_t{65536}, size_t{0}}) {
    const std::string dir = tmp / ("garbage" + std::to_string(n_bytes));
    std::string garbage(n_bytes, '\0');
    for (char& c : garbage) c = static_cast<char>(rng());
    WriteFile(dir + "/data.mdb", garbage);
    for (bool read_only : {true, false}) {
      Result<Checkpoint> r = LoadCheckpoint(dir, read_only, nullptr);
      ASSERT_FALSE(r.ok()) << n_bytes;
      EXPECT_EQ(r.error().code(), StatusCode::kDataLoss) << n_bytes << ": " << r.error().ToString();
    }
  }
}

// ---- fingerprint ----

TEST(Fingerprint, ChangesWithSizeMtimeAndMetadataBytesOnly) {
  TempDir tmp;
  const std::string src = tmp / "ckpt";
  WriteFile(src + "/.metadata", "metadata-v1");
  WriteFile(src + "/__0_0.distcp", "0123456789");
  WriteFile(src + "/__1_0.distcp", "abcdefghij");
  WriteFile(src + "/__3.metadata", "rank-local");
  WriteFile(src + "/metadata.json", "{\"sharded_backend\": \"torch_dist\"}");
  WriteFile(src + "/nested/dir/extra.bin", "x");
  for (const char* f : {"/.metadata", "/__0_0.distcp", "/__1_0.distcp", "/__3.metadata",
                        "/metadata.json", "/nested/dir/extra.bin"}) {
    SetMtime(src + f, 1700000000, 5);
  }
  Result<uint64_t> base = FingerprintSource(LocalTree(src));
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  EXPECT_EQ(*FingerprintSource(LocalTree(src)), *base);  // deterministic

  // The index directory never counts.
  WriteFile(src + "/.ucpfs/data.mdb", "anything");
  WriteFile(src + "/nested/.ucpfs/lock", "");
  EXPECT_EQ(*FingerprintSource(LocalTree(src)), *base);

  // Every change below moves some file's ctime, so each gives a new fingerprint; `prev` follows.
  uint64_t prev = *base;
  auto changed = [&](const char* what) {
    Result<uint64_t> now = FingerprintSource(LocalTree(src));
    ASSERT_TRUE(now.ok()) << now.status().ToString();
    EXPECT_NE(*now, prev) << what;
    prev = *now;
  };
  // A file rewritten in place with the same size and mtime: its bytes are not read, but its
  // ctime moved, so it is re-indexed (an edit in place is never served as the indexed bytes).
  WriteFile(src + "/__0_0.distcp", "9876543210");
  SetMtime(src + "/__0_0.distcp", 1700000000, 5);
  changed("rewritten in place");
  // Its mtime (by one nanosecond).
  SetMtime(src + "/__0_0.distcp", 1700000000, 6);
  changed("mtime");
  // Its size.
  WriteFile(src + "/__1_0.distcp", "abcdefghijk");
  SetMtime(src + "/__1_0.distcp", 1700000000, 5);
  changed("size");
  // Metadata bytes, for each metadata name.
  for (const char* f : {"/.metadata", "/__3.metadata", "/metadata.json"}) {
    const std::string path = src + f;
    std::string bytes = ReadFile(path);
    bytes[0] = static_cast<char>(bytes[0] ^ 1);
    WriteFile(path, bytes);
    SetMtime(path, 1700000000, 5);
    changed(f);
  }
  // A new file, a renamed one, a removed one.
  WriteFile(src + "/__2_0.distcp", "");
  SetMtime(src + "/__2_0.distcp", 1700000000, 5);
  changed("new file");
  fs::rename(src + "/__2_0.distcp", src + "/__2_1.distcp");
  changed("renamed");
  fs::remove(src + "/__2_1.distcp");
  changed("removed");
  // Nothing changed: the same fingerprint.
  EXPECT_EQ(*FingerprintSource(LocalTree(src)), prev);

  Result<uint64_t> missing = FingerprintSource(LocalTree(tmp / "nope"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code(), StatusCode::kNotFound);
}

// ---- OpenOrBuildIndex ----

// What a scan of `src` could find: every regular file (the index directory excluded), in path
// order, each one BYTE_IO item covering it. Reused indexes are checked record by record
// against the real files, so the fake scanners below describe the files that are there.
Checkpoint SourceCheckpoint(const std::string& src) {
  Checkpoint cp;
  cp.format = "dcp";
  cp.flavor = "torch-2.x";
  std::vector<std::string> names;
  for (const auto& e : fs::recursive_directory_iterator(src)) {
    const std::string rel = fs::relative(e.path(), src).string();
    if (rel.rfind(".ucpfs", 0) == 0 || !e.is_regular_file()) continue;
    names.push_back(rel);
  }
  std::sort(names.begin(), names.end());
  for (const auto& rel : names) {
    const uint64_t n = fs::file_size(fs::path(src) / rel);
    cp.items.push_back(Bytes("item:" + rel, static_cast<uint32_t>(cp.files.size()), 0, n));
    cp.files.push_back({rel, n, 0});
  }
  return cp;
}

// A fake scanner: returns SourceCheckpoint(src) and counts its calls.
struct FakeScanner {
  std::shared_ptr<std::atomic<int>> calls = std::make_shared<std::atomic<int>>(0);
  CheckpointScanner fn() const {
    auto c = calls;
    return [c](const std::string& src, const ScanProgress& progress) -> Result<Checkpoint> {
      ++*c;
      if (progress) progress(1, 1);
      return SourceCheckpoint(src);
    };
  }
};

std::string MakeSource(const TempDir& tmp) {
  const std::string src = tmp / "src";
  WriteFile(src + "/.metadata", "meta");
  WriteFile(src + "/__0_0.distcp", "data0");
  return src;
}

TEST(OpenOrBuild, BuildReuseRebuildOnChange) {
  TempDir tmp;
  const std::string src = MakeSource(tmp);
  FakeScanner scanner;
  IndexOptions opts;
  opts.scanner = scanner.fn();
  uint64_t progress_calls = 0;
  opts.progress = [&](uint64_t, uint64_t) { ++progress_calls; };

  Result<OpenedIndex> first = OpenOrBuildIndex(src, opts);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->state, IndexState::kBuilt);
  EXPECT_EQ(first->index_dir, src + "/.ucpfs");  // writable source: index beside it
  EXPECT_EQ(first->fingerprint, *FingerprintSource(LocalTree(src)));
  EXPECT_EQ(*scanner.calls, 1);
  EXPECT_EQ(progress_calls, 1u);
  ExpectCheckpointEq(SourceCheckpoint(src), first->checkpoint);
  // The catalog and the builders' lock, and no temporary file left behind.
  EXPECT_EQ(ListDir(src + "/.ucpfs"), (std::vector<std::string>{"data.mdb", "lock"}));

  Result<OpenedIndex> again = OpenOrBuildIndex(src, opts);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->state, IndexState::kReused);
  EXPECT_EQ(*scanner.calls, 1);
  ExpectCheckpointEq(SourceCheckpoint(src), again->checkpoint);
  std::printf("reused open of a %zu-item index: %.3f ms\n", again->checkpoint.items.size(),
              again->elapsed_s * 1e3);

  WriteFile(src + "/__0_0.distcp", "data0 and more");
  Result<OpenedIndex> changed = OpenOrBuildIndex(src, opts);
  ASSERT_TRUE(changed.ok()) << changed.status().ToString();
  EXPECT_EQ(changed->state, IndexState::kRebuiltChanged);
  EXPECT_EQ(*scanner.calls, 2);
  EXPECT_STREQ(IndexStateName(changed->state), "rebuilt (source changed)");
  EXPECT_EQ(ListDir(src + "/.ucpfs"), (std::vector<std::string>{"data.mdb", "lock"}));

  Result<OpenedIndex> after = OpenOrBuildIndex(src, opts);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->state, IndexState::kReused);
  EXPECT_EQ(*scanner.calls, 2);
}

TEST(OpenOrBuild, ReusedOpenTakesMilliseconds) {
  TempDir tmp;
  const std::string src = MakeSource(tmp);
  // A small real-sized model: 300 tensors of 8 row shards plus their optimizer state.
  Checkpoint cp;
  cp.format = "dcp";
  cp.flavor = "torch-2.x";
  for (int r = 0; r < 8; ++r) {
    // Sparse 1 GiB files: a reused index is checked against the real file sizes.
    const std::string name = "__" + std::to_string(r) + "_0.distcp";
    WriteFile(src + "/" + name, "");
    fs::resize_file(src + "/" + name, uint64_t{1} << 30);
    cp.files.push_back({name, 1 << 30, r});
  }
  for (int t = 0; t < 300; ++t) {
    std::vector<slice::Fragment> frags;
    for (int64_t r = 0; r < 8; ++r) {
      frags.push_back(Frag({r * 512, 0}, {512, 4096}, static_cast<uint32_t>(r), static_cast<uint64_t>(t) << 20));
    }
    for (const char* suffix : {"", ".exp_avg", ".exp_avg_sq"}) {
      cp.items.push_back(Tensor(std::string(*suffix ? "optimizer.state." : "") + "layers." +
                                    std::to_string(t) + ".weight" + suffix,
                                DType::kFloat32, {4096, 4096}, frags));
    }
  }
  IndexOptions opts;
  opts.index_dir = tmp / "index";
  opts.scanner = [&](const std::string&, const ScanProgress&) -> Result<Checkpoint> { return cp; };
  Result<OpenedIndex> built = OpenOrBuildIndex(src, opts);
  ASSERT_TRUE(built.ok()) << built.status().ToString();
  ASSERT_EQ(built->state, IndexState::kBuilt);
  std::printf("build of a %zu-item, %zu-fragment index: %.3f ms\n", cp.items.size(), cp.items.size() * 8,
              built->elapsed_s * 1e3);

  opts.scanner = [](const std::string&, const ScanProgress&) -> Result<Checkpoint> {
    ADD_FAILURE() << "a reused index must not scan";
    return InternalError("scanned");
  };
  double best_s = 1e9;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    Result<OpenedIndex> reused = OpenOrBuildIndex(src, opts);
    const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(reused.ok()) << reused.status().ToString();
    ASSERT_EQ(reused->state, IndexState::kReused);
    EXPECT_LE(reused->elapsed_s, wall_s);
    best_s = std::min(best_s, reused->elapsed_s);
    if (i == 0) ExpectCheckpointEq(cp, reused->checkpoint);
  }
  std::printf("reused open of a %zu-item, %zu-fragment index: best %.3f ms\n", cp.items.size(),
              cp.items.size() * 8, best_s * 1e3);
  // Milliseconds, with a wide margin for sanitizer builds and loaded machines.
  EXPECT_LT(best_s, 0.5);
}

TEST(OpenOrBuild, CorruptIndexIsRebuilt) {
  TempDir tmp;
  const std::string src = MakeSource(tmp);
  FakeScanner scanner;
  IndexOptions opts;
  opts.scanner = scanner.fn();
  opts.index_dir = tmp / "index";
  std::mt19937_64 rng(99);
  int round = 0;
  for (size_t n_bytes : {size_t{65536}, size_t{0}, size_t{100}}) {
    std::string garbage(n_bytes, '\0');
    for (char& c : garbage) c = static_cast<char>(rng());
    WriteFile(opts.index_dir + "/data.mdb", garbage);
    Result<OpenedIndex> r = OpenOrBuildIndex(src, opts);
    ASSERT_TRUE(r.ok()) << n_bytes << ": " << r.status().ToString();
    EXPECT_EQ(r->state, IndexState::kRebuiltCorrupt) << n_bytes;
    EXPECT_EQ(*scanner.calls, ++round);
    ExpectCheckpointEq(SourceCheckpoint(src), r->checkpoint);
    Result<OpenedIndex> reused = OpenOrBuildIndex(src, opts);
    ASSERT_TRUE(reused.ok()) << reused.status().ToString();
    EXPECT_EQ(reused->state, IndexState::kReused);
  }
  // A schema from another version is rebuilt too.
  PutRaw(opts.index_dir, "meta", "schema_version", codec::EncodeU32Le(kCatalogSchemaVersion + 7));
  Result<OpenedIndex> r = OpenOrBuildIndex(src, opts);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->state, IndexState::kRebuiltCorrupt);
}

TEST(OpenOrBuild, ScannerErrorsPropagateAndLeaveNoIndex) {
  TempDir tmp;
  const std::string src = MakeSource(tmp);
  IndexOptions opts;
  opts.index_dir = tmp / "index";
  opts.scanner = [](const std::string& dir, const ScanProgress&) -> Result<Checkpoint> {
    return CorruptError(dir + "/.metadata: offset 3: bad opcode");
  };
  Result<OpenedIndex> r = OpenOrBuildIndex(src, opts);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), StatusCode::kCorrupt);
  EXPECT_NE(r.error().message().find("bad opcode"), std::string::npos);
  EXPECT_FALSE(LoadCheckpoint(opts.index_dir, true, nullptr).ok());
  // A missing source is kNotFound before anything is created.
  Result<OpenedIndex> missing = OpenOrBuildIndex(tmp / "nope", opts);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code(), StatusCode::kNotFound);
}

TEST(OpenOrBuild, ReadOnlyNeverWrites) {
  TempDir tmp;
  const std::string src = MakeSource(tmp);
  FakeScanner scanner;
  IndexOptions opts;
  opts.scanner = scanner.fn();
  opts.read_only = true;
  opts.index_dir = tmp / "shared-index";

  // Missing: an error that says how to build it, and nothing created.
  Result<OpenedIndex> missing = OpenOrBuildIndex(src, opts);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.error().message().find("ucpfs index " + src), std::string::npos)
      << missing.error().message();
  EXPECT_FALSE(fs::exists(opts.index_dir));
  EXPECT_EQ(*scanner.calls, 0);

  // Built elsewhere (as `ucpfs index` would), then only data.mdb is published, read-only.
  const std::string builder_dir = tmp / "builder";
  ASSERT_TRUE(StoreCheckpoint(builder_dir, SourceCheckpoint(src), *FingerprintSource(LocalTree(src))).ok());
  fs::create_directories(opts.index_dir);
  fs::copy_file(builder_dir + "/data.mdb", opts.index_dir + "/data.mdb");
  fs::permissions(opts.index_dir + "/data.mdb", fs::perms::owner_read | fs::perms::group_read | fs::perms::others_read);
  fs::permissions(opts.index_dir, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read |
                                      fs::perms::group_exec | fs::perms::others_read | fs::perms::others_exec);
  Result<OpenedIndex> ok = OpenOrBuildIndex(src, opts);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->state, IndexState::kReused);
  ExpectCheckpointEq(SourceCheckpoint(src), ok->checkpoint);
  // MDB_NOLOCK: not even a lock file.
  EXPECT_EQ(ListDir(opts.index_dir), (std::vector<std::string>{"data.mdb"}));
  EXPECT_EQ(*scanner.calls, 0);

  // The writable mode also reads an index it may not write, creating nothing there.
  {
    IndexOptions rw = opts;
    rw.read_only = false;
    Result<OpenedIndex> r = OpenOrBuildIndex(src, rw);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->state, IndexState::kReused);
    EXPECT_EQ(ListDir(opts.index_dir), (std::vector<std::string>{"data.mdb"}));
  }

  // Stale: an error that says how to rebuild it, and the source is not scanned.
  WriteFile(src + "/__0_0.distcp", "changed!");
  Result<OpenedIndex> stale = OpenOrBuildIndex(src, opts);
  ASSERT_FALSE(stale.ok());
  EXPECT_EQ(stale.error().code(), StatusCode::kDataLoss);
  EXPECT_NE(stale.error().message().find("stale"), std::string::npos) << stale.error().message();
  EXPECT_NE(stale.error().message().find("ucpfs index " + src), std::string::npos);

  // Corrupt: kDataLoss with the same hint, and the file is left alone.
  fs::permissions(opts.index_dir, fs::perms::owner_all, fs::perm_options::add);
  fs::permissions(opts.index_dir + "/data.mdb", fs::perms::owner_write, fs::perm_options::add);
  WriteFile(opts.index_dir + "/data.mdb", std::string(8192, 'z'));
  Result<OpenedIndex> corrupt = OpenOrBuildIndex(src, opts);
  ASSERT_FALSE(corrupt.ok());
  EXPECT_EQ(corrupt.error().code(), StatusCode::kDataLoss);
  EXPECT_NE(corrupt.error().message().find("ucpfs index"), std::string::npos);
  EXPECT_EQ(ReadFile(opts.index_dir + "/data.mdb"), std::string(8192, 'z'));
  EXPECT_EQ(*scanner.calls, 0);
}

TEST(OpenOrBuild, ReadOnlyDefaultLocationCreatesNothing) {
  TempDir tmp;
  const std::string src = MakeSource(tmp);
  ASSERT_EQ(::setenv("XDG_CACHE_HOME", (tmp / "cache").c_str(), 1), 0);
  IndexOptions opts;
  opts.read_only = true;
  Result<OpenedIndex> r = OpenOrBuildIndex(src, opts);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), StatusCode::kNotFound);
  EXPECT_FALSE(fs::exists(src + "/.ucpfs"));
  EXPECT_FALSE(fs::exists(tmp / "cache"));
  // Once built beside the source, read-only mode finds it there.
  IndexOptions build;
  FakeScanner scanner;
  build.scanner = scanner.fn();
  ASSERT_TRUE(OpenOrBuildIndex(src, build).ok());
  r = OpenOrBuildIndex(src, opts);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->index_dir, src + "/.ucpfs");
  EXPECT_EQ(r->state, IndexState::kReused);
  ::unsetenv("XDG_CACHE_HOME");
}

// Two processes open the same unindexed source at once: one builds while the other waits on
// the build lock, then reuses. Processes, not threads: LMDB allows one open per process.
TEST(OpenOrBuild, ConcurrentBuildersScanOnce) {
  TempDir tmp;
  const std::string src = MakeSource(tmp);
  const std::string scans = tmp / "scans.log";
  const std::string index_dir = tmp / "index";
  std::vector<pid_t> children;
  for (int c = 0; c < 2; ++c) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      IndexOptions opts;
      opts.index_dir = index_dir;
      opts.scanner = [&](const std::string&, const ScanProgress&) -> Result<Checkpoint> {
        int fd = ::open(scans.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
          (void)!::write(fd, "s\n", 2);
          ::close(fd);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        return SourceCheckpoint(src);
      };
      Result<OpenedIndex> r = OpenOrBuildIndex(src, opts);
      int code = 3;
      if (r.ok() && r->state == IndexState::kBuilt) code = 0;
      if (r.ok() && r->state == IndexState::kReused) code = 1;
      if (r.ok() && r->checkpoint.items.size() != SourceCheckpoint(src).items.size()) code = 4;
      ::_exit(code);
    }
    children.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    codes.push_back(WEXITSTATUS(status));
  }
  std::sort(codes.begin(), codes.end());
  EXPECT_EQ(codes, (std::vector<int>{0, 1}));
  EXPECT_EQ(ReadFile(scans), "s\n");
}

// The real scanner on generated torch-free DCP fixtures (tests/e2e/fixtures/gen_dcp2x.py
// --variant 2x / megatron):
// torch 2.x FSDP-style and Megatron torch_dist directories, built, reused, rebuilt.
TEST(OpenOrBuild, RealDcpDirectories) {
  constexpr const char* kPython = "/usr/bin/python3";
  if (!fs::exists(kPython)) GTEST_SKIP() << kPython << " not found";
  fs::path scripts;
  if (const char* env = std::getenv("UCPFS_TEST_DATA"); env != nullptr && *env != '\0') {
    scripts = fs::path(env).parent_path() / "e2e" / "fixtures";
  } else {
    scripts = fs::path(__FILE__).parent_path().parent_path() / "e2e" / "fixtures";
  }
  TempDir tmp;
  for (const char* variant : {"2x", "megatron"}) {
    SCOPED_TRACE(variant);
    const std::string src = tmp / (std::string("dcp_") + variant);
    const std::string log = src + ".log";
    const std::string cmd = std::string(kPython) + " " + (scripts / "gen_dcp2x.py").string() + " " + src +
                            " --variant " + variant + " >" + log + " 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd << "\n" << ReadFile(log);
    const char* name = variant;
    Result<Checkpoint> direct = ScanDcp(LocalTree(src));
    ASSERT_TRUE(direct.ok()) << direct.status().ToString();

    std::vector<std::pair<uint64_t, uint64_t>> progress;
    IndexOptions opts;  // the default scanner (ScanDcp) and the default location
    opts.progress = [&](uint64_t done, uint64_t total) { progress.emplace_back(done, total); };
    Result<OpenedIndex> built = OpenOrBuildIndex(src, opts);
    ASSERT_TRUE(built.ok()) << built.status().ToString();
    EXPECT_EQ(built->state, IndexState::kBuilt);
    EXPECT_EQ(built->index_dir, src + "/.ucpfs");
    ExpectCheckpointEq(*direct, built->checkpoint);
    std::printf("%s: built %zu items in %.3f ms (%zu progress calls)\n", name,
                built->checkpoint.items.size(), built->elapsed_s * 1e3, progress.size());

    double best_s = 1e9;
    for (int i = 0; i < 5; ++i) {
      Result<OpenedIndex> reused = OpenOrBuildIndex(src, opts);
      ASSERT_TRUE(reused.ok()) << reused.status().ToString();
      ASSERT_EQ(reused->state, IndexState::kReused);
      if (i == 0) ExpectCheckpointEq(*direct, reused->checkpoint);
      best_s = std::min(best_s, reused->elapsed_s);
    }
    std::printf("%s: reused open %.3f ms (best of 5)\n", name, best_s * 1e3);
    EXPECT_LT(best_s, 0.5);

    // Read-only consumers of the same index.
    IndexOptions ro = opts;
    ro.read_only = true;
    Result<OpenedIndex> shared = OpenOrBuildIndex(src, ro);
    ASSERT_TRUE(shared.ok()) << shared.status().ToString();
    EXPECT_EQ(shared->state, IndexState::kReused);

    // The stored checkpoint maps to parameters with nothing left unmapped.
    Result<KeyMapping> mapping = MapKeys(shared->checkpoint, {});
    ASSERT_TRUE(mapping.ok()) << mapping.status().ToString();
    EXPECT_GE(mapping->params.size(), 5u);
    EXPECT_TRUE(mapping->unmapped_keys.empty()) << mapping->unmapped_keys.front();

    // Damage the environment: rebuilt.
    WriteFile(src + "/.ucpfs/data.mdb", std::string(20000, '\x5a'));
    Result<OpenedIndex> rebuilt = OpenOrBuildIndex(src, opts);
    ASSERT_TRUE(rebuilt.ok()) << rebuilt.status().ToString();
    EXPECT_EQ(rebuilt->state, IndexState::kRebuiltCorrupt);
    ExpectCheckpointEq(*direct, rebuilt->checkpoint);

    // Touch a data file (new mtime): rebuilt as changed.
    const std::string data_file = src + "/__0_0.distcp";
    SetMtime(data_file, 1800000000, 1);
    Result<OpenedIndex> changed = OpenOrBuildIndex(src, opts);
    ASSERT_TRUE(changed.ok()) << changed.status().ToString();
    EXPECT_EQ(changed->state, IndexState::kRebuiltChanged);
    Result<Checkpoint> rescanned = ScanDcp(LocalTree(src));  // its SourceFile carries the new mtime
    ASSERT_TRUE(rescanned.ok());
    ExpectCheckpointEq(*rescanned, changed->checkpoint);
  }
}

// ---- default location ----

// A prebuilt index is untrusted: records that leave the checkpoint or its files are never
// served; a writable index is rebuilt, a read-only one refused.
TEST(OpenOrBuild, CraftedIndexRecordsAreRebuiltOrRefused) {
  TempDir tmp;
  const std::string src = MakeSource(tmp);
  const std::string outside = tmp / "outside";
  WriteFile(outside, "secret bytes");
  const uint64_t fp = *FingerprintSource(LocalTree(src));
  struct Craft {
    const char* what;
    std::function<void(Checkpoint&)> edit;
  };
  const std::vector<Craft> crafts = {
      {"a path out of the checkpoint", [](Checkpoint& c) { c.files[0].rel_path = "../outside"; }},
      {"an absolute path", [&](Checkpoint& c) { c.files[0].rel_path = outside; }},
      {"a size that is not the file's", [](Checkpoint& c) { c.files[1].n_bytes += 100; }},
      {"an item past its file", [](Checkpoint& c) { c.items[1].byte_offset = 3; }},
      {"a tensor fragment past its file",
       [](Checkpoint& c) { c.items.push_back(Tensor("t", DType::kFloat32, {4}, {Frag({0}, {4}, 1, 2)})); }},
      {"a tensor with a gap",
       [](Checkpoint& c) { c.items.push_back(Tensor("g", DType::kUInt8, {4}, {Frag({0}, {2}, 1, 0, DType::kUInt8)})); }},
  };
  for (const Craft& craft : crafts) {
    Checkpoint bad = SourceCheckpoint(src);
    craft.edit(bad);
    const std::string dir = tmp / "prebuilt";
    fs::remove_all(dir);
    ASSERT_TRUE(StoreCheckpoint(dir, bad, fp).ok()) << craft.what;

    IndexOptions ro;
    ro.index_dir = dir;
    ro.read_only = true;
    Result<OpenedIndex> refused = OpenOrBuildIndex(src, ro);
    ASSERT_FALSE(refused.ok()) << craft.what;
    EXPECT_EQ(refused.error().code(), StatusCode::kDataLoss) << craft.what;
    EXPECT_NE(refused.error().message().find("does not match"), std::string::npos) << refused.error().message();

    FakeScanner scanner;
    IndexOptions rw;
    rw.index_dir = dir;
    rw.scanner = scanner.fn();
    Result<OpenedIndex> rebuilt = OpenOrBuildIndex(src, rw);
    ASSERT_TRUE(rebuilt.ok()) << craft.what << ": " << rebuilt.status().ToString();
    EXPECT_EQ(*scanner.calls, 1) << craft.what;
    ExpectCheckpointEq(SourceCheckpoint(src), rebuilt->checkpoint);
  }
  EXPECT_EQ(ReadFile(outside), "secret bytes");
}

// Symlinks in the index location are never followed: nothing outside is created, written or
// removed (bytes, mtimes and listings unchanged), and the error says what was refused.
TEST(OpenOrBuild, SymlinkedIndexLocationIsRefused) {
  TempDir tmp;
  const std::string src = MakeSource(tmp);
  const std::string victim_dir = tmp / "victim";
  fs::create_directories(victim_dir);
  WriteFile(victim_dir + "/data.mdb", "not an index, must survive");
  SetMtime(victim_dir + "/data.mdb", 1000000000, 7);
  const std::string victim = tmp / "victim-file";
  WriteFile(victim, "precious");
  SetMtime(victim, 1000000000, 11);
  const std::string dangling = tmp / "would-be-created";
  const FileSnapshot victim_before = Snapshot(victim);
  const FileSnapshot victim_index_before = Snapshot(victim_dir + "/data.mdb");
  const std::vector<std::string> outside_before = ListDir(tmp.path());
  const std::vector<std::string> victim_dir_before = ListDir(victim_dir);
  auto expect_outside_unchanged = [&](const std::string& what) {
    EXPECT_EQ(Snapshot(victim), victim_before) << what;
    EXPECT_EQ(Snapshot(victim_dir + "/data.mdb"), victim_index_before) << what;
    EXPECT_EQ(ListDir(tmp.path()), outside_before) << what;
    EXPECT_EQ(ListDir(victim_dir), victim_dir_before) << what;
    EXPECT_FALSE(fs::exists(fs::symlink_status(dangling))) << what;
  };
  FakeScanner scanner;
  IndexOptions opts;
  opts.scanner = scanner.fn();

  // SRC/.ucpfs -> a directory outside, or -> a directory that does not exist (it must not be
  // created through the link).
  for (const std::string& target : {victim_dir, dangling}) {
    fs::remove_all(src + "/.ucpfs");
    fs::create_directory_symlink(target, src + "/.ucpfs");
    Result<OpenedIndex> r = OpenOrBuildIndex(src, opts);
    ASSERT_FALSE(r.ok()) << target;
    EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument) << r.error().ToString();
    EXPECT_NE(r.error().message().find("index directory " + src + "/.ucpfs is a symbolic link"), std::string::npos)
        << r.error().message();
    EXPECT_NE(r.error().message().find("not followed"), std::string::npos) << r.error().message();
    // The lower-level entry points refuse it too.
    Status stored = StoreCheckpoint(src + "/.ucpfs", SourceCheckpoint(src), 1);
    EXPECT_NE(stored.message().find("not followed"), std::string::npos) << stored.ToString();
    Result<Checkpoint> loaded = LoadCheckpoint(src + "/.ucpfs", true, nullptr);
    ASSERT_FALSE(loaded.ok());
    EXPECT_NE(loaded.error().message().find("not followed"), std::string::npos) << loaded.error().ToString();
    EXPECT_TRUE(fs::is_symlink(src + "/.ucpfs")) << target;  // not removed either
    expect_outside_unchanged(".ucpfs -> " + target);
  }

  // SRC/.ucpfs/data.mdb and lock -> files outside (or where a file outside would be created):
  // refused. lock.mdb is never opened at all (MDB_NOLOCK), so a link there changes nothing.
  for (const std::string& target : {victim, dangling, victim_dir}) {
    for (const char* name : {"data.mdb", "lock.mdb", "lock"}) {
      const std::string what = std::string(name) + " -> " + target;
      fs::remove_all(src + "/.ucpfs");
      fs::create_directories(src + "/.ucpfs");
      fs::create_symlink(target, src + "/.ucpfs/" + name);
      Result<OpenedIndex> again = OpenOrBuildIndex(src, opts);
      if (std::string(name) == "lock.mdb") {
        ASSERT_TRUE(again.ok()) << again.status().ToString();
        EXPECT_EQ(again->state, IndexState::kBuilt);
      } else {
        ASSERT_FALSE(again.ok()) << what;
        EXPECT_EQ(again.error().code(), StatusCode::kInvalidArgument) << again.error().ToString();
        EXPECT_NE(again.error().message().find(src + "/.ucpfs/" + name + " is a symbolic link"), std::string::npos)
            << again.error().message();
        EXPECT_NE(again.error().message().find("not followed"), std::string::npos) << again.error().message();
      }
      EXPECT_TRUE(fs::is_symlink(src + "/.ucpfs/" + name)) << what;  // not removed either
      expect_outside_unchanged(what);
    }
  }
  EXPECT_EQ(*scanner.calls, 3);  // the three lock.mdb cases
}

// A corrupt data.mdb is replaced by a new file renamed over it: a hard link to a file outside
// is never written, nothing else in the directory is deleted, and no temporary file is left.
TEST(OpenOrBuild, CorruptIndexIsReplacedNotWritten) {
  TempDir tmp;
  const std::string src = MakeSource(tmp);
  const std::string outside = tmp / "outside.bin";
  const std::string garbage(8192, '\x17');
  WriteFile(outside, garbage);
  fs::create_directories(src + "/.ucpfs");
  fs::create_hard_link(outside, src + "/.ucpfs/data.mdb");
  WriteFile(src + "/.ucpfs/keepme", "mine");
  WriteFile(src + "/.ucpfs/lock.mdb", "an old lock file");
  FakeScanner scanner;
  IndexOptions opts;
  opts.scanner = scanner.fn();
  Result<OpenedIndex> r = OpenOrBuildIndex(src, opts);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->state, IndexState::kRebuiltCorrupt);
  EXPECT_EQ(ReadFile(outside), garbage);
  EXPECT_NE(fs::status(outside).permissions(), fs::perms::none);
  EXPECT_EQ(fs::hard_link_count(outside), 1u);  // data.mdb is a new inode now
  EXPECT_EQ(ReadFile(src + "/.ucpfs/keepme"), "mine");
  EXPECT_EQ(ReadFile(src + "/.ucpfs/lock.mdb"), "an old lock file");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(src + "/.ucpfs")) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"data.mdb", "keepme", "lock", "lock.mdb"}));
  // And it serves: reused from the new file.
  Result<OpenedIndex> again = OpenOrBuildIndex(src, opts);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->state, IndexState::kReused);
  EXPECT_EQ(*scanner.calls, 1);
}

// Runs `body` in a forked child that sees `dir` as a read-only bind mount, in a private mount
// namespace, where root's access(W_OK) still says yes. Returns the child's exit code: body's, 77
// when the mount cannot be made here (it needs CAP_SYS_ADMIN), -1 when the child did not exit.
int ExitCodeOnReadOnlyMount(const std::string& dir, const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    if (::unshare(CLONE_NEWNS) != 0 || ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount(dir.c_str(), dir.c_str(), nullptr, MS_BIND, nullptr) != 0 ||
        ::mount(nullptr, dir.c_str(), nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY, nullptr) != 0) {
      ::_exit(77);
    }
    ::_exit(body());
  }
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

// Makes openat with O_TMPFILE fail with EOPNOTSUPP in this process and its children, as on a
// filesystem without O_TMPFILE (a seccomp filter). False where that cannot be arranged here.
bool DenyTmpfileInThisProcess() {
#if defined(__x86_64__) || defined(__aarch64__)
#if defined(__x86_64__)
  constexpr uint32_t kArch = AUDIT_ARCH_X86_64;
#else
  constexpr uint32_t kArch = AUDIT_ARCH_AARCH64;
#endif
  // The bit O_TMPFILE adds to O_DIRECTORY, in openat's third argument (its low word: both
  // architectures are little-endian).
  constexpr uint32_t kTmpfileBit = O_TMPFILE & ~O_DIRECTORY;
  struct sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kArch, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_openat, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[2])),
      BPF_STMT(BPF_ALU | BPF_AND | BPF_K, kTmpfileBit),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kTmpfileBit, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EOPNOTSUPP & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  struct sock_fprog prog = {static_cast<unsigned short>(std::size(filter)), filter};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 && ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
#else
  return false;
#endif
}

// An index's life (built, reused, rebuilt when corrupt, refusing to replace a symlink), run in a
// forked child: 0 when every step went right, else the number of the step that did not.
int IndexLifeCode(const std::string& src, const std::string& outside) {
  const std::string index_dir = src + "/.ucpfs";
  const std::vector<std::string> published = {"data.mdb", "lock"};
  FakeScanner scanner;
  IndexOptions opts;
  opts.scanner = scanner.fn();
  Result<OpenedIndex> r = OpenOrBuildIndex(src, opts);
  if (!r.ok() || r->state != IndexState::kBuilt || ListDir(index_dir) != published) return 1;
  r = OpenOrBuildIndex(src, opts);
  if (!r.ok() || r->state != IndexState::kReused) return 2;
  std::ofstream(index_dir + "/data.mdb", std::ios::binary | std::ios::trunc) << std::string(20000, '\x42');
  r = OpenOrBuildIndex(src, opts);
  if (!r.ok() || r->state != IndexState::kRebuiltCorrupt || ListDir(index_dir) != published) return 3;
  r = OpenOrBuildIndex(src, opts);
  if (!r.ok() || r->state != IndexState::kReused) return 4;
  // A new catalog is written, then refused publication over a symlink: its temporary name (if
  // it had one) is removed, and nothing else.
  fs::remove(index_dir + "/data.mdb");
  fs::create_symlink(outside, index_dir + "/data.mdb");
  Status stored = StoreCheckpoint(index_dir, SourceCheckpoint(src), r->fingerprint);
  if (stored.ok() || stored.message().find("not followed") == std::string::npos) return 5;
  if (ListDir(index_dir) != published || !fs::is_symlink(index_dir + "/data.mdb")) return 6;
  // StoreCheckpoint into a new directory: the catalog alone (no lock), and it loads.
  const std::string fresh = src + "/../fresh-index";
  if (!StoreCheckpoint(fresh, SourceCheckpoint(src), 5).ok()) return 7;
  uint64_t fingerprint = 0;
  if (ListDir(fresh) != std::vector<std::string>{"data.mdb"} || !LoadCheckpoint(fresh, true, &fingerprint).ok() ||
      fingerprint != 5) {
    return 8;
  }
  return 0;
}

// The catalog is built in a file ucpfs creates (an O_TMPFILE inode, or an O_EXCL name where the
// filesystem has no O_TMPFILE) and renamed over data.mdb: both ways publish the same catalog
// and leave no temporary file, even when publishing is refused.
TEST(OpenOrBuild, CatalogIsPublishedFromATemporaryFileWithOrWithoutOTmpfile) {
  for (const bool deny_tmpfile : {false, true}) {
    TempDir tmp;
    const std::string src = MakeSource(tmp);
    const std::string outside = tmp / "outside";
    WriteFile(outside, "outside bytes");
    const FileSnapshot outside_before = Snapshot(outside);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      if (deny_tmpfile) {
        if (!DenyTmpfileInThisProcess()) ::_exit(77);
        // The filter works: the catalog can only be written through a named temporary file.
        const int fd = ::open(tmp.path().c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0644);
        if (fd >= 0 || errno != EOPNOTSUPP) ::_exit(9);
      }
      ::_exit(IndexLifeCode(src, outside));
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    if (WEXITSTATUS(status) == 77) {
      std::printf("cannot deny O_TMPFILE here (seccomp): the named-file fallback is not checked\n");
      continue;
    }
    EXPECT_EQ(WEXITSTATUS(status), 0)
        << (deny_tmpfile ? "without" : "with") << " O_TMPFILE; 1: build, 2: reuse, 3: rebuild of a corrupt index, "
        << "4: reuse, 5: publishing over a symlink not refused, 6: a file left or removed, 7: store, "
        << "8: load of a stored index, 9: the seccomp filter did not deny O_TMPFILE";
    EXPECT_EQ(Snapshot(outside), outside_before);
  }
}

// A prebuilt index beside the source, on a read-only mount: read-only mode and the writable mode
// both reuse it without writing anything (a stale lock.mdb of an older ucpfs is ignored). A
// child process in a private mount namespace (needs CAP_SYS_ADMIN; skipped without).
TEST(OpenOrBuild, PrebuiltIndexOnAReadOnlyMountIsReusedWithoutWrites) {
  TempDir tmp;
  const std::string src = MakeSource(tmp);
  const std::string index_dir = src + "/.ucpfs";
  FakeScanner scanner;
  IndexOptions build;
  build.scanner = scanner.fn();
  ASSERT_TRUE(OpenOrBuildIndex(src, build).ok());
  WriteFile(index_dir + "/lock.mdb", "an old lock file");
  const std::vector<std::string> listing_before = ListDir(index_dir);
  const FileSnapshot index_before = Snapshot(index_dir + "/data.mdb");
  const int code = ExitCodeOnReadOnlyMount(src, [&] {
    if (::mkdir((index_dir + "/probe").c_str(), 0755) == 0 || errno != EROFS) return 1;
    IndexOptions opts;
    opts.scanner = scanner.fn();
    opts.read_only = true;  // the default location: SRC/.ucpfs, as it holds data.mdb
    Result<OpenedIndex> r = OpenOrBuildIndex(src, opts);
    if (!r.ok() || r->state != IndexState::kReused || r->index_dir != index_dir) return 2;
    opts.read_only = false;
    opts.index_dir = index_dir;
    r = OpenOrBuildIndex(src, opts);
    if (!r.ok() || r->state != IndexState::kReused) return 3;
    return 0;
  });
  if (code == 77) GTEST_SKIP() << "cannot make a read-only bind mount here";
  EXPECT_EQ(code, 0) << "1: the mount is writable, 2: read-only reuse, 3: writable-mode reuse";
  EXPECT_EQ(ListDir(index_dir), listing_before);
  EXPECT_EQ(Snapshot(index_dir + "/data.mdb"), index_before);
  EXPECT_EQ(*scanner.calls, 1);
}

// LMDB trusts its pages: a few flipped bytes in data.mdb made it crash (SIGSEGV, SIGBUS). The
// catalog is read in a child process, so random damage is a clean error (or, where it hit
// unused bytes, a valid index), never a crash of the caller.
TEST(OpenOrBuild, DamagedLmdbPagesNeverCrashTheReader) {
  TempDir tmp;
  const std::string src = MakeSource(tmp);
  FakeScanner scanner;
  IndexOptions opts;
  opts.scanner = scanner.fn();
  ASSERT_TRUE(OpenOrBuildIndex(src, opts).ok());
  const std::string good = ReadFile(src + "/.ucpfs/data.mdb");
  ASSERT_GT(good.size(), 2u * 4096);
  opts.read_only = true;
  std::mt19937_64 rng(ucpfs::testing::TestSeed());
  int n_errors = 0;
  for (int round = 0; round < 150; ++round) {
    std::string bad = good;
    const int n_flips = 1 << (round % 7);
    for (int i = 0; i < n_flips; ++i) {
      bad[2 * 4096 + rng() % (bad.size() - 2 * 4096)] = static_cast<char>(rng());  // past the meta pages
    }
    WriteFile(src + "/.ucpfs/data.mdb", bad);
    Result<OpenedIndex> r = OpenOrBuildIndex(src, opts);
    if (!r.ok()) {
      ++n_errors;
      EXPECT_EQ(r.error().code(), StatusCode::kDataLoss) << r.error().ToString();
    }
  }
  EXPECT_GT(n_errors, 0);
}

// Forks a process that opens `fifo` for writing, which blocks until some reader opens it, and
// returns its pid once it is blocked there (/proc/PID/syscall names the call it waits in).
pid_t ForkBlockedFifoWriter(const std::string& fifo) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(::open(fifo.c_str(), O_WRONLY | O_CLOEXEC) >= 0 ? 0 : 1);
  const std::string waiting_in_open = std::to_string(SYS_openat) + " ";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (pid > 0 && std::chrono::steady_clock::now() < deadline) {
    if (ReadFile("/proc/" + std::to_string(pid) + "/syscall").rfind(waiting_in_open, 0) == 0) return pid;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return -1;
}

// A FIFO in place of data.mdb or lock: refused at once, never blocks, and never even opened (a
// writer blocked on it stays blocked). The same check keeps ucpfs from opening a device node,
// whose open alone can have effects.
TEST(OpenOrBuild, SpecialIndexFilesAreRefusedUnopened) {
  TempDir tmp;
  const std::string src = MakeSource(tmp);
  FakeScanner scanner;
  IndexOptions opts;
  opts.scanner = scanner.fn();
  for (const char* name : {"data.mdb", "lock"}) {
    fs::remove_all(src + "/.ucpfs");
    fs::create_directories(src + "/.ucpfs");
    const std::string fifo = src + "/.ucpfs/" + name;
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
    const pid_t writer = ForkBlockedFifoWriter(fifo);
    struct Reaper {
      pid_t pid;
      ~Reaper() {
        if (pid > 0 && ::kill(pid, SIGKILL) == 0) ::waitpid(pid, nullptr, 0);
      }
    } reaper{writer};
    ASSERT_GT(writer, 0) << "the writer never blocked in open";
    Result<OpenedIndex> r = OpenOrBuildIndex(src, opts);
    ASSERT_FALSE(r.ok()) << name;
    EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument) << r.error().ToString();
    EXPECT_NE(r.error().message().find(fifo + " is not a regular file"), std::string::npos) << r.error().message();
    // Had ucpfs opened the FIFO, the writer's open would have returned and the writer exited.
    bool writer_woke = false;
    for (int i = 0; i < 500 && !writer_woke; ++i) {
      int status = 0;
      writer_woke = ::waitpid(writer, &status, WNOHANG) == writer;
      if (!writer_woke) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_FALSE(writer_woke) << name << ": ucpfs opened the FIFO";
    if (writer_woke) reaper.pid = -1;  // reaped already
  }
  EXPECT_EQ(*scanner.calls, 0);
}

TEST(DefaultIndexDir, BesideTheSourceWhenWritable) {
  TempDir tmp;
  const std::string src = tmp / "ckpt";
  fs::create_directories(src);
  EXPECT_EQ(DefaultIndexDir(src), src + "/.ucpfs");
  EXPECT_TRUE(fs::is_directory(src + "/.ucpfs"));  // the probe created it
  EXPECT_EQ(DefaultIndexDir(src), src + "/.ucpfs");  // and it is reused
}

TEST(DefaultIndexDir, FallsBackToTheCacheWhenNotWritable) {
  TempDir tmp;
  const std::string src = tmp / "ckpt";
  fs::create_directories(src);
  ASSERT_EQ(::setenv("XDG_CACHE_HOME", (tmp / "xdg").c_str(), 1), 0);
  const std::string cache = DefaultIndexDirFor(src, [](const std::string&) { return false; });
  EXPECT_EQ(cache, CacheIndexDir(src));
  EXPECT_EQ(cache.rfind(tmp / "xdg/ucpfs/", 0), 0u) << cache;
  EXPECT_EQ(cache.size(), (tmp / "xdg/ucpfs/").size() + 16) << cache;
  EXPECT_EQ(DefaultIndexDirFor(src, [](const std::string&) { return true; }), src + "/.ucpfs");
  // The same directory spelt differently shares one cache entry; another does not.
  EXPECT_EQ(CacheIndexDir(src + "/"), cache);
  EXPECT_EQ(CacheIndexDir(src + "/../ckpt"), cache);
  EXPECT_NE(CacheIndexDir(tmp.path()), cache);
  // Without XDG_CACHE_HOME: $HOME/.cache.
  ::unsetenv("XDG_CACHE_HOME");
  const char* old_home = std::getenv("HOME");
  const std::string saved_home = old_home ? old_home : "";
  ASSERT_EQ(::setenv("HOME", (tmp / "home").c_str(), 1), 0);
  EXPECT_EQ(CacheIndexDir(src).rfind(tmp / "home/.cache/ucpfs/", 0), 0u) << CacheIndexDir(src);
  if (old_home) ::setenv("HOME", saved_home.c_str(), 1);

  // The real probe on a directory we may not write. Root writes anywhere except a read-only
  // mount, which a test cannot make without privileges, hence the injected predicate above.
  if (::geteuid() == 0) {
    std::printf("running as root: chmod-based fallback check skipped (predicate tested above)\n");
    return;
  }
  fs::permissions(src, fs::perms::owner_read | fs::perms::owner_exec);
  ASSERT_EQ(::setenv("XDG_CACHE_HOME", (tmp / "xdg").c_str(), 1), 0);
  EXPECT_EQ(DefaultIndexDir(src), CacheIndexDir(src));
  EXPECT_FALSE(fs::exists(src + "/.ucpfs"));
  ::unsetenv("XDG_CACHE_HOME");
}

// A real read-only mount, where root's access(W_OK) still says yes: a bind mount remounted
// read-only in a private mount namespace of a child process (needs CAP_SYS_ADMIN; skipped
// without it).
TEST(DefaultIndexDir, ReadOnlyMountFallsBackToCache) {
  TempDir tmp;
  const std::string src = MakeSource(tmp);
  const std::string xdg = tmp / "xdg";
  const int code = ExitCodeOnReadOnlyMount(src, [&] {
    ::setenv("XDG_CACHE_HOME", xdg.c_str(), 1);
    if (DefaultIndexDir(src) != CacheIndexDir(src)) return 1;
    if (fs::exists(src + "/.ucpfs")) return 2;
    IndexOptions opts;
    opts.scanner = [](const std::string& dir, const ScanProgress&) -> Result<Checkpoint> {
      return SourceCheckpoint(dir);
    };
    Result<OpenedIndex> r = OpenOrBuildIndex(src, opts);
    if (!r.ok() || r->state != IndexState::kBuilt || r->index_dir != CacheIndexDir(src)) return 3;
    r = OpenOrBuildIndex(src, opts);
    if (!r.ok() || r->state != IndexState::kReused) return 4;
    opts.read_only = true;  // a read-only consumer finds the cache index too
    r = OpenOrBuildIndex(src, opts);
    if (!r.ok() || r->state != IndexState::kReused || r->index_dir != CacheIndexDir(src)) return 5;
    return 0;
  });
  if (code == 77) GTEST_SKIP() << "cannot make a read-only bind mount here";
  EXPECT_EQ(code, 0) << "1: wrong dir, 2: probe wrote, 3: build, 4: reuse, 5: read-only reuse";
  EXPECT_TRUE(fs::is_directory(xdg + "/ucpfs"));  // the child's index landed in the cache
}

TEST(OpenOrBuild, UsesTheCacheWhenTheSourceIsReadOnly) {
  if (::geteuid() == 0) GTEST_SKIP() << "root can write a chmod 0555 directory";
  TempDir tmp;
  const std::string src = MakeSource(tmp);
  ASSERT_EQ(::setenv("XDG_CACHE_HOME", (tmp / "xdg").c_str(), 1), 0);
  fs::permissions(src, fs::perms::owner_read | fs::perms::owner_exec);
  FakeScanner scanner;
  IndexOptions opts;
  opts.scanner = scanner.fn();
  Result<OpenedIndex> r = OpenOrBuildIndex(src, opts);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->index_dir, CacheIndexDir(src));
  EXPECT_EQ(r->state, IndexState::kBuilt);
  r = OpenOrBuildIndex(src, opts);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->state, IndexState::kReused);
  ::unsetenv("XDG_CACHE_HOME");
}

// The stored facts are untrusted like every other record: what no scanner writes is refused
// (the catalog turns it into kDataLoss and rebuilds), never read as defaults.
TEST(SourceFacts, DecodeRefusesWhatNoScannerWrites) {
  Result<SourceFacts> none = DecodeSourceFacts("");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(std::holds_alternative<std::monostate>(*none));
  for (const char* bad : {"not json", "[]", "{}", R"({"dcp": {}, "weights": {}})", R"({"nope": {}})",
                          R"({"deepspeed": {"tag": 1}})", R"({"deepspeed": {"tag": "t", "zero_stage": 4}})",
                          R"({"megatron": {}})", R"({"dcp": {"megatron_args": {"vocab_size": -1}}})",
                          R"({"dcp": {"megatron_args": []}})",
                          R"({"weights": {"container": "safetensors", "files": [1], "skipped_values": 0}})",
                          R"({"torch_state": {"optimizer_file": "o.pt", "optimizer_prefix": "", "optimizer_top_key": 3}})"}) {
    Result<SourceFacts> r = DecodeSourceFacts(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_NE(r.error().message().find("index:"), std::string::npos) << r.error().message();
    }
  }
  EXPECT_FALSE(DecodeSourceFacts(std::string(kMaxSourceFactsBytes + 1, ' ')).ok());
}

// A Megatron-LM legacy save's decoded args (the hf/ view's config.json) survive the index, and
// args of the wrong form there are refused like the DCP ones.
TEST(SourceFacts, MegatronLegacyArgsRoundTrip) {
  MegatronSourceFacts m;
  m.tp = 2;
  m.pp = 2;
  m.num_layers = 4;
  m.hidden_size = 16;
  m.num_attention_heads = 4;
  m.num_query_groups = 2;
  m.kv_channels = 4;
  m.padded_vocab_size = 48;
  m.checkpoint_version = 3.0;
  m.args = MegatronCoreArgs{};
  m.args->num_query_groups = 2;
  m.args->architecture = {{"normalization", "RMSNorm"}, {"norm_epsilon", 1e-5}, {"add_bias_linear", true}};
  const std::string stored = EncodeSourceFacts(m);
  Result<SourceFacts> back = DecodeSourceFacts(stored);
  ASSERT_TRUE(back.ok()) << back.error().message();
  const auto* got = std::get_if<MegatronSourceFacts>(&*back);
  ASSERT_NE(got, nullptr);
  ASSERT_TRUE(got->args.has_value());
  EXPECT_EQ(got->args->num_query_groups, 2);
  EXPECT_EQ(got->args->architecture, m.args->architecture);
  EXPECT_EQ(EncodeSourceFacts(*back), stored);
  nlohmann::json bad = nlohmann::json::parse(stored);
  bad["megatron"]["megatron_args"]["architecture"] = {{"normalization", nlohmann::json::array()}};
  EXPECT_FALSE(DecodeSourceFacts(bad.dump()).ok());
}

}  // namespace
}  // namespace ucpfs::index
