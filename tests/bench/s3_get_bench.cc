// Batched ranged GETs (Client::GetRanges: a batch in flight at once over kept-open connections)
// against the same ranges read one GET after another (Client::GetRange), from the S3 store the
// AWS environment variables name (run it under `tests/s3/rgw.sh exec DIR`). Every byte read is
// compared with what was PUT, so a fast wrong answer cannot win.
//
//   tests/s3/rgw.sh exec DIR build/tests/s3_get_bench [OBJECT_MIB] [ROUNDS]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <unistd.h>

#include "core/io/s3_client.h"

using namespace ucpfs;
using namespace ucpfs::s3;

namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

[[noreturn]] void Die(const std::string& what, const Status& st) {
  std::fprintf(stderr, "s3_get_bench: %s: %s\n", what.c_str(), st.ToString().c_str());
  std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t object_mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 64;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 3;
  auto env = LoadS3Environment();
  if (!env.ok()) Die("environment", env.error());
  auto opt = ResolveOptions(*env);
  if (!opt.ok()) Die("options", opt.error());
  auto made = Client::Make(*opt);
  if (!made.ok()) Die("client", made.error());
  Client& c = **made;
  std::string bucket = "ucpfs-bench-" + std::to_string(getpid());
  if (Status st = c.CreateBucket(bucket); !st.ok()) Die("create bucket", st);
  std::vector<std::byte> data(object_mib << 20);
  std::mt19937_64 rng(1);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  if (auto e = c.PutObject(bucket, "obj", data); !e.ok()) Die("put", e.error());
  std::printf("object %llu MiB at %s, max_in_flight %d, %d rounds (best of)\n",
              static_cast<unsigned long long>(object_mib), opt->endpoint_url.c_str(), opt->max_in_flight, rounds);
  std::printf("%10s %8s %14s %14s %8s\n", "range", "ranges", "sequential", "batched", "ratio");
  for (uint64_t range_kib : {64ull, 256ull, 1024ull, 4096ull}) {
    uint64_t n_bytes = range_kib << 10;
    size_t n_ranges = static_cast<size_t>(std::min<uint64_t>(256, data.size() / n_bytes));
    // Ranges at odd offsets spread over the object, as a rank's slices of a shard are.
    std::vector<uint64_t> offs(n_ranges);
    for (size_t i = 0; i < n_ranges; ++i) offs[i] = (i * (data.size() - n_bytes)) / n_ranges + (i % 7);
    std::vector<std::vector<std::byte>> bufs(n_ranges, std::vector<std::byte>(n_bytes));
    double best_seq = 1e9, best_batch = 1e9;
    for (int r = 0; r < rounds; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      for (size_t i = 0; i < n_ranges; ++i) {
        if (Status st = c.GetRange(bucket, "obj", offs[i], bufs[i]); !st.ok()) Die("get", st);
      }
      best_seq = std::min(best_seq, Seconds(t0));
      for (size_t i = 0; i < n_ranges; ++i) {
        if (std::memcmp(bufs[i].data(), data.data() + offs[i], n_bytes) != 0) Die("compare", InternalError("bytes differ"));
        std::memset(bufs[i].data(), 0, n_bytes);
      }
      std::vector<RangeRead> reads;
      for (size_t i = 0; i < n_ranges; ++i) reads.push_back({bucket, "obj", offs[i], bufs[i], ""});
      t0 = std::chrono::steady_clock::now();
      if (Status st = c.GetRanges(reads); !st.ok()) Die("get batch", st);
      best_batch = std::min(best_batch, Seconds(t0));
      for (size_t i = 0; i < n_ranges; ++i) {
        if (std::memcmp(bufs[i].data(), data.data() + offs[i], n_bytes) != 0) Die("compare", InternalError("bytes differ"));
      }
    }
    double mib = static_cast<double>(n_ranges * n_bytes) / (1 << 20);
    std::printf("%7llu KiB %8zu %9.0f MiB/s %9.0f MiB/s %7.2fx\n", static_cast<unsigned long long>(range_kib), n_ranges,
                mib / best_seq, mib / best_batch, best_seq / best_batch);
  }
  // One read of the whole object: a single GET (no ETag) against GETs of max_get_bytes in flight
  // together (If-Match on the ETag).
  auto info = c.Head(bucket, "obj");
  if (!info.ok()) Die("head", info.error());
  std::vector<std::byte> whole(data.size());
  double best_one = 1e9, best_split = 1e9;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    if (Status st = c.GetRange(bucket, "obj", 0, whole); !st.ok()) Die("get whole", st);
    best_one = std::min(best_one, Seconds(t0));
    if (whole != data) Die("compare", InternalError("bytes differ"));
    t0 = std::chrono::steady_clock::now();
    if (Status st = c.GetRange(bucket, "obj", 0, whole, info->etag); !st.ok()) Die("get whole split", st);
    best_split = std::min(best_split, Seconds(t0));
    if (whole != data) Die("compare", InternalError("bytes differ"));
  }
  double all_mib = static_cast<double>(data.size()) / (1 << 20);
  std::printf("whole object: one GET %.0f MiB/s, %llu MiB GETs in flight %.0f MiB/s, %.2fx\n", all_mib / best_one,
              static_cast<unsigned long long>(opt->max_get_bytes >> 20), all_mib / best_split, best_one / best_split);
  CounterValues cv = c.counters();
  std::printf("requests %llu, retries %llu, connections made %llu, bytes got %llu\n",
              static_cast<unsigned long long>(cv.requests), static_cast<unsigned long long>(cv.retries),
              static_cast<unsigned long long>(cv.connects), static_cast<unsigned long long>(cv.bytes_get));
  (void)c.DeleteObject(bucket, "obj");
  (void)c.DeleteBucket(bucket);
  return 0;
}
