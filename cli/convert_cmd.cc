#include "cli/convert_cmd.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/io/lazy_file_source.h"
#include "core/layout/layout.h"
#include "core/layout/patterns.h"
#include "core/views/atomic.h"
#include "core/views/target.h"
#include "index/catalog.h"
#include "index/snapshot.h"
#include "index/key_map.h"
#include "index/safetensors_view.h"
#include "index/view_inputs.h"

namespace ucpfs::cli {
namespace {

constexpr size_t kChunkBytes = 8u << 20;

using Files = std::shared_ptr<const std::vector<std::shared_ptr<const ByteSource>>>;

std::string AbsPath(const std::string& p) {
  char buf[PATH_MAX];
  if (::realpath(p.c_str(), buf) != nullptr) return buf;
  return p;
}

struct Job {
  std::string path;  // relative to DST
  std::shared_ptr<const ByteSource> src;
};

// Streams `src` to DST/<path>.tmp in kChunkBytes reads, then renames it into place.
Status WriteFile(const std::string& dst, const Job& job, std::vector<std::byte>& buf,
                 std::atomic<uint64_t>& bytes_done) {
  const std::string path = dst + "/" + job.path;
  const std::string tmp = path + ".tmp";
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (ec) return IoError(path + ": mkdir: " + ec.message(), ec.value());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return IoError(tmp + ": open: " + std::strerror(errno), errno);
  const uint64_t size = job.src->Size();
  Status st;
  for (uint64_t off = 0; off < size && st.ok();) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunkBytes, size - off));
    std::span<std::byte> out(buf.data(), n);
    st = job.src->ReadAt(off, out);
    if (!st.ok()) {
      st = st.WithContext(job.path);
      break;
    }
    size_t written = 0;
    while (written < n) {
      ssize_t w = ::write(fd, out.data() + written, n - written);
      if (w < 0) {
        if (errno == EINTR) continue;
        st = IoError(tmp + ": write: " + std::strerror(errno), errno);
        break;
      }
      written += static_cast<size_t>(w);
    }
    off += n;
    bytes_done += n;
  }
  if (::close(fd) != 0 && st.ok()) st = IoError(tmp + ": close: " + std::strerror(errno), errno);
  if (st.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    st = IoError(path + ": rename: " + std::strerror(errno), errno);
  }
  if (!st.ok()) ::unlink(tmp.c_str());
  return st;
}

Result<std::string> ReadText(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return NotFoundError(path + ": cannot open");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int Fail(const Status& s) {
  std::cerr << "ucpfs convert: " << s.ToString() << '\n';
  return 1;
}

}  // namespace

int RunConvert(const ConvertArgs& args) {
  const auto t0 = std::chrono::steady_clock::now();
  if (args.layouts.empty() && !args.atomic && !args.safetensors) {
    return Fail(InvalidArgumentError("nothing to write: give --layout=L, --atomic and/or --safetensors"));
  }
  auto shard_n_bytes = ParseShardSize(args.safetensors_shard_size);
  if (!shard_n_bytes.ok()) return Fail(shard_n_bytes.error());
  // Arguments first, so that a typo fails before the index is opened.
  std::vector<layout::Layout> layouts;
  for (const auto& name : args.layouts) {
    auto l = layout::ParseLayout(name);
    if (!l.ok()) return Fail(l.error());
    const bool repeated = std::any_of(layouts.begin(), layouts.end(),
                                      [&](const layout::Layout& seen) { return seen.name == l->name; });
    if (!repeated) layouts.push_back(std::move(*l));  // --layout given twice: one view
  }
  auto preset = layout::ParsePreset(args.preset);
  if (!preset.ok()) return Fail(preset.error());
  std::vector<layout::Rule> rules;
  if (!args.pattern_rules.empty()) {
    auto text = ReadText(args.pattern_rules);
    if (!text.ok()) return Fail(text.error());
    auto r = layout::ParseRules(*text, args.pattern_rules);
    if (!r.ok()) return Fail(r.error());
    rules = std::move(*r);
  }
  std::optional<std::vector<int>> pp_split;
  if (!args.pp_split.empty()) {
    auto s = layout::ParsePpSplit(args.pp_split);
    if (!s.ok()) return Fail(s.error());
    pp_split = std::move(*s);
  }

  struct stat st;
  if (::stat(args.source.src.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Fail(NotFoundError(args.source.src + ": not a checkpoint directory"));
  }
  const std::string src = AbsPath(args.source.src);
  index::SnapshotOptions so;
  so.source_dir = src;
  so.index_dir = args.source.index_dir;
  so.read_only_index = args.source.read_only_index;
  if (!args.source.rules.empty()) {
    auto r = index::LoadRules(args.source.rules);
    if (!r.ok()) return Fail(r.error());
    so.key_rules = std::move(*r);
  }
  // The same Snapshot the mount serves (index, key mapping, file table).
  auto snapshot = index::OpenSnapshot(so, 1);
  if (!snapshot.ok()) return Fail(snapshot.error());
  const index::Snapshot& snap = **snapshot;
  const auto& ckpt = snap.checkpoint();
  const auto* mapping = &snap.mapping;
  const std::shared_ptr<IoCounters>& counters = snap.counters;
  const Files& files = snap.files;

  auto patterns = index::PatternOptionsFor(ckpt, *preset, rules);
  if (!patterns.ok()) return Fail(patterns.error());
  std::vector<Job> jobs;
  if (!layouts.empty()) {
    auto input = index::MakeTargetInput(ckpt, *mapping, files, [](const std::string& w) {
      std::cerr << "ucpfs convert: warning: " << w << '\n';
    });
    if (!input.ok()) return Fail(input.error());
    (*input)->preset = patterns->preset;
    (*input)->rules = patterns->rules;
    (*input)->vocab_size = patterns->vocab_size;
    (*input)->model_facts = patterns->model_facts;
    (*input)->pp_split = pp_split;
    std::shared_ptr<const views::TargetInput> shared = *input;
    for (const auto& l : layouts) {
      auto plan = views::TargetPlan::Make(shared, l);
      if (!plan.ok()) return Fail(plan.error().WithContext("layout " + l.name));
      for (int r = 0; r < l.World(); ++r) {
        auto rf = plan->Build(r);
        if (!rf.ok()) return Fail(rf.error().WithContext("layout " + l.name + " rank " + std::to_string(r)));
        const std::string dir = "target/" + l.name + "/rank_" + std::to_string(r) + "/";
        jobs.push_back({dir + "model.pt", rf->model});
        if (rf->model_safetensors) jobs.push_back({dir + "model.safetensors", rf->model_safetensors});
        if (rf->optim) jobs.push_back({dir + "optim.pt", rf->optim});
        if (rf->extra) jobs.push_back({dir + "extra_state.pt", rf->extra});
        jobs.push_back({dir + "ucp_info.json", rf->info});
      }
    }
  }
  if (args.safetensors) {
    auto views = index::BuildSafetensorsView(ckpt, *mapping, files, *patterns, *shard_n_bytes);
    if (!views.ok()) return Fail(views.error());
    if (views->empty()) return Fail(NotFoundError(src + ": no model weights to write as safetensors"));
    for (auto& v : *views) jobs.push_back({"safetensors/" + v.name, std::move(v.source)});
  }
  if (args.atomic) {
    auto views = index::BuildAtomicViews(ckpt, *mapping, files, *patterns);
    if (!views.ok()) return Fail(views.error());
    for (auto& v : *views) jobs.push_back({"atomic/" + v.dir + "/" + v.file, std::move(v.source)});
  }

  // Balance by size: largest first onto the least loaded worker.
  int n_threads = args.threads > 0 ? args.threads : static_cast<int>(std::thread::hardware_concurrency());
  n_threads = std::max(1, std::min<int>(n_threads, static_cast<int>(std::max<size_t>(jobs.size(), 1))));
  std::stable_sort(jobs.begin(), jobs.end(),
                   [](const Job& a, const Job& b) { return a.src->Size() > b.src->Size(); });
  std::vector<std::vector<const Job*>> per_thread(static_cast<size_t>(n_threads));
  std::vector<uint64_t> load(static_cast<size_t>(n_threads), 0);
  uint64_t total_bytes = 0;
  for (const auto& j : jobs) {
    const size_t t = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    per_thread[t].push_back(&j);
    load[t] += j.src->Size();
    total_bytes += j.src->Size();
  }

  std::atomic<uint64_t> bytes_done{0};
  std::atomic<size_t> files_done{0};
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  Status first_error;
  std::vector<std::thread> workers;
  for (int t = 0; t < n_threads; ++t) {
    workers.emplace_back([&, t] {
      std::vector<std::byte> buf(kChunkBytes);
      for (const Job* j : per_thread[static_cast<size_t>(t)]) {
        if (failed) return;
        Status s = WriteFile(args.dst, *j, buf, bytes_done);
        if (!s.ok()) {
          std::lock_guard<std::mutex> lock(err_mu);
          if (first_error.ok()) first_error = s;
          failed = true;
          return;
        }
        ++files_done;
      }
    });
  }
  // Progress on stderr while the workers run.
  const bool tty = ::isatty(2) != 0;
  auto last = std::chrono::steady_clock::now();
  while (files_done + (failed ? 1 : 0) < jobs.size() && !failed) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    auto now = std::chrono::steady_clock::now();
    if (now - last >= std::chrono::milliseconds(tty ? 200 : 2000)) {
      last = now;
      std::fprintf(stderr, "%sucpfs convert: %zu/%zu files, %llu/%llu bytes%s", tty ? "\r" : "",
                   files_done.load(), jobs.size(), static_cast<unsigned long long>(bytes_done.load()),
                   static_cast<unsigned long long>(total_bytes), tty ? "" : "\n");
      std::fflush(stderr);
    }
  }
  for (auto& w : workers) w.join();
  if (tty) std::fprintf(stderr, "\n");
  if (!first_error.ok()) return Fail(first_error);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << "ucpfs convert: wrote " << jobs.size() << " files, " << total_bytes << " bytes to "
            << args.dst << " (" << layouts.size() << " layouts" << (args.atomic ? " + atomic" : "")
            << ", " << n_threads << " threads, " << counters->source_bytes_read.load()
            << " source bytes read) in " << secs << " s\n";
  return 0;
}

}  // namespace ucpfs::cli
