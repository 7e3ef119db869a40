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

#include <nlohmann/json.hpp>

#include "cli/progress.h"
#include "cli/view_args.h"
#include "views/view_files.h"
#include "core/json_text.h"
#include "index/key_map.h"
#include "index/snapshot.h"

namespace ucpfs::cli {
namespace {

constexpr size_t kChunkBytes = 8u << 20;

// Streams `src` to DST/<path>.tmp in kChunkBytes reads, then renames it into place.
Status WriteFile(const std::string& dst, const views::ViewFile& job, std::vector<std::byte>& buf,
                 std::atomic<uint64_t>& bytes_done) {
  const std::string path = dst + "/" + job.path;
  auto opened = job.open();
  if (!opened.ok()) return opened.error().WithContext(job.path);
  const ByteSource& source = **opened;
  if (source.Size() != job.n_bytes) {
    return InternalError(job.path + ": built with " + std::to_string(source.Size()) + " bytes, listed with " +
                         std::to_string(job.n_bytes));
  }
  const std::string tmp = path + ".tmp";
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (ec) return IoError(path + ": mkdir: " + ec.message(), ec.value());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return IoError(tmp + ": open: " + std::strerror(errno), errno);
  const uint64_t size = job.n_bytes;
  Status st;
  for (uint64_t off = 0; off < size && st.ok();) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunkBytes, size - off));
    std::span<std::byte> out(buf.data(), n);
    st = source.ReadAt(off, out);
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

// "target tp2_pp1_dp1, atomic, hf": the views written, in registry order.
std::string KindList(const ViewSelection& selection) {
  std::string out;
  for (const std::string& kind : selection.kinds) {
    out += (out.empty() ? "" : ", ") + kind;
    if (kind != "target") continue;
    for (const auto& l : selection.options.layouts) out += " " + l.name;
  }
  return out;
}

int Fail(const Status& s) {
  std::cerr << "ucpfs convert: " << s.ToString() << '\n';
  return 1;
}

}  // namespace

int RunConvert(const ConvertArgs& args) {
  const auto t0 = std::chrono::steady_clock::now();
  // Arguments first, so that a typo fails before the index is opened.
  auto selection = ParseViewArgs(args.views);
  if (!selection.ok()) return Fail(selection.error());
  if (selection->kinds.empty()) {
    return Fail(InvalidArgumentError("nothing to write: give --layout=L, --atomic, --safetensors and/or --view=NAME (" +
                                     views::ViewKindNames() + ")"));
  }

  // The same Snapshot the mount serves (index, key mapping, file table).
  auto snapshot = OpenSourceSnapshot(args.source);
  if (!snapshot.ok()) return Fail(snapshot.error());
  const std::string& src = (*snapshot)->source_dir();
  const std::shared_ptr<IoCounters>& counters = (*snapshot)->counters;
  auto jobs = views::ListViewFiles(*snapshot, selection->options, selection->kinds);
  if (!jobs.ok()) return Fail(jobs.error());

  // Balance by size: largest first onto the least loaded worker.
  int n_threads = args.threads > 0 ? args.threads : static_cast<int>(std::thread::hardware_concurrency());
  n_threads = std::max(1, std::min<int>(n_threads, static_cast<int>(std::max<size_t>(jobs->size(), 1))));
  std::stable_sort(jobs->begin(), jobs->end(),
                   [](const views::ViewFile& a, const views::ViewFile& b) { return a.n_bytes > b.n_bytes; });
  std::vector<std::vector<const views::ViewFile*>> per_thread(static_cast<size_t>(n_threads));
  std::vector<uint64_t> load(static_cast<size_t>(n_threads), 0);
  uint64_t total_bytes = 0;
  for (const auto& j : *jobs) {
    const size_t t = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    per_thread[t].push_back(&j);
    load[t] += j.n_bytes;
    total_bytes += j.n_bytes;
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
      for (const views::ViewFile* j : per_thread[static_cast<size_t>(t)]) {
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
  Progress progress(StderrProgressOptions("ucpfs convert:", ProgressUnit::kBytes, args.source.quiet));
  auto note = [&] { return std::to_string(files_done.load()) + "/" + std::to_string(jobs->size()) + " files"; };
  while (files_done < jobs->size() && !failed) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    progress.Update(bytes_done.load(), total_bytes, note());
  }
  for (auto& w : workers) w.join();
  if (first_error.ok()) progress.Finish(bytes_done.load(), total_bytes, note());
  if (!first_error.ok()) return Fail(first_error);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (args.json) {
    nlohmann::ordered_json out;
    out["source"] = src;
    out["dst"] = AbsPath(args.dst);
    out["files"] = jobs->size();
    out["bytes"] = total_bytes;
    auto names = nlohmann::ordered_json::array();
    for (const auto& l : selection->options.layouts) names.push_back(l.name);
    out["layouts"] = std::move(names);
    out["atomic"] = args.views.atomic;
    out["safetensors"] = args.views.safetensors;
    out["views"] = selection->kinds;
    out["threads"] = n_threads;
    out["source_bytes_read"] = counters->source_bytes_read.load();
    out["seconds"] = secs;
    std::cout << JsonText(out) << '\n';
    return 0;
  }
  std::cout << "ucpfs convert: wrote " << jobs->size() << " files, " << total_bytes << " bytes to "
            << args.dst << " (" << KindList(*selection) << ", " << n_threads << " threads, " << counters->source_bytes_read.load()
            << " source bytes read) in " << secs << " s\n";
  return 0;
}

}  // namespace ucpfs::cli
