// See upload_journal.h.
#include "core/io/upload_journal.h"

#include <map>

#include "core/io/capture_journal.h"

namespace ucpfs::io {
namespace {

bool GetString(std::span<const std::byte> p, size_t at, size_t max_bytes, std::string* out) {
  if (p.size() < at + 4) return false;
  const uint64_t len = GetLittleEndian(p, at, 4);
  if (len > max_bytes || p.size() != at + 4 + len) return false;
  out->assign(reinterpret_cast<const char*>(p.data() + at + 4), static_cast<size_t>(len));
  return true;
}

// An upload id goes into a URL query: printable ASCII only, never empty.
bool UploadIdOk(const std::string& id) {
  if (id.empty()) return false;
  for (char c : id) {
    if (c < 0x21 || c > 0x7e) return false;
  }
  return true;
}

bool Decode(std::span<const std::byte> p, UploadRecord* r) {
  if (p.size() < 9) return false;
  r->id = GetLittleEndian(p, 1, 8);
  switch (static_cast<uint8_t>(p[0])) {
    case static_cast<uint8_t>(UploadRecordType::kQueued):
      if (p.size() < 9 + 24) return false;
      r->type = UploadRecordType::kQueued;
      r->size = GetLittleEndian(p, 9, 8);
      r->ino = GetLittleEndian(p, 17, 8);
      r->mtime_ns = static_cast<int64_t>(GetLittleEndian(p, 25, 8));
      return GetString(p, 33, kMaxJournalPathBytes, &r->path);
    case static_cast<uint8_t>(UploadRecordType::kDelete):
      r->type = UploadRecordType::kDelete;
      return GetString(p, 9, kMaxJournalPathBytes, &r->path);
    case static_cast<uint8_t>(UploadRecordType::kBegun):
      r->type = UploadRecordType::kBegun;
      return GetString(p, 9, kMaxUploadIdBytes, &r->upload_id) && UploadIdOk(r->upload_id);
    case static_cast<uint8_t>(UploadRecordType::kStreaming): {
      r->type = UploadRecordType::kStreaming;
      if (p.size() < 13) return false;
      const uint64_t path_len = GetLittleEndian(p, 9, 4);
      if (path_len > kMaxJournalPathBytes || p.size() < 13 + path_len) return false;
      r->path.assign(reinterpret_cast<const char*>(p.data() + 13), static_cast<size_t>(path_len));
      return GetString(p, 13 + static_cast<size_t>(path_len), kMaxUploadIdBytes, &r->upload_id) &&
             UploadIdOk(r->upload_id);
    }
    case static_cast<uint8_t>(UploadRecordType::kDone):
      r->type = UploadRecordType::kDone;
      return p.size() == 9;
    default:
      return false;
  }
}

void PutString(std::vector<std::byte>& out, const std::string& s) {
  PutLittleEndian(out, s.size(), 4);
  for (char c : s) out.push_back(static_cast<std::byte>(c));
}

}  // namespace

std::vector<std::byte> EncodeUploadRecord(const UploadRecord& r) {
  std::vector<std::byte> payload;
  payload.push_back(static_cast<std::byte>(r.type));
  PutLittleEndian(payload, r.id, 8);
  switch (r.type) {
    case UploadRecordType::kQueued:
      PutLittleEndian(payload, r.size, 8);
      PutLittleEndian(payload, r.ino, 8);
      PutLittleEndian(payload, static_cast<uint64_t>(r.mtime_ns), 8);
      PutString(payload, r.path);
      break;
    case UploadRecordType::kDelete: PutString(payload, r.path); break;
    case UploadRecordType::kBegun: PutString(payload, r.upload_id); break;
    case UploadRecordType::kStreaming:
      PutString(payload, r.path);
      PutString(payload, r.upload_id);
      break;
    case UploadRecordType::kDone: break;
  }
  return FrameJournalPayload(payload);
}

Result<ParsedUploadJournal> ParseUploadJournal(std::span<const std::byte> bytes) {
  ParsedUploadJournal out;
  UCPFS_ASSIGN_OR_RETURN(out.n_bytes_used,
                         SplitJournal(bytes, kUploadJournalMagic, kMaxUploadJournalBytes, &out.stopped,
                                      [&](std::span<const std::byte> payload) {
                                        UploadRecord r;
                                        if (!Decode(payload, &r)) return false;
                                        out.records.push_back(std::move(r));
                                        return true;
                                      }));
  return out;
}

UploadPlan PlanUploads(const ParsedUploadJournal& journal) {
  UploadPlan plan;
  std::map<uint64_t, size_t> index;  // id -> position in plan.pending (or npos: dropped / done)
  constexpr size_t kGone = static_cast<size_t>(-1);
  std::vector<bool> done;
  std::map<uint64_t, size_t> streaming;  // id -> position in plan.streaming
  std::vector<bool> streaming_done;
  for (const UploadRecord& r : journal.records) {
    plan.max_id = std::max(plan.max_id, r.id);
    const auto it = index.find(r.id);
    switch (r.type) {
      case UploadRecordType::kQueued:
      case UploadRecordType::kDelete: {
        if (it != index.end()) {
          plan.dropped.push_back("item " + std::to_string(r.id) + " queued twice (the second is ignored)");
          break;
        }
        if (Status s = CheckPlacePath(r.path); !s.ok()) {
          plan.dropped.push_back("item " + std::to_string(r.id) + ": " + s.message());
          index[r.id] = kGone;
          break;
        }
        PendingUpload p;
        p.id = r.id;
        p.is_delete = r.type == UploadRecordType::kDelete;
        p.path = r.path;
        p.size = r.size;
        p.ino = r.ino;
        p.mtime_ns = r.mtime_ns;
        index[r.id] = plan.pending.size();
        plan.pending.push_back(std::move(p));
        done.push_back(false);
        break;
      }
      case UploadRecordType::kBegun:
        if (it == index.end()) {
          plan.dropped.push_back("multipart upload of item " + std::to_string(r.id) + ", never queued");
        } else if (it->second != kGone) {
          plan.pending[it->second].begun_upload_ids.push_back(r.upload_id);
        }
        break;
      case UploadRecordType::kStreaming:
        if (it != index.end() || streaming.contains(r.id)) {
          plan.dropped.push_back("streamed upload " + std::to_string(r.id) + ": the id is taken (ignored)");
        } else if (Status s = CheckPlacePath(r.path); !s.ok()) {
          plan.dropped.push_back("streamed upload " + std::to_string(r.id) + ": " + s.message());
        } else {
          streaming[r.id] = plan.streaming.size();
          plan.streaming.push_back({r.id, r.path, r.upload_id});
          streaming_done.push_back(false);
        }
        break;
      case UploadRecordType::kDone:
        if (const auto st = streaming.find(r.id); st != streaming.end()) {
          streaming_done[st->second] = true;
        } else if (it == index.end()) {
          plan.dropped.push_back("item " + std::to_string(r.id) + " done, never queued");
        } else if (it->second != kGone) {
          done[it->second] = true;
        }
        break;
    }
  }
  std::vector<PendingUpload> left;
  for (size_t i = 0; i < plan.pending.size(); ++i) {
    if (!done[i]) left.push_back(std::move(plan.pending[i]));
  }
  plan.pending = std::move(left);
  std::vector<UploadPlan::Streaming> open;
  for (size_t i = 0; i < plan.streaming.size(); ++i) {
    if (!streaming_done[i]) open.push_back(std::move(plan.streaming[i]));
  }
  plan.streaming = std::move(open);
  return plan;
}

}  // namespace ucpfs::io
