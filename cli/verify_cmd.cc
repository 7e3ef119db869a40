// See verify_cmd.h. Order: the stored index against the files on disk, a fresh scan (coverage,
// replicas), the coverage of the checkpoint the views are built from, the CRC-32 of the torch.save
// source records the views read, then every view file read whole and parsed.
#include "cli/verify_cmd.h"

#include <CLI/CLI.hpp>
#include <sys/stat.h>

#include <algorithm>
#include <climits>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/progress.h"
#include "core/format/safetensors.h"
#include "core/format/torch_file.h"
#include "core/format/zip_reader.h"
#include "core/io/s3_tree.h"
#include "core/json_text.h"
#include "core/slice/slice.h"
#include "index/bucket_index.h"
#include "index/catalog.h"
#include "index/checkpoint_builder.h"
#include "index/key_map.h"
#include "index/scanner.h"
#include "index/snapshot.h"
#include "views/view_files.h"

namespace ucpfs::cli {
namespace {

constexpr size_t kReadChunkBytes = 8u << 20;

struct Report {
  std::string src;  // absolute, no trailing '/'
  nlohmann::ordered_json problems = nlohmann::ordered_json::array();
  nlohmann::ordered_json unchecked = nlohmann::ordered_json::array();  // source files without checksums
  uint64_t source_files = 0, source_tensors = 0, fragments = 0, crc_records = 0, crc_bytes = 0;
  uint64_t tp_replicas = 0;  // tp-replicated copies compared with the copy that is read
  uint64_t views = 0, view_bytes = 0, view_tensors = 0;
  std::string index = "current";

  // `file` relative to SRC where it lies inside it.
  void Add(std::string file, const std::string& what) {
    if (file.size() > src.size() && file.compare(0, src.size() + 1, src + "/") == 0) file.erase(0, src.size() + 1);
    problems.push_back({{"file", file}, {"what", what}});
  }
  // A Status whose message starts with a path (the builders' and readers' errors do).
  void Add(const Status& s, const std::string& fallback_file) {
    const std::string& m = s.message();
    const size_t colon = m.find(": ");
    if (!m.empty() && m[0] == '/' && colon != std::string::npos) {
      Add(m.substr(0, colon), m.substr(colon + 2));
    } else {
      Add(fallback_file, m);
    }
  }
};

// The stored index, if any, against the files on disk. Returns the stored checkpoint.
std::optional<index::Checkpoint> CheckIndex(const std::string& index_dir, const SourceTree& source, Report& r) {
  uint64_t stored_fp = 0;
  auto loaded = index::LoadCheckpoint(index_dir, /*read_only=*/true, &stored_fp);
  if (!loaded.ok()) {
    if (loaded.error().code() == StatusCode::kNotFound) {
      r.index = "none (built on the first mount or `ucpfs index`)";
    } else {
      r.index = "unreadable";
      r.Add(index_dir, "the index cannot be read: " + loaded.error().message());
    }
    return std::nullopt;
  }
  const size_t before = r.problems.size();
  for (const auto& f : loaded->files) {
    Result<TreeEntry> st = index::SafeRelativePath(f.rel_path) ? source.Stat(f.rel_path) : Result<TreeEntry>(NotFoundError(f.rel_path));
    if (!st.ok()) {
      r.Add(f.rel_path, "named by the index but missing");
      continue;
    }
    if (st->kind != EntryKind::kFile) {
      r.Add(f.rel_path, "named by the index but not a regular file");
      continue;
    }
    // The comparison the mount makes before serving a byte (dev not compared: a shared index).
    const std::string changed = f.Identity().Differences(st->identity);
    if (!changed.empty()) r.Add(f.rel_path, "changed since it was indexed: " + changed + " (the index is stale)");
  }
  if (r.problems.size() == before) {
    auto fp = index::FingerprintSource(source);
    if (fp.ok() && *fp != stored_fp) {
      r.Add(r.src, "changed since it was indexed (a file added or removed, or a metadata file rewritten): "
                   "the index is stale");
    }
  }
  if (r.problems.size() != before) r.index = "stale";
  return std::move(loaded).value();
}

// Every tensor's fragments cover its shape exactly once.
void CheckCoverage(const index::Checkpoint& c, Report& r) {
  for (const auto& it : c.items) {
    if (it.kind != index::ItemKind::kTensor) continue;
    ++r.source_tensors;
    r.fragments += it.layout.fragments.size();
    Status s = slice::ValidateCoverage(it.layout, it.key);
    if (!s.ok()) {
      const auto& frags = it.layout.fragments;
      const bool in_file = !frags.empty() && frags[0].file_id < c.files.size();
      r.Add(in_file ? c.files[frags[0].file_id].rel_path : r.src, "tensor '" + it.key + "': " + s.message());
    }
  }
}

// The zip records of torch.save source files that hold bytes the checkpoint's items point at.
struct CrcWork {
  std::shared_ptr<const ByteSource> source;
  std::vector<format::ZipEntry> entries;
};

std::vector<CrcWork> PlanCrcs(const index::Checkpoint& c, const index::FileTable& files, Report& r,
                              uint64_t* n_bytes) {
  std::vector<std::vector<uint64_t>> offsets(c.files.size());
  for (const auto& it : c.items) {
    if (it.kind == index::ItemKind::kBytes) {
      if (it.file_id < offsets.size()) offsets[it.file_id].push_back(it.byte_offset);
      continue;
    }
    for (const auto& f : it.layout.fragments) {
      if (f.file_id < offsets.size()) offsets[f.file_id].push_back(f.byte_offset);
      for (const auto& m : f.mean_with) {  // an averaged tensor's other copies
        if (m.file_id < offsets.size()) offsets[m.file_id].push_back(m.byte_offset);
      }
    }
  }
  std::vector<CrcWork> out;
  for (size_t id = 0; id < c.files.size(); ++id) {
    if (offsets[id].empty()) continue;
    ++r.source_files;
    const std::string& rel = c.files[id].rel_path;
    auto ends_with = [&](std::string_view tail) {
      return rel.size() >= tail.size() && rel.compare(rel.size() - tail.size(), tail.size(), tail) == 0;
    };
    if (ends_with(".distcp")) {
      r.unchecked.push_back({{"file", rel}, {"why", "a DCP data file carries no checksums"}});
      continue;
    }
    if (ends_with(".safetensors")) {
      r.unchecked.push_back({{"file", rel}, {"why", "safetensors carries no checksums"}});
      continue;
    }
    const auto& source = (*files)[id];
    auto zip = format::ZipArchive::Open(*source);
    if (!zip.ok() && format::IsLegacyTorchFile(*source)) {
      r.unchecked.push_back({{"file", rel}, {"why", "torch's legacy format carries no checksums"}});
      continue;
    }
    if (!zip.ok()) {
      r.Add(zip.error(), rel);
      continue;
    }
    auto& used = offsets[id];
    std::sort(used.begin(), used.end());
    CrcWork w{source, {}};
    for (const auto& e : zip->entries()) {
      auto at = std::lower_bound(used.begin(), used.end(), e.data_offset);
      if (at == used.end() || *at >= e.data_offset + std::max<uint64_t>(e.n_bytes, 1)) continue;
      w.entries.push_back(e);
      *n_bytes += e.n_bytes;
    }
    out.push_back(std::move(w));
  }
  return out;
}

void CheckCrcs(const std::vector<CrcWork>& work, Report& r, const std::function<void(uint64_t)>& on_bytes) {
  for (const auto& w : work) {
    for (const auto& e : w.entries) {
      auto checked = format::CheckEntryCrc32(*w.source, e, on_bytes);
      if (!checked.ok()) {
        r.Add(checked.error(), w.source->Name());
      } else if (*checked) {
        ++r.crc_records;
        r.crc_bytes += e.n_bytes;
      }
    }
  }
}

// Reads the view whole (exactly its declared size), then parses it by its kind.
void CheckView(const views::ViewFile& file, std::vector<std::byte>& buf, Report& r,
               const std::function<void(uint64_t)>& on_bytes) {
  auto opened = file.open();
  if (!opened.ok()) {
    r.Add(file.path, "cannot be built: " + opened.error().ToString());
    return;
  }
  const std::shared_ptr<const ByteSource>& source = *opened;
  const uint64_t size = source->Size();
  if (size != file.n_bytes) {
    r.Add(file.path, "built with " + std::to_string(size) + " bytes, listed with " + std::to_string(file.n_bytes));
    return;
  }
  for (uint64_t off = 0; off < size;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), size - off));
    Status s = source->ReadAt(off, std::span(buf.data(), n));
    if (!s.ok()) {
      r.Add(file.path, "read of " + std::to_string(n) + " bytes at byte " + std::to_string(off) + " of its " +
                        std::to_string(size) + " failed: " + s.ToString());
      return;
    }
    off += n;
    r.view_bytes += n;
    on_bytes(n);
  }
  ++r.views;
  auto ends_with = [&](std::string_view tail) {
    return file.path.size() >= tail.size() && file.path.compare(file.path.size() - tail.size(), tail.size(), tail) == 0;
  };
  if (ends_with(".pt")) {
    // TorchFile::Open checks every tensor's storage record against its numel and dtype.
    auto tf = format::TorchFile::Open(source);
    if (!tf.ok()) {
      r.Add(file.path, "does not parse as a torch.save file: " + tf.error().message());
      return;
    }
    r.view_tensors += tf->tensors().size();
    for (const auto& e : tf->archive().entries()) {
      auto checked = format::CheckEntryCrc32(*source, e);
      if (!checked.ok()) r.Add(file.path, checked.error().message());
    }
  } else if (ends_with(".safetensors")) {
    auto h = format::ReadSafetensors(*source);
    if (!h.ok()) r.Add(file.path, "does not parse as safetensors: " + h.error().message());
  } else if (ends_with(".json")) {
    std::string text(size, '\0');
    Status s = source->ReadAt(0, std::as_writable_bytes(std::span(text.data(), text.size())));
    if (!s.ok() || nlohmann::json::parse(text, nullptr, false).is_discarded()) r.Add(file.path, "is not valid JSON");
  }
}

void Print(const Report& r, bool json) {
  const bool ok = r.problems.empty();
  if (json) {
    nlohmann::ordered_json out;
    out["ok"] = ok;
    out["source"] = r.src;
    out["index"] = r.index;
    out["checked"] = {{"views", r.views},
                      {"view_bytes", r.view_bytes},
                      {"view_tensors", r.view_tensors},
                      {"source_files", r.source_files},
                      {"source_tensors", r.source_tensors},
                      {"fragments", r.fragments},
                      {"tp_replicas", r.tp_replicas},
                      {"crc_records", r.crc_records},
                      {"crc_bytes", r.crc_bytes},
                      {"bytes", r.view_bytes + r.crc_bytes}};
    out["unchecked"] = r.unchecked;
    out["problems"] = r.problems;
    std::cout << JsonText(out) << '\n';
    return;
  }
  for (const auto& p : r.problems) {
    std::cout << "ucpfs verify: " << p["file"].get<std::string>() << ": " << p["what"].get<std::string>() << '\n';
  }
  std::cout << "ucpfs verify: " << r.src << ": " << (ok ? "ok" : std::to_string(r.problems.size()) + " problems")
            << ": " << r.views << " views (" << r.view_bytes << " bytes, " << r.view_tensors << " tensor records), "
            << r.source_tensors << " source tensors in " << r.fragments << " fragments, " << r.tp_replicas
            << " tp-replicated copies compared, " << r.crc_records
            << " source records CRC-checked (" << r.crc_bytes << " bytes); index " << r.index << '\n';
  if (!r.unchecked.empty()) {
    std::cout << "ucpfs verify: no checksums to check in " << r.unchecked.size() << " source files ("
              << r.unchecked[0]["why"].get<std::string>() << ")\n";
  }
}

}  // namespace

CLI::App* AddVerifyCommand(CLI::App& app, VerifyArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "verify", "Read every view of checkpoint SRC once and check it against the index and the source "
                "(exit 1 naming each problem)");
  cmd->add_option("SRC", args.source.src, "checkpoint directory")->required();
  cmd->add_option("--layout", args.views.layouts,
                  "also read target/<LAYOUT>/rank_N/ for this layout, e.g. tp2_pp1_dp1 (repeatable)");
  args.views.atomic = true;  // atomic/ is read unless --no-atomic
  cmd->add_flag_callback("--no-atomic", [&args] { args.views.atomic = false; },
                         "do not read atomic/<param>/<state>.pt (read by default)");
  cmd->add_flag("--safetensors", args.views.safetensors, "also read safetensors/ (the weights as safetensors)");
  cmd->add_option("--view", args.views.views,
                  "also read the view NAME as a mount serves it: atomic, safetensors, hf, universal or target "
                  "(with --layout) (repeatable)");
  AddPatternOptions(cmd, args.views.preset, args.views.pattern_rules, args.views.pp_split,
                    args.views.vocab_pad_multiple);
  AddHfOptions(cmd, args.views.hf_dtype, args.views.hf_config);
  cmd->add_flag("--json", args.json,
                "print {\"ok\", \"checked\": {counts, bytes}, \"unchecked\", \"problems\": [{\"file\", \"what\"}]}");
  return cmd;
}

int RunVerify(const VerifyArgs& args) {
  auto selection = ParseViewArgs(args.views);
  if (!selection.ok()) {
    std::cerr << "ucpfs verify: " << selection.error().ToString() << '\n';
    return 2;
  }
  Report r;
  index::SnapshotOptions so;
  auto tree = SourceTreeOf(args.source, &r.src);
  if (!tree.ok()) {
    std::cerr << "ucpfs verify: " << tree.error().ToString() << '\n';
    return 2;
  }
  if (!(*tree)->IsDirectory("")) {
    std::cerr << "ucpfs verify: " << args.source.src << ": not a checkpoint directory\n";
    return 1;
  }
  so.source_dir = r.src;
  so.tree = *tree;
  if (!args.source.rules.empty()) {
    auto rules = index::LoadRules(args.source.rules);
    if (!rules.ok()) {
      std::cerr << "ucpfs verify: " << rules.error().ToString() << '\n';
      return 2;
    }
    so.key_rules = std::move(*rules);
  }
  // The stored index, where it is: never created, built or rebuilt here.
  std::string index_dir = args.source.index_dir;
  std::optional<index::Checkpoint> stored;
  bool checked = false;
  if (index_dir.empty() && IsS3Source(r.src)) {
    // The bucket's index (PREFIX/.ucpfs/), as a mount uses it: fetched into the local cache and
    // checked against the source; none there: the local one, if any.
    auto s3 = std::static_pointer_cast<const S3Tree>(so.tree);
    index::BucketIndexOptions bo;
    bo.cache_dir = S3IndexDir(s3->client()->options().endpoint_url, r.src);
    bo.read_only = true;
    index::BucketIndexReport br;
    Result<index::OpenedIndex> found = index::OpenOrBuildBucketIndex(s3, bo, &br);
    index_dir = bo.cache_dir;
    if (found.ok()) {
      // Opened read-only and checked against the source as it is now (schema, fingerprint, every
      // record): current, without loading and checking it a second time.
      index_dir = found->index_dir;
      stored = std::move(found->checkpoint);
      r.index = "current";
      checked = true;
    } else if (found.error().code() != StatusCode::kNotFound) {
      r.index = "stale or unusable in the bucket";
      r.Add(br.manifest_url, found.error().message());
      checked = true;
    }
  } else if (index_dir.empty()) {
    struct stat ist;
    index_dir = ::stat((r.src + "/.ucpfs").c_str(), &ist) == 0 ? r.src + "/.ucpfs" : index::CacheIndexDir(r.src);
  }
  if (!checked) stored = CheckIndex(index_dir, *so.tree, r);

  // A fresh scan: the builders validate coverage and compare replicas as they go.
  index::OpenedIndex opened;
  opened.index_dir = index_dir;
  auto scanned = index::ScanCheckpoint(
      *so.tree, ScanProgressOf(std::make_shared<Progress>(
                 StderrProgressOptions("ucpfs verify: scanning", ProgressUnit::kItems, args.source.quiet))));
  if (scanned.ok()) {
    opened.checkpoint = std::move(scanned).value();
  } else {
    r.Add(scanned.error(), r.src);
    if (!stored) {
      Print(r, args.json);
      return 1;
    }
    opened.checkpoint = std::move(*stored);  // the views as the stored index would serve them
  }
  CheckCoverage(opened.checkpoint, r);
  auto snapshot = index::SnapshotOf(std::move(opened), so, 1);
  if (!snapshot.ok()) {
    r.Add(snapshot.error(), r.src);
    Print(r, args.json);
    return 1;
  }
  auto views = views::ListViewFiles(*snapshot, selection->options, selection->kinds);
  if (!views.ok()) r.Add(views.error(), r.src);
  uint64_t total = 0, done = 0;
  std::vector<CrcWork> crcs = PlanCrcs((*snapshot)->checkpoint(), (*snapshot)->files, r, &total);
  if (views.ok()) {
    for (const auto& v : *views) total += v.n_bytes;
  }
  Progress progress(StderrProgressOptions("ucpfs verify:", ProgressUnit::kBytes, args.source.quiet));
  auto on_bytes = [&](uint64_t n) { progress.Update(done += n, total); };
  CheckCrcs(crcs, r, on_bytes);
  // DeepSpeed and Megatron-LM: every tp rank's copy of a replicated tensor against the one read
  // (the fresh scan lists them; a checkpoint from the stored index has none).
  for (const Status& s : index::CheckTpReplicas((*snapshot)->checkpoint(), *(*snapshot)->files, &r.tp_replicas)) {
    r.Add(s, r.src);
  }
  if (views.ok()) {
    std::vector<std::byte> buf(kReadChunkBytes);
    for (const auto& v : *views) CheckView(v, buf, r, on_bytes);
  }
  progress.Finish(done, total);
  Print(r, args.json);
  return r.problems.empty() ? 0 : 1;
}

}  // namespace ucpfs::cli
