// See progress.h.
#include "cli/progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>

namespace ucpfs::cli {
namespace {

constexpr int kBarWidth = 20;

std::string Count(ProgressUnit unit, double n) {
  if (unit == ProgressUnit::kBytes) return HumanBytes(n);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.0f", n);
  return buf;
}

// "45s", "3m05s", "2h07m".
std::string Duration(double s) {
  const uint64_t t = static_cast<uint64_t>(std::llround(s));
  char buf[32];
  if (t < 60) {
    std::snprintf(buf, sizeof(buf), "%llus", static_cast<unsigned long long>(t));
  } else if (t < 3600) {
    std::snprintf(buf, sizeof(buf), "%llum%02llus", static_cast<unsigned long long>(t / 60),
                  static_cast<unsigned long long>(t % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lluh%02llum", static_cast<unsigned long long>(t / 3600),
                  static_cast<unsigned long long>(t / 60 % 60));
  }
  return buf;
}

}  // namespace

std::string HumanBytes(double n_bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (n_bytes >= 1024 && u < 5) {
    n_bytes /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof(buf), "%.0f B", n_bytes);
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f %s", n_bytes, kUnits[u]);
  }
  return buf;
}

ProgressOptions StderrProgressOptions(std::string label, ProgressUnit unit, bool quiet) {
  ProgressOptions o;
  o.label = std::move(label);
  o.unit = unit;
  o.quiet = quiet;
  o.tty = ::isatty(2) != 0;
  return o;
}

Progress::Progress(ProgressOptions options) : options_(std::move(options)) {
  if (!options_.now) options_.now = [] { return std::chrono::steady_clock::now(); };
  if (!options_.write) {
    options_.write = [](std::string_view text) {
      std::fwrite(text.data(), 1, text.size(), stderr);
      std::fflush(stderr);
    };
  }
  start_ = options_.now();
  last_draw_ = start_;
}

std::string Progress::Render(std::string_view label, ProgressUnit unit, uint64_t done, uint64_t total,
                             double elapsed_s, std::string_view note) {
  std::string out(label);
  if (total > 0) {
    const double frac = std::min(1.0, static_cast<double>(done) / static_cast<double>(total));
    const int full = static_cast<int>(frac * kBarWidth);
    char pct[16];
    std::snprintf(pct, sizeof(pct), "%3d%%", static_cast<int>(frac * 100));
    out += " [" + std::string(static_cast<size_t>(full), '#') + std::string(static_cast<size_t>(kBarWidth - full), '-') +
           "] " + pct;
  }
  out += ' ' + Count(unit, static_cast<double>(done));
  if (total > 0) out += '/' + Count(unit, static_cast<double>(total));
  if (unit == ProgressUnit::kItems) out += " items";
  if (elapsed_s > 0 && done > 0) {
    const double rate = static_cast<double>(done) / elapsed_s;
    out += ' ' + (unit == ProgressUnit::kBytes ? HumanBytes(rate) + "/s" : Count(unit, rate) + " items/s");
    if (total > done) out += " ETA " + Duration(static_cast<double>(total - done) / rate);
  }
  if (!note.empty()) {
    out += ' ';
    out += note;
  }
  return out;
}

void Progress::Update(uint64_t done, uint64_t total, std::string_view note) {
  if (options_.quiet) return;
  std::lock_guard lock(mu_);
  if (finished_) return;
  const auto now = options_.now();
  if (options_.tty) {
    if (now - start_ < kTtyDelay || (drawn_ && now - last_draw_ < kTtyInterval)) return;
  } else if (now - last_draw_ < kLineInterval) {
    return;
  }
  last_draw_ = now;
  Draw(done, total, note, /*final=*/false);
}

void Progress::Finish(uint64_t done, uint64_t total, std::string_view note) {
  if (options_.quiet) return;
  std::lock_guard lock(mu_);
  if (finished_) return;
  finished_ = true;
  Draw(done, total, note, /*final=*/true);
}

void Progress::Draw(uint64_t done, uint64_t total, std::string_view note, bool final) {
  const double elapsed_s = std::chrono::duration<double>(options_.now() - start_).count();
  const std::string line = Render(options_.label, options_.unit, done, total, elapsed_s, note);
  if (options_.tty) {
    // "\r" and clear to the end of the line: a shorter line leaves nothing of the longer one.
    options_.write("\r" + line + "\x1b[K" + (final ? "\n" : ""));
  } else {
    options_.write(line + "\n");
  }
  drawn_ = true;
}

index::ScanProgress ScanProgressOf(std::shared_ptr<Progress> progress) {
  if (!progress) return nullptr;
  return [progress](uint64_t done, uint64_t total) {
    if (done >= total) {
      progress->Finish(done, total);
    } else {
      progress->Update(done, total);
    }
  };
}

index::ScanProgress IndexingProgress(bool quiet) {
  return ScanProgressOf(
      std::make_shared<Progress>(StderrProgressOptions("ucpfs: indexing", ProgressUnit::kItems, quiet)));
}

}  // namespace ucpfs::cli
