#include "cli/checkpoint_cmds.h"
#include "core/json_text.h"
#include "core/io/s3_tree.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "cli/progress.h"
#include "cli/text.h"
#include "cli/view_args.h"
#include "core/layout/layout.h"
#include "core/layout/patterns.h"
#include "views/atomic.h"
#include "fs/mounts.h"
#include "core/io/pinned_cache.h"
#include "mount/daemon.h"
#include "views/view_kind.h"
#include "views/safetensors_view.h"
#include "index/snapshot.h"
#include "index/bucket_index.h"
#include "index/catalog.h"
#include "index/hf_config.h"
#include "index/key_map.h"
#include "views/view_inputs.h"

namespace ucpfs::cli {

std::string AbsPathOrJoined(const std::string& p) {
  std::string out = AbsPath(p);
  if (out.empty() || out[0] != '/') {
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof(cwd)) != nullptr) out = std::string(cwd) + "/" + out;
  }
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}

bool IsS3Source(const std::string& src) { return src.starts_with("s3://"); }

std::string S3IndexDir(const std::string& endpoint_url, const std::string& url) {
  std::string base;
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg != nullptr && xdg[0] == '/') {
    base = std::string(xdg) + "/ucpfs";  // first, so tests and users can move it (root included)
  } else if (::geteuid() == 0) {
    base = "/var/cache/ucpfs";
  } else {
    const char* home = std::getenv("HOME");
    base = std::string(home != nullptr && home[0] == '/' ? home : "/tmp") + "/.cache/ucpfs";
  }
  std::string key = endpoint_url + " " + url;
  while (key.size() > 1 && key.back() == '/') key.pop_back();
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(XXH3_64bits(key.data(), key.size())));
  return base + "/s3-index/" + hex;
}

Result<std::shared_ptr<const SourceTree>> SourceTreeOf(const SourceArgs& args, std::string* source_dir) {
  if (IsS3Source(args.src)) {
    s3::Overrides overrides;
    overrides.endpoint_url = args.s3_endpoint;
    UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<const S3Tree> tree, S3Tree::FromEnvironment(args.src, overrides));
    *source_dir = tree->Root();
    return std::shared_ptr<const SourceTree>(std::move(tree));
  }
  if (!args.s3_endpoint.empty()) {
    return InvalidArgumentError("--s3-endpoint is for an s3:// source, not " + args.src);
  }
  *source_dir = AbsPath(args.src);
  return std::shared_ptr<const SourceTree>(LocalTree::Make(*source_dir));
}

namespace {

// The snapshot options of SRC (rules loaded). An s3:// source without --index-dir has its index
// resolved here (index/bucket_index.h: the bucket's, or a local one then written to the bucket):
// `opened` gets it when given, and its index_dir is the options'.
// `s3_writable_mount`: a mount that saves into the prefix: a prefix with no object under it yet is
// taken, and the index stays local (S3IndexDir): the mount indexes again as its saves land.
Result<index::SnapshotOptions> SnapshotOptionsOf(const SourceArgs& args, bool progress, bool s3_writable_mount = false,
                                                 std::optional<index::OpenedIndex>* opened = nullptr,
                                                 index::BucketIndexReport* report = nullptr) {
  index::SnapshotOptions o;
  UCPFS_ASSIGN_OR_RETURN(o.tree, SourceTreeOf(args, &o.source_dir));
  Result<TreeEntry> st = o.tree->Stat("");
  if (!st.ok() && s3_writable_mount && IsS3Source(args.src) && st.error().code() == StatusCode::kNotFound) {
    st = TreeEntry{};
    st->kind = EntryKind::kDirectory;
  }
  if (!st.ok()) {
    if (IsS3Source(args.src) && st.error().code() != StatusCode::kNotFound) return st.error();
    return NotFoundError(args.src + (IsS3Source(args.src) ? ": no object under this prefix" : ": no such directory"));
  }
  if (st->kind != EntryKind::kDirectory) {
    return InvalidArgumentError(args.src + ": not a directory (for a torch.save file use `ucpfs inspect FILE`)");
  }
  o.index_dir = args.index_dir;
  o.read_only_index = args.read_only_index;
  if (progress) o.progress = IndexingProgress(args.quiet);
  if (o.index_dir.empty() && IsS3Source(args.src)) {
    auto tree = std::static_pointer_cast<const S3Tree>(o.tree);
    const std::string cache_dir = S3IndexDir(tree->client()->options().endpoint_url, o.source_dir);
    if (s3_writable_mount) {
      o.index_dir = cache_dir;
    } else {
      // Next to the data: the bucket's index when fresh, else a local one (reused or built) that is
      // then written to the bucket; --read-only-index takes the bucket's or fails.
      index::BucketIndexOptions bo;
      bo.cache_dir = cache_dir;
      bo.read_only = args.read_only_index;
      bo.progress = o.progress;
      index::BucketIndexReport local_report;
      index::BucketIndexReport& r = report ? *report : local_report;
      UCPFS_ASSIGN_OR_RETURN(index::OpenedIndex found, index::OpenOrBuildBucketIndex(tree, bo, &r));
      if (!r.warning.empty()) std::cerr << "ucpfs: warning: " << r.warning << '\n';
      o.index_dir = found.index_dir;
      if (opened) *opened = std::move(found);
    }
  }
  if (!args.rules.empty()) {
    UCPFS_ASSIGN_OR_RETURN(o.key_rules, index::LoadRules(args.rules));
  }
  return o;
}

uint64_t TensorBytes(const index::Item& it) { return it.layout.NumElems() * ItemSize(it.dtype); }

}  // namespace

int Fail(const char* cmd, const Status& s) {
  std::cerr << "ucpfs " << cmd << ": " << s.ToString() << '\n';
  return 1;
}

std::string AbsPath(const std::string& p) {
  char buf[PATH_MAX];
  if (::realpath(p.c_str(), buf) != nullptr) return buf;
  return p;
}

namespace {

Result<std::shared_ptr<const index::Snapshot>> OpenSourceSnapshot(const SourceArgs& args, bool progress,
                                                                  index::BucketIndexReport* report) {
  std::optional<index::OpenedIndex> opened;
  UCPFS_ASSIGN_OR_RETURN(const index::SnapshotOptions o, SnapshotOptionsOf(args, progress, /*s3_writable_mount=*/false, &opened, report));
  if (opened) return index::SnapshotOf(std::move(*opened), o, 1);  // opened once (an s3:// source)
  return index::OpenSnapshot(o, 1);
}

}  // namespace

Result<std::shared_ptr<const index::Snapshot>> OpenSourceSnapshot(const SourceArgs& args, bool progress) {
  return OpenSourceSnapshot(args, progress, nullptr);
}

int RunIndex(const SourceArgs& args, bool json) {
  index::BucketIndexReport bucket;
  auto l = OpenSourceSnapshot(args, /*progress=*/true, &bucket);
  if (!l.ok()) return Fail("index", l.error());
  const auto& c = (*l)->opened.checkpoint;
  uint64_t tensor_bytes = 0, fragments = 0;
  for (const auto& it : c.items) {
    if (it.kind == index::ItemKind::kTensor) {
      tensor_bytes += TensorBytes(it);
      fragments += it.layout.fragments.size();
    }
  }
  if (json) {
    nlohmann::ordered_json out;
    out["path"] = AbsPath(args.src);
    out["format"] = c.format;
    out["flavor"] = c.flavor;
    out["files"] = c.files.size();
    out["items"] = c.items.size();
    out["fragments"] = fragments;
    out["tensor_bytes"] = tensor_bytes;
    out["params"] = (*l)->mapping.params.size();
    out["unmapped_keys"] = (*l)->mapping.unmapped_keys.size();
    out["index_state"] = index::IndexStateName((*l)->opened.state);
    out["index_dir"] = (*l)->opened.index_dir;
    out["seconds"] = (*l)->opened.elapsed_s;
    if (!bucket.manifest_url.empty()) {
      out["bucket_index"] = {{"manifest", bucket.manifest_url}, {"from_bucket", bucket.from_bucket},
                             {"uploaded", bucket.uploaded}, {"warning", bucket.warning}};
    }
    std::cout << JsonText(out) << '\n';
    return 0;
  }
  std::cout << "ucpfs index: " << AbsPath(args.src) << ": " << c.format << " (" << c.flavor << "), "
            << c.files.size() << " files, " << c.items.size() << " items, " << fragments
            << " fragments, " << tensor_bytes << " tensor bytes, " << (*l)->mapping.params.size()
            << " parameters, " << (*l)->mapping.unmapped_keys.size() << " unmapped keys\n"
            << "ucpfs index: " << index::IndexStateName((*l)->opened.state) << " at "
            << (*l)->opened.index_dir << " in " << (*l)->opened.elapsed_s << " s\n";
  if (bucket.from_bucket) std::cout << "ucpfs index: the bucket's index, " << bucket.manifest_url << '\n';
  if (bucket.uploaded) std::cout << "ucpfs index: kept in the bucket at " << bucket.manifest_url << '\n';
  return 0;
}

int RunInspectCheckpoint(const SourceArgs& args, bool json) {
  auto l = OpenSourceSnapshot(args, /*progress=*/true);
  if (!l.ok()) return Fail("inspect", l.error());
  const auto& c = (*l)->opened.checkpoint;
  nlohmann::ordered_json out;
  out["format"] = c.format;
  out["flavor"] = c.flavor;
  out["path"] = AbsPath(args.src);
  auto params = nlohmann::ordered_json::array();
  for (const auto& p : (*l)->mapping.params) {
    nlohmann::ordered_json states = nlohmann::ordered_json::object();
    for (int k = 0; k < index::kNumStateKinds; ++k) {
      if (p.item[k] < 0) continue;
      const auto& it = c.items[static_cast<size_t>(p.item[k])];
      nlohmann::ordered_json s;
      s["key"] = it.key;
      if (it.kind == index::ItemKind::kTensor) {
        std::set<std::string> files;
        for (const auto& f : it.layout.fragments) files.insert(c.files[f.file_id].rel_path);
        s["dtype"] = std::string(TorchName(it.dtype));
        s["shape"] = it.layout.shape;
        s["pattern"] = views::DescribePattern(it.layout);
        s["fragments"] = it.layout.fragments.size();
        s["nbytes"] = TensorBytes(it);
        s["files"] = std::vector<std::string>(files.begin(), files.end());
      } else {
        s["dtype"] = "bytes";
        s["nbytes"] = it.n_bytes;
        s["files"] = {c.files[it.file_id].rel_path};
      }
      states[index::StateKindName(static_cast<index::StateKind>(k))] = std::move(s);
    }
    params.push_back({{"name", p.name}, {"states", std::move(states)}});
  }
  out["params"] = std::move(params);
  out["unmapped_keys"] = (*l)->mapping.unmapped_keys;
  out["key_structure"] = {{"model_prefix", (*l)->mapping.model_prefix},
                          {"optimizer_prefixes", (*l)->mapping.optimizer_prefixes},
                          {"ambiguities", (*l)->mapping.ambiguities}};
  // Non-parameter state: what target views serve in extra_state.pt, and what no view serves.
  auto input = index::MakeTargetInput(c, *l, (*l)->mapping, (*l)->files, nullptr);
  if (!input.ok()) return Fail("inspect", input.error());
  auto extra = nlohmann::ordered_json::array();
  for (const auto& e : (*input)->extras) {
    nlohmann::ordered_json j = {{"key", e.key}};
    if (e.dp_rank >= 0) j["source_dp_rank"] = e.dp_rank;
    extra.push_back(std::move(j));
  }
  auto not_served = nlohmann::ordered_json::array();
  for (const auto& n : (*input)->not_served) not_served.push_back({{"key", n.key}, {"reason", n.reason}});
  out["extra_state"] = std::move(extra);
  out["not_served"] = std::move(not_served);
  out["fused_params"] = nlohmann::ordered_json::array();
  for (const auto& f : (*input)->fused) {
    out["fused_params"].push_back({{"param", f.param}, {"stored_as", f.stored_as}, {"note", f.note}});
  }
  if (json) {
    std::cout << JsonText(out) << '\n';
    return 0;
  }
  std::cout << out["path"].get<std::string>() << ": " << c.format << " (" << c.flavor << "), "
            << (*l)->mapping.params.size() << " parameters, " << c.files.size() << " files\n";
  for (const auto& p : out["params"]) {
    std::cout << p["name"].get<std::string>() << '\n';
    for (const auto& [state, s] : p["states"].items()) {
      std::cout << "  " << state << ": ";
      if (s["dtype"] == "bytes") {
        std::cout << "a pickled Python value (served as a 0-d float32 tensor), " << s["nbytes"] << " B\n";
        continue;
      }
      std::string files;
      for (const auto& f : s["files"]) files += (files.empty() ? "" : ",") + f.get<std::string>();
      std::cout << s["dtype"].get<std::string>() << ' ' << Dims(s["shape"].get<std::vector<int64_t>>())
                << ' ' << s["pattern"].get<std::string>() << ", " << s["fragments"] << " fragments, "
                << s["nbytes"] << " B, in " << files << '\n';
    }
  }
  for (const auto& a : (*l)->mapping.ambiguities) std::cout << "ambiguous: " << a << '\n';
  for (const auto& f : (*input)->fused) {
    std::cout << "fused: " << f.param << " (optimizer state; optim.pt) is stored split as";
    for (const auto& n : f.stored_as) std::cout << ' ' << n;
    std::cout << " (weights; model.pt)\n  note: " << f.note << '\n';
  }
  if (!(*l)->mapping.unmapped_keys.empty()) {
    std::cout << "unmapped keys (" << (*l)->mapping.unmapped_keys.size() << "):\n";
    for (const auto& k : (*l)->mapping.unmapped_keys) std::cout << "  " << k << '\n';
  }
  if (!out["extra_state"].empty()) {
    std::cout << "extra state, served in target/<layout>/rank_N/extra_state.pt (" << out["extra_state"].size()
              << "):\n";
    for (const auto& e : out["extra_state"]) {
      std::cout << "  " << e["key"].get<std::string>();
      if (e.contains("source_dp_rank")) std::cout << "  (rank-local: dp rank " << e["source_dp_rank"] << ")";
      std::cout << '\n';
    }
  }
  if (!out["not_served"].empty()) {
    std::cout << "not served (" << out["not_served"].size() << "):\n";
    for (const auto& n : out["not_served"]) {
      std::cout << "  " << n["key"].get<std::string>() << ": " << n["reason"].get<std::string>() << '\n';
    }
  }
  return 0;
}

Result<uint64_t> ParseShardSize(const std::string& text) {
  if (text.empty()) return index::kDefaultSafetensorsShardBytes;
  UCPFS_ASSIGN_OR_RETURN(uint64_t n, io::ParseByteSize(text));
  if (n == 0) return InvalidArgumentError("--safetensors-shard-size: a shard holds at least 1 byte");
  return n;
}

namespace {

// Parses the target-view options (before the daemon forks, so typos fail at once).
Result<views::ViewOptions> ParseTargetOptions(const MountArgs& args) {
  ViewArgs view_args;
  view_args.layouts = args.layouts;
  view_args.safetensors_shard_size = args.safetensors_shard_size;
  view_args.preset = args.preset;
  view_args.pattern_rules = args.pattern_rules;
  view_args.pp_split = args.pp_split;
  view_args.vocab_pad_multiple = args.vocab_pad_multiple;
  view_args.hf_dtype = args.hf_dtype;
  view_args.hf_config = args.hf_config;
  UCPFS_ASSIGN_OR_RETURN(ViewSelection v, ParseViewArgs(view_args));
  views::ViewOptions t = std::move(v.options);
  if (args.lookup_memory_mib > kMaxLookupMemoryMib) {
    return InvalidArgumentError("lookup memory " + std::to_string(args.lookup_memory_mib) + " MiB: at most " +
                                std::to_string(kMaxLookupMemoryMib) + " (1 TiB)");
  }
  t.lookup_budget_bytes = args.lookup_memory_mib << 20;
  return t;
}

}  // namespace

int RunMount(const MountArgs& mount_args) {
  // The daemon changes to "/": make every path absolute first.
  MountArgs args = mount_args;
  if (!IsS3Source(args.source.src)) args.source.src = AbsPath(args.source.src);
  args.mountpoint = AbsPathOrJoined(args.mountpoint);
  if (!args.source.index_dir.empty()) args.source.index_dir = AbsPath(args.source.index_dir);
  if (!args.source.rules.empty()) args.source.rules = AbsPath(args.source.rules);
  if (!args.pattern_rules.empty()) args.pattern_rules = AbsPath(args.pattern_rules);
  // Parsed once, here (it reads --hf-config, relative to this directory), and handed to the daemon.
  auto targets = ParseTargetOptions(args);
  if (!targets.ok()) return Fail("mount", targets.error());
  if (auto r = mount::ParseReadAhead(args.readahead, args.prefetch); !r.ok()) return Fail("mount", r.error());
  if (!args.materialize_dir.empty()) {
    // Absolute, its symlinks not resolved: the daemon refuses a symlink there (fs/materialize.h).
    if (args.materialize_dir[0] != '/') {
      char cwd[PATH_MAX];
      if (::getcwd(cwd, sizeof(cwd)) != nullptr) args.materialize_dir = std::string(cwd) + "/" + args.materialize_dir;
    }
    while (args.materialize_dir.size() > 1 && args.materialize_dir.back() == '/') args.materialize_dir.pop_back();
    if (auto m = io::ParseByteSize(args.materialize_size); !m.ok() || *m == 0) {
      return Fail("mount", InvalidArgumentError("bad --materialize-size '" + args.materialize_size + "'"));
    }
    if (args.no_passthrough) {
      return Fail("mount", InvalidArgumentError("--materialize needs the kernel's passthrough (drop --no-passthrough)"));
    }
    const std::string& mnt = args.mountpoint;  // made absolute above
    if (args.materialize_dir == mnt || args.materialize_dir.starts_with(mnt + "/")) {
      return Fail("mount", InvalidArgumentError("--materialize " + args.materialize_dir + " is inside the mount point"));
    }
  }
  if (!args.log_file.empty() && args.log_file[0] != '/') {
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof(cwd)) != nullptr) args.log_file = std::string(cwd) + "/" + args.log_file;
  }
  // A dead ucpfs mount at MNT (its daemon gone) is cleared; a live one, or another
  // filesystem, is refused with how to clear it. Then MNT must be a directory, outside SRC.
  if (Status ready = fs::PrepareMountPoint(args.mountpoint); !ready.ok()) return Fail("mount", ready);
  args.mountpoint = AbsPath(args.mountpoint);  // resolvable now that a dead mount is gone
  struct stat st;
  if (::stat(args.mountpoint.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    std::cerr << "ucpfs mount: " << args.mountpoint << ": mount point is not a directory\n";
    return 1;
  }
  if (Status apart = IsS3Source(args.source.src) ? Status::Ok()
                                                  : fs::CheckMountPointAgainstSource(args.source.src, args.mountpoint);
      !apart.ok()) {
    return Fail("mount", apart);
  }
  // Saves into a bucket prefix go through a local staging directory (uploaded in close order).
  const bool s3_writable = IsS3Source(args.source.src) && !args.read_only && !args.source.read_only_index;
  std::optional<index::OpenedIndex> opened;  // an s3:// source's bucket index, opened here once
  auto snapshot_options =
      SnapshotOptionsOf(args.source, /*progress=*/args.foreground, /*s3_writable_mount=*/s3_writable, &opened);
  if (!snapshot_options.ok()) {
    std::cerr << "ucpfs mount: source: " << snapshot_options.error().ToString() << '\n';
    return 1;
  }
  mount::DaemonOptions daemon;
  daemon.snapshot = std::move(*snapshot_options);
  if (opened) daemon.opened_index = std::make_shared<const index::OpenedIndex>(std::move(*opened));
  if (IsS3Source(args.source.src)) {
    // The daemon is forked: its client must not share a connection this process opened (the
    // checks above), or both would talk over one socket. A fresh client has none yet; the tree
    // over it keeps what this one just listed (its checks need not ask again).
    auto tree = std::static_pointer_cast<const S3Tree>(daemon.snapshot.tree);
    auto fresh = s3::Client::Make(tree->client()->options());
    if (!fresh.ok()) return Fail("mount", fresh.error());
    daemon.snapshot.tree = tree->WithClient(std::move(*fresh));
  }
  daemon.views = std::move(*targets);
  daemon.mountpoint = args.mountpoint;
  daemon.fuse_options = args.fuse_options;
  daemon.log_file = args.log_file;
  daemon.cache_size = args.cache_size;
  daemon.write_stall_timeout_s = args.write_stall_timeout_s;
  daemon.readahead = args.readahead;
  daemon.prefetch = args.prefetch;
  daemon.read_only = args.read_only;
  if (s3_writable) {
    // Default: in the mount's local index directory (S3IndexDir, or --index-dir), as `.stage`:
    // a run directory's checkpoints are indexed in subdirectories named after them, and a
    // checkpoint's name never starts with '.' (index/run_dir.h).
    daemon.stage_dir = args.stage_dir.empty() ? daemon.snapshot.index_dir + "/.stage" : AbsPathOrJoined(args.stage_dir);
    daemon.stage_keep_s = args.stage_keep_s;
    if (daemon.stage_dir == args.mountpoint || daemon.stage_dir.starts_with(args.mountpoint + "/")) {
      return Fail("mount", InvalidArgumentError("--stage-dir " + daemon.stage_dir + " is inside the mount point"));
    }
    // The index directory (its parent by default) is made here when missing, the mounting user's.
    const std::string parent = daemon.stage_dir.substr(0, daemon.stage_dir.rfind('/'));
    std::string made;
    for (size_t at = 1; at != std::string::npos && !parent.empty();) {
      at = parent.find('/', at + 1);
      made = parent.substr(0, at);
      if (::mkdir(made.c_str(), 0700) != 0 && errno != EEXIST) {
        return Fail("mount", IoError("mkdir " + made + " (for --stage-dir)", errno));
      }
    }
  } else if (!args.stage_dir.empty() || args.stage_keep_given) {
    return Fail("mount", InvalidArgumentError(std::string(args.stage_dir.empty() ? "--stage-keep" : "--stage-dir") +
                                              " is for a writable s3:// source"));
  }
  daemon.foreground = args.foreground;
  daemon.no_passthrough = args.no_passthrough;
  daemon.materialize_dir = args.materialize_dir;
  daemon.materialize_size = args.materialize_size;
  return mount::StartMount(daemon);
}

}  // namespace ucpfs::cli
