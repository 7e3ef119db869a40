// cli/progress: the text of a progress line (bar, counts, rate, ETA) and when lines are drawn
// (terminal throttle and delay, plain lines every 2 s, the final line, quiet), rendered into a
// string with an injected clock.
#include "cli/progress.h"

#include <gtest/gtest.h>

#include <string>

namespace ucpfs::cli {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

struct Fixture {
  Clock::time_point t = Clock::time_point{} + std::chrono::hours(1);
  std::string out;
  ProgressOptions Options(bool tty, ProgressUnit unit = ProgressUnit::kBytes, bool quiet = false) {
    ProgressOptions o;
    o.label = "ucpfs test:";
    o.unit = unit;
    o.tty = tty;
    o.quiet = quiet;
    o.now = [this] { return t; };
    o.write = [this](std::string_view s) { out += s; };
    return o;
  }
};

TEST(ProgressRender, BarPercentRateAndEtaInBytes) {
  // 4 of 10 MiB in 2 s: 2 MiB/s, 6 MiB left: 3 s.
  EXPECT_EQ(Progress::Render("ucpfs x:", ProgressUnit::kBytes, 4 << 20, 10 << 20, 2.0),
            "ucpfs x: [########------------]  40% 4.0 MiB/10.0 MiB 2.0 MiB/s ETA 3s");
}

TEST(ProgressRender, ItemsRateEtaInMinutesAndNote) {
  // 30 of 3030 items in 3 s: 10 items/s, 3000 left: 300 s = 5m00s.
  EXPECT_EQ(Progress::Render("idx:", ProgressUnit::kItems, 30, 3030, 3.0, "(3 files)"),
            "idx: [--------------------]   0% 30/3030 items 10 items/s ETA 5m00s (3 files)");
}

TEST(ProgressRender, DoneHasNoEtaAndNoTimeHasNoRate) {
  EXPECT_EQ(Progress::Render("a:", ProgressUnit::kItems, 5, 5, 1.0),
            "a: [####################] 100% 5/5 items 5 items/s");
  EXPECT_EQ(Progress::Render("a:", ProgressUnit::kBytes, 0, 2048, 0.0), "a: [--------------------]   0% 0 B/2.0 KiB");
  // Unknown total: no bar, no percentage, no ETA.
  EXPECT_EQ(Progress::Render("a:", ProgressUnit::kBytes, 3ull << 30, 0, 3.0), "a: 3.0 GiB 1.0 GiB/s");
}

TEST(ProgressRender, HumanBytes) {
  EXPECT_EQ(HumanBytes(37), "37 B");
  EXPECT_EQ(HumanBytes(1536), "1.5 KiB");
  EXPECT_EQ(HumanBytes(12.0 * (1ull << 40)), "12.0 TiB");
}

TEST(Progress, TtyWaitsHalfASecondThenRedrawsAtMostEvery100ms) {
  Fixture f;
  Progress p(f.Options(/*tty=*/true, ProgressUnit::kItems));
  p.Update(1, 10);  // t = 0: too early
  f.t += milliseconds(499);
  p.Update(2, 10);
  EXPECT_EQ(f.out, "");
  f.t += milliseconds(1);  // 500 ms
  p.Update(3, 10);
  EXPECT_EQ(f.out, "\rucpfs test: [######--------------]  30% 3/10 items 6 items/s ETA 1s\x1b[K");
  f.out.clear();
  f.t += milliseconds(99);
  p.Update(4, 10);  // 99 ms after the last draw: skipped
  EXPECT_EQ(f.out, "");
  f.t += milliseconds(1);
  p.Update(5, 10);
  EXPECT_EQ(f.out.substr(0, 1), "\r");
  EXPECT_NE(f.out.find(" 5/10 items"), std::string::npos) << f.out;
  EXPECT_EQ(f.out.find('\n'), std::string::npos);
  f.out.clear();
  p.Finish(10, 10);  // the final line whatever the throttle, ending the line
  EXPECT_EQ(f.out, "\rucpfs test: [####################] 100% 10/10 items 17 items/s\x1b[K\n");
  f.out.clear();
  f.t += milliseconds(1000);
  p.Update(10, 10);
  p.Finish(10, 10);
  EXPECT_EQ(f.out, "");  // nothing after the final line
}

TEST(Progress, NotATtyPrintsPlainLinesEveryTwoSecondsAndAFinalLine) {
  Fixture f;
  Progress p(f.Options(/*tty=*/false));
  int lines = 0;
  for (int i = 1; i <= 50; ++i) {  // 5 s in steps of 100 ms
    f.t += milliseconds(100);
    p.Update(static_cast<uint64_t>(i) << 20, 100 << 20);
  }
  for (char c : f.out) lines += c == '\n';
  EXPECT_EQ(lines, 2) << f.out;  // at 2 s and 4 s
  EXPECT_EQ(f.out.find('\r'), std::string::npos);
  EXPECT_EQ(f.out.substr(0, f.out.find('\n')),
            "ucpfs test: [####----------------]  20% 20.0 MiB/100.0 MiB 10.0 MiB/s ETA 8s");
  f.out.clear();
  f.t += milliseconds(100);
  p.Finish(100 << 20, 100 << 20, "done");
  EXPECT_EQ(f.out, "ucpfs test: [####################] 100% 100.0 MiB/100.0 MiB 19.6 MiB/s done\n");
}

TEST(Progress, QuietDrawsNothing) {
  Fixture f;
  Progress p(f.Options(/*tty=*/true, ProgressUnit::kBytes, /*quiet=*/true));
  f.t += milliseconds(3000);
  p.Update(1, 2);
  p.Finish(2, 2);
  auto scan = ScanProgressOf(std::make_shared<Progress>(f.Options(false, ProgressUnit::kItems, true)));
  f.t += milliseconds(3000);
  scan(1, 2);
  scan(2, 2);
  EXPECT_EQ(f.out, "");
}

TEST(Progress, ScanProgressFinishesAtTotal) {
  Fixture f;
  auto scan = ScanProgressOf(std::make_shared<Progress>(f.Options(/*tty=*/false, ProgressUnit::kItems)));
  scan(1, 3);  // before 2 s: no line
  f.t += milliseconds(1000);
  scan(3, 3);
  EXPECT_EQ(f.out, "ucpfs test: [####################] 100% 3/3 items 3 items/s\n");
  EXPECT_EQ(ScanProgressOf(nullptr), nullptr);
}

}  // namespace
}  // namespace ucpfs::cli
