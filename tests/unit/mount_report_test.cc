// MountReport: view reads counted, errors counted, the newest kMaxMessages messages kept in
// order (older ones dropped, long ones cut), counted-only errors, concurrent recording.
#include "fs/mount_report.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

namespace ucpfs::fs {
namespace {

nlohmann::ordered_json Json(const MountReport& r) {
  nlohmann::ordered_json j;
  r.AddTo(j);
  return j;
}

TEST(MountReport, EmptyReportsZeros) {
  MountReport r;
  const auto j = Json(r);
  EXPECT_EQ(j["views"]["reads"], 0u);
  EXPECT_EQ(j["views"]["bytes_read"], 0u);
  EXPECT_EQ(j["errors"]["count"], 0u);
  EXPECT_TRUE(j["errors"]["last"].empty());
}

TEST(MountReport, KeepsTheNewestMessagesInOrder) {
  MountReport r;
  r.CountViewRead(100);
  r.CountViewRead(28);
  for (size_t i = 0; i < MountReport::kMaxMessages + 3; ++i) r.RecordError("read atomic/w" + std::to_string(i));
  r.RecordError("repeat, not kept", /*keep_message=*/false);
  const auto j = Json(r);
  EXPECT_EQ(j["views"]["reads"], 2u);
  EXPECT_EQ(j["views"]["bytes_read"], 128u);
  EXPECT_EQ(j["errors"]["count"], MountReport::kMaxMessages + 4);
  ASSERT_EQ(j["errors"]["last"].size(), MountReport::kMaxMessages);
  EXPECT_EQ(j["errors"]["last"][0], "read atomic/w3");
  EXPECT_EQ(j["errors"]["last"][MountReport::kMaxMessages - 1], "read atomic/w" + std::to_string(MountReport::kMaxMessages + 2));
}

TEST(MountReport, CutsLongMessages) {
  MountReport r;
  r.RecordError("open target/x: " + std::string(5000, 'e'));
  const std::string kept = Json(r)["errors"]["last"][0];
  EXPECT_EQ(kept.size(), MountReport::kMaxMessageBytes);
  EXPECT_EQ(kept.substr(0, 15), "open target/x: ");
  EXPECT_EQ(kept.substr(kept.size() - 3), "...");
}

TEST(MountReport, ConcurrentRecordsAllCount) {
  MountReport r;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&r, t] {
      for (int i = 0; i < 1000; ++i) {
        r.CountViewRead(2);
        r.RecordError("t" + std::to_string(t));
        (void)Json(r);
      }
    });
  }
  for (auto& th : threads) th.join();
  const auto j = Json(r);
  EXPECT_EQ(j["views"]["reads"], 4000u);
  EXPECT_EQ(j["views"]["bytes_read"], 8000u);
  EXPECT_EQ(j["errors"]["count"], 4000u);
  EXPECT_EQ(j["errors"]["last"].size(), MountReport::kMaxMessages);
}

}  // namespace
}  // namespace ucpfs::fs
