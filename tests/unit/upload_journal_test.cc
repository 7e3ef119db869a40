// The bucket uploader's queue journal (core/io/upload_journal.h): records round-trip, a torn or
// damaged tail ends it, hostile records (bad paths, oversized or unprintable upload ids, unknown
// types, lengths past the payload, a journal past its bound, a wrong magic) are refused or
// dropped, never trusted, and the plan keeps the queue order of what was not done.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/io/capture_journal.h"
#include "core/io/upload_journal.h"

namespace ucpfs::io {
namespace {

std::vector<std::byte> Magic() {
  std::vector<std::byte> out(sizeof(kUploadJournalMagic));
  std::memcpy(out.data(), kUploadJournalMagic, sizeof(kUploadJournalMagic));
  return out;
}

void Add(std::vector<std::byte>& j, const UploadRecord& r) {
  const std::vector<std::byte> b = EncodeUploadRecord(r);
  j.insert(j.end(), b.begin(), b.end());
}

UploadRecord Queued(uint64_t id, const std::string& path, uint64_t size = 10) {
  UploadRecord r;
  r.type = UploadRecordType::kQueued;
  r.id = id;
  r.path = path;
  r.size = size;
  r.ino = 100 + id;
  r.mtime_ns = -5;  // negative times survive
  return r;
}

UploadRecord Of(UploadRecordType t, uint64_t id, const std::string& text = "") {
  UploadRecord r;
  r.type = t;
  r.id = id;
  if (t == UploadRecordType::kBegun) r.upload_id = text;
  if (t == UploadRecordType::kDelete) r.path = text;
  return r;
}

// A framed record of an arbitrary payload (a valid checksum over hostile content).
void AddRaw(std::vector<std::byte>& j, std::vector<std::byte> payload) {
  const std::vector<std::byte> b = FrameJournalPayload(payload);
  j.insert(j.end(), b.begin(), b.end());
}

TEST(UploadJournal, RoundTripAndPlanInQueueOrder) {
  std::vector<std::byte> j = Magic();
  Add(j, Queued(1, "step1/__0_0.distcp", 1 << 20));
  Add(j, Queued(2, "step1/__1_0.distcp"));
  Add(j, Of(UploadRecordType::kBegun, 1, "2~abcDEF.123"));
  Add(j, Of(UploadRecordType::kDone, 2));
  Add(j, Queued(3, "step1/.metadata"));
  Add(j, Of(UploadRecordType::kDelete, 4, "step1/.metadata.tmp"));
  auto parsed = ParseUploadJournal(j);
  ASSERT_TRUE(parsed.ok()) << parsed.error().ToString();
  EXPECT_EQ(parsed->stopped, "");
  EXPECT_EQ(parsed->n_bytes_used, j.size());
  ASSERT_EQ(parsed->records.size(), 6u);
  EXPECT_EQ(parsed->records[0].mtime_ns, -5);
  EXPECT_EQ(parsed->records[0].ino, 101u);
  EXPECT_EQ(parsed->records[2].upload_id, "2~abcDEF.123");
  const UploadPlan plan = PlanUploads(*parsed);
  EXPECT_TRUE(plan.dropped.empty());
  EXPECT_EQ(plan.max_id, 4u);
  ASSERT_EQ(plan.pending.size(), 3u);  // item 2 is done
  EXPECT_EQ(plan.pending[0].path, "step1/__0_0.distcp");
  EXPECT_EQ(plan.pending[0].size, uint64_t{1} << 20);
  EXPECT_EQ(plan.pending[0].begun_upload_ids, std::vector<std::string>{"2~abcDEF.123"});
  EXPECT_EQ(plan.pending[1].path, "step1/.metadata");
  EXPECT_FALSE(plan.pending[1].is_delete);
  EXPECT_EQ(plan.pending[2].path, "step1/.metadata.tmp");
  EXPECT_TRUE(plan.pending[2].is_delete);
}

TEST(UploadJournal, TornOrDamagedTailEndsIt) {
  std::vector<std::byte> j = Magic();
  Add(j, Queued(1, "a"));
  const size_t whole = j.size();
  Add(j, Queued(2, "b"));
  for (size_t cut = whole + 1; cut < j.size(); cut += 3) {
    auto parsed = ParseUploadJournal(std::span(j).first(cut));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(parsed->records.size(), 1u) << cut;
    EXPECT_NE(parsed->stopped, "") << cut;
    EXPECT_EQ(parsed->n_bytes_used, whole);
  }
  std::vector<std::byte> flipped = j;
  flipped[whole + 20] ^= std::byte{0x40};  // inside the second payload: its checksum fails
  auto parsed = ParseUploadJournal(flipped);
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed->records.size(), 1u);
  EXPECT_NE(parsed->stopped.find("damaged record"), std::string::npos);
}

TEST(UploadJournal, RefusesWrongMagicAndOversize) {
  std::vector<std::byte> j = Magic();
  j[7] = std::byte{'2'};
  EXPECT_EQ(ParseUploadJournal(j).error().code(), StatusCode::kCorrupt);
  // The capture journal's magic is not this one's.
  std::vector<std::byte> capture(sizeof(kJournalMagic));
  std::memcpy(capture.data(), kJournalMagic, sizeof(kJournalMagic));
  EXPECT_EQ(ParseUploadJournal(capture).error().code(), StatusCode::kCorrupt);
  EXPECT_EQ(ParseUploadJournal({}).error().code(), StatusCode::kCorrupt);
  std::vector<std::byte> huge = Magic();
  huge.resize(kMaxUploadJournalBytes + 1);
  EXPECT_EQ(ParseUploadJournal(huge).error().code(), StatusCode::kCorrupt);
}

TEST(UploadJournal, HostileRecordsAreNotDecoded) {
  auto payload = [](uint8_t type, uint64_t id) {
    std::vector<std::byte> p{static_cast<std::byte>(type)};
    PutLittleEndian(p, id, 8);
    return p;
  };
  // Each case: one good record, then the hostile one (checksum valid), then a good one that must
  // not be read (the journal ends at the hostile record).
  std::vector<std::vector<std::byte>> hostile;
  hostile.push_back(payload(9, 1));  // unknown type
  hostile.push_back({});             // empty payload
  {
    auto p = payload(static_cast<uint8_t>(UploadRecordType::kQueued), 2);
    PutLittleEndian(p, 1, 8);
    PutLittleEndian(p, 1, 8);
    PutLittleEndian(p, 1, 8);
    PutLittleEndian(p, 0xffffffff, 4);  // a path length past the payload
    hostile.push_back(p);
  }
  {
    auto p = payload(static_cast<uint8_t>(UploadRecordType::kQueued), 2);
    PutLittleEndian(p, 1, 8);  // truncated before its path
    hostile.push_back(p);
  }
  {
    auto p = payload(static_cast<uint8_t>(UploadRecordType::kBegun), 2);
    const std::string id = "bad id\r\nHost: evil";  // not printable ASCII: never put in a URL
    PutLittleEndian(p, id.size(), 4);
    for (char c : id) p.push_back(static_cast<std::byte>(c));
    hostile.push_back(p);
  }
  {
    auto p = payload(static_cast<uint8_t>(UploadRecordType::kBegun), 2);
    PutLittleEndian(p, kMaxUploadIdBytes + 1, 4);
    p.resize(p.size() + kMaxUploadIdBytes + 1, std::byte{'a'});
    hostile.push_back(p);
  }
  {
    auto p = payload(static_cast<uint8_t>(UploadRecordType::kDone), 2);
    p.push_back(std::byte{0});  // trailing bytes
    hostile.push_back(p);
  }
  for (size_t i = 0; i < hostile.size(); ++i) {
    std::vector<std::byte> j = Magic();
    Add(j, Queued(1, "a"));
    AddRaw(j, hostile[i]);
    Add(j, Queued(3, "c"));
    auto parsed = ParseUploadJournal(j);
    ASSERT_TRUE(parsed.ok()) << i;
    EXPECT_EQ(parsed->records.size(), 1u) << i;
    EXPECT_NE(parsed->stopped.find("damaged record"), std::string::npos) << i;
  }
}

TEST(UploadJournal, PlanDropsUnsafePathsAndInconsistentItems) {
  std::vector<std::byte> j = Magic();
  for (const char* bad : {"/etc/passwd", "../out", "a/../../b", ".ucpfs/upload/journal", "a//b", "", "./a"}) {
    Add(j, Queued(10 + j.size(), bad));
  }
  Add(j, Of(UploadRecordType::kDelete, 7, "../../x"));
  Add(j, Queued(1, "ok"));
  Add(j, Queued(1, "again"));  // the same id twice: the second is ignored
  Add(j, Of(UploadRecordType::kDone, 99));   // never queued
  Add(j, Of(UploadRecordType::kBegun, 98, "x"));  // never queued
  auto parsed = ParseUploadJournal(j);
  ASSERT_TRUE(parsed.ok());
  ASSERT_EQ(parsed->stopped, "");
  const UploadPlan plan = PlanUploads(*parsed);
  ASSERT_EQ(plan.pending.size(), 1u);
  EXPECT_EQ(plan.pending[0].path, "ok");
  EXPECT_EQ(plan.dropped.size(), 7u + 1u + 1u + 2u);
  EXPECT_GE(plan.max_id, 99u);
}

UploadRecord Streaming(uint64_t id, const std::string& path, const std::string& upload_id) {
  UploadRecord r;
  r.type = UploadRecordType::kStreaming;
  r.id = id;
  r.path = path;
  r.upload_id = upload_id;
  return r;
}

TEST(UploadJournal, StreamedUploadsOpenAreAbortedDoneOnesAreNot) {
  std::vector<std::byte> j = Magic();
  Add(j, Streaming(1, "step1/__0_0.distcp", "2~open"));
  Add(j, Streaming(2, "step1/__1_0.distcp", "2~taken"));
  Add(j, Queued(3, "step1/__1_0.distcp", 20 << 20));
  Add(j, Of(UploadRecordType::kBegun, 3, "2~taken"));
  Add(j, Of(UploadRecordType::kDone, 2));  // taken over by item 3
  Add(j, Streaming(4, "../outside", "2~hostile"));
  Add(j, Streaming(3, "step1/x", "2~id-of-an-item"));
  Result<ParsedUploadJournal> parsed = ParseUploadJournal(j);
  ASSERT_TRUE(parsed.ok()) << parsed.error().ToString();
  ASSERT_EQ(parsed->records.size(), 7u);
  EXPECT_EQ(parsed->records[0].path, "step1/__0_0.distcp");
  EXPECT_EQ(parsed->records[0].upload_id, "2~open");
  const UploadPlan plan = PlanUploads(*parsed);
  ASSERT_EQ(plan.streaming.size(), 1u);
  EXPECT_EQ(plan.streaming[0].id, 1u);
  EXPECT_EQ(plan.streaming[0].path, "step1/__0_0.distcp");
  EXPECT_EQ(plan.streaming[0].upload_id, "2~open");
  ASSERT_EQ(plan.pending.size(), 1u);  // item 3, its begun upload aborted before it is done again
  EXPECT_EQ(plan.pending[0].begun_upload_ids, std::vector<std::string>{"2~taken"});
  EXPECT_EQ(plan.dropped.size(), 2u);  // the path outside, the id taken
  EXPECT_EQ(plan.max_id, 4u);
}

TEST(UploadJournal, HostileStreamingRecordsAreNotDecoded) {
  for (const std::string& bad_id : {std::string(), std::string("a b"), std::string(kMaxUploadIdBytes + 1, 'x')}) {
    std::vector<std::byte> j = Magic();
    Add(j, Streaming(1, "a", bad_id));
    Result<ParsedUploadJournal> parsed = ParseUploadJournal(j);
    ASSERT_TRUE(parsed.ok());
    EXPECT_TRUE(parsed->records.empty()) << "upload id of " << bad_id.size() << " bytes";
  }
  // A path length past the payload.
  std::vector<std::byte> payload{std::byte{5}};
  for (int i = 0; i < 8; ++i) payload.push_back(std::byte{0});
  for (std::byte b : {std::byte{0xff}, std::byte{0xff}, std::byte{0}, std::byte{0}}) payload.push_back(b);
  payload.push_back(std::byte{'a'});
  std::vector<std::byte> j = Magic();
  AddRaw(j, payload);
  Result<ParsedUploadJournal> parsed = ParseUploadJournal(j);
  ASSERT_TRUE(parsed.ok());
  EXPECT_TRUE(parsed->records.empty());
  EXPECT_FALSE(parsed->stopped.empty());
}

}  // namespace
}  // namespace ucpfs::io
