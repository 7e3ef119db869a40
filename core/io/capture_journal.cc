// See capture_journal.h.
#include "core/io/capture_journal.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <set>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace ucpfs::io {
namespace {

constexpr auto Put = PutLittleEndian;
constexpr auto Get = GetLittleEndian;

// Decodes one payload; false when it is malformed.
bool DecodePayload(std::span<const std::byte> p, JournalRecord* r) {
  if (p.empty()) return false;
  const auto type = static_cast<uint8_t>(p[0]);
  const size_t n = p.size();
  switch (type) {
    case static_cast<uint8_t>(JournalType::kChunk):
      if (n != 1 + 32) return false;
      r->type = JournalType::kChunk;
      r->seq = Get(p, 1, 8);
      r->byte_offset = Get(p, 9, 8);
      r->n_bytes = Get(p, 17, 8);
      r->hash = Get(p, 25, 8);
      return r->n_bytes > 0 && r->byte_offset + r->n_bytes >= r->byte_offset;
    case static_cast<uint8_t>(JournalType::kCommit): {
      if (n < 1 + 24) return false;
      r->type = JournalType::kCommit;
      r->seq = Get(p, 1, 8);
      r->size = Get(p, 9, 8);
      r->mode = static_cast<uint32_t>(Get(p, 17, 4));
      const uint64_t path_len = Get(p, 21, 4);
      constexpr uint64_t kAttrsBytes = 1 + 4 + 4 + 8 + 8;
      if (path_len > kMaxJournalPathBytes || (n != 25 + path_len && n != 25 + path_len + kAttrsBytes)) return false;
      r->path.assign(reinterpret_cast<const char*>(p.data() + 25), static_cast<size_t>(path_len));
      if (n == 25 + path_len) return true;  // written before owners and times were recorded
      const size_t at = static_cast<size_t>(25 + path_len);
      r->attrs.known = Get(p, at, 1) == 1;
      r->attrs.uid = static_cast<uint32_t>(Get(p, at + 1, 4));
      r->attrs.gid = static_cast<uint32_t>(Get(p, at + 5, 4));
      r->attrs.atime_ns = static_cast<int64_t>(Get(p, at + 9, 8));
      r->attrs.mtime_ns = static_cast<int64_t>(Get(p, at + 17, 8));
      return true;
    }
    case static_cast<uint8_t>(JournalType::kDone):
    case static_cast<uint8_t>(JournalType::kDiscard):
      if (n != 1 + 8) return false;
      r->type = static_cast<JournalType>(type);
      r->seq = Get(p, 1, 8);
      return true;
    default:
      return false;
  }
}

}  // namespace

std::vector<std::byte> EncodeJournalRecord(const JournalRecord& r) {
  std::vector<std::byte> payload;
  payload.push_back(static_cast<std::byte>(r.type));
  Put(payload, r.seq, 8);
  switch (r.type) {
    case JournalType::kChunk:
      Put(payload, r.byte_offset, 8);
      Put(payload, r.n_bytes, 8);
      Put(payload, r.hash, 8);
      break;
    case JournalType::kCommit:
      Put(payload, r.size, 8);
      Put(payload, r.mode, 4);
      Put(payload, r.path.size(), 4);
      for (char c : r.path) payload.push_back(static_cast<std::byte>(c));
      Put(payload, r.attrs.known ? 1 : 0, 1);
      Put(payload, r.attrs.uid, 4);
      Put(payload, r.attrs.gid, 4);
      Put(payload, static_cast<uint64_t>(r.attrs.atime_ns), 8);
      Put(payload, static_cast<uint64_t>(r.attrs.mtime_ns), 8);
      break;
    case JournalType::kDone:
    case JournalType::kDiscard:
      break;
  }
  return FrameJournalPayload(payload);
}

Result<ParsedJournal> ParseJournal(std::span<const std::byte> bytes) {
  ParsedJournal out;
  UCPFS_ASSIGN_OR_RETURN(out.n_bytes_used,
                         SplitJournal(bytes, kJournalMagic, kMaxJournalBytes, &out.stopped,
                                      [&](std::span<const std::byte> payload) {
                                        JournalRecord r;
                                        if (!DecodePayload(payload, &r)) return false;
                                        out.records.push_back(std::move(r));
                                        return true;
                                      }));
  return out;
}

void PutLittleEndian(std::vector<std::byte>& out, uint64_t v, int n_bytes) {
  for (int i = 0; i < n_bytes; ++i) out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
}

uint64_t GetLittleEndian(std::span<const std::byte> in, size_t at, int n_bytes) {
  uint64_t v = 0;
  for (int i = 0; i < n_bytes; ++i) v |= static_cast<uint64_t>(in[at + static_cast<size_t>(i)]) << (8 * i);
  return v;
}

std::vector<std::byte> FrameJournalPayload(std::span<const std::byte> payload) {
  std::vector<std::byte> out;
  out.reserve(12 + payload.size());
  PutLittleEndian(out, payload.size(), 4);
  PutLittleEndian(out, XXH64(payload.data(), payload.size(), 0), 8);
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

Result<size_t> SplitJournal(std::span<const std::byte> bytes, const char (&magic)[8], size_t max_bytes,
                            std::string* stopped, const std::function<bool(std::span<const std::byte>)>& decode) {
  const std::string shown(magic, sizeof(magic));
  if (bytes.size() > max_bytes) {
    return CorruptError("journal of " + std::to_string(bytes.size()) + " bytes is larger than the limit of " +
                        std::to_string(max_bytes));
  }
  if (bytes.size() < sizeof(magic) || std::memcmp(bytes.data(), magic, sizeof(magic)) != 0) {
    return CorruptError("journal does not start with the magic " + shown);
  }
  size_t at = sizeof(magic);
  while (at < bytes.size()) {
    if (bytes.size() - at < 12) {
      *stopped = "torn record header at byte " + std::to_string(at);
      break;
    }
    const uint64_t len = GetLittleEndian(bytes, at, 4);
    const uint64_t hash = GetLittleEndian(bytes, at + 4, 8);
    if (len > bytes.size() - at - 12) {
      *stopped = "torn record at byte " + std::to_string(at);
      break;
    }
    const std::span<const std::byte> payload = bytes.subspan(at + 12, static_cast<size_t>(len));
    if (XXH64(payload.data(), payload.size(), 0) != hash || !decode(payload)) {
      *stopped = "damaged record at byte " + std::to_string(at);
      break;
    }
    at += 12 + static_cast<size_t>(len);
  }
  return at;
}

Status CheckPlacePath(const std::string& rel) {
  auto bad = [&](const std::string& why) { return InvalidArgumentError("path '" + rel + "' " + why); };
  if (rel.empty()) return bad("is empty");
  if (rel.size() > kMaxJournalPathBytes) return bad("is too long");
  if (rel.find('\0') != std::string::npos) return bad("holds a NUL byte");
  if (rel[0] == '/') return bad("is absolute");
  size_t start = 0;
  bool first = true;
  while (start <= rel.size()) {
    size_t end = rel.find('/', start);
    if (end == std::string::npos) end = rel.size();
    const std::string part = rel.substr(start, end - start);
    if (part.empty() || part == "." || part == "..") return bad("has an empty, '.' or '..' component");
    if (part.size() > 255) return bad("has a component longer than 255 bytes");
    if (first && part == ".ucpfs") return bad("is inside .ucpfs");
    first = false;
    start = end + 1;
  }
  return Status::Ok();
}

std::vector<RecoveryStep> PlanRecovery(const ParsedJournal& journal, const std::vector<uint64_t>& part_seqs) {
  std::set<uint64_t> ended;                       // done or discarded
  std::map<uint64_t, size_t> last_commit;          // seq -> index of its last kCommit record
  std::map<uint64_t, std::map<uint64_t, const JournalRecord*>> chunks;  // seq -> offset -> latest
  for (size_t i = 0; i < journal.records.size(); ++i) {
    const JournalRecord& r = journal.records[i];
    switch (r.type) {
      case JournalType::kChunk: chunks[r.seq][r.byte_offset] = &r; break;
      case JournalType::kCommit: last_commit[r.seq] = i; break;
      case JournalType::kDone:
      case JournalType::kDiscard: ended.insert(r.seq); break;
    }
  }
  const std::set<uint64_t> present(part_seqs.begin(), part_seqs.end());
  std::vector<RecoveryStep> plan;
  // Committed files with a part, in commit order.
  std::vector<std::pair<size_t, uint64_t>> order;
  for (const auto& [seq, index] : last_commit) {
    if (present.contains(seq) && !ended.contains(seq)) order.emplace_back(index, seq);
  }
  std::sort(order.begin(), order.end());
  bool stop = false;
  std::string stop_reason;
  for (const auto& [index, seq] : order) {
    const JournalRecord& c = journal.records[index];
    RecoveryStep step;
    step.seq = seq;
    step.path = c.path;
    step.size = c.size;
    step.mode = c.mode;
    step.attrs = c.attrs;
    if (Status s = CheckPlacePath(c.path); !s.ok()) {
      step.reason = s.message();
    } else {
      // The latest chunk per offset must tile [0, size).
      uint64_t covered = 0;
      const auto it = chunks.find(seq);
      if (it != chunks.end()) {
        for (const auto& [offset, rec] : it->second) {
          if (covered >= c.size) break;
          if (offset > covered) break;  // a gap
          if (offset < covered) continue;  // superseded by a longer earlier chunk: not expected
          step.chunks.push_back(*rec);
          covered = offset + rec->n_bytes;
        }
      }
      if (covered >= c.size) {
        step.finish = !stop;
        step.recover = stop;
        if (stop) step.reason = stop_reason;
      } else {
        step.chunks.clear();
        step.reason = "incomplete: " + std::to_string(covered) + " of " + std::to_string(c.size) +
                      " bytes were flushed";
      }
    }
    if (!step.finish && !step.recover && !stop) {
      stop = true;
      stop_reason = "committed after '" + c.path + "', which could not be finished";
    }
    plan.push_back(std::move(step));
  }
  for (uint64_t seq : part_seqs) {
    if (std::any_of(plan.begin(), plan.end(), [&](const RecoveryStep& s) { return s.seq == seq; })) continue;
    RecoveryStep step;
    step.seq = seq;
    step.reason = ended.contains(seq) ? "already placed or unlinked" : "never closed";
    if (const auto it = last_commit.find(seq); it != last_commit.end()) step.path = journal.records[it->second].path;
    plan.push_back(std::move(step));
  }
  return plan;
}

void MarkIncomplete(std::vector<RecoveryStep>& plan, size_t index, const std::string& reason) {
  if (index >= plan.size()) return;
  const std::string first = plan[index].path;
  plan[index].finish = false;
  plan[index].reason = reason;
  for (size_t i = index + 1; i < plan.size(); ++i) {
    if (plan[i].finish) {
      plan[i].finish = false;
      plan[i].recover = true;
      plan[i].reason = "committed after '" + first + "', which could not be finished";
    }
  }
}

}  // namespace ucpfs::io
