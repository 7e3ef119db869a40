#include "cli/mount_options.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdint>
#include <string>

#include "core/io/pinned_cache.h"
#include "core/layout/layout.h"
#include "core/layout/patterns.h"

namespace ucpfs::cli {
namespace {

// mount(8)'s own options (and systemd's): they mean nothing to the filesystem.
constexpr std::array<std::string_view, 14> kDropped = {
    "defaults", "auto", "noauto", "nofail", "_netdev", "user", "users", "nouser", "owner", "group",
    "atime",    "diratime", "loud", "silent"};
// Generic options the kernel applies to the mount (libfuse passes them as mount flags).
constexpr std::array<std::string_view, 15> kKernelFlags = {
    "dev",      "nodev",      "suid",     "nosuid",    "exec",        "noexec",      "sync",         "async",
    "dirsync",  "noatime",    "nodiratime", "relatime", "norelatime", "strictatime", "nostrictatime"};
// FUSE options passed to libfuse as they are.
constexpr std::array<std::string_view, 4> kFuseFlags = {"allow_other", "allow_root", "auto_unmount",
                                                        "default_permissions"};
constexpr std::array<std::string_view, 6> kFuseValued = {"max_read",   "fsname",     "context",
                                                         "fscontext", "defcontext", "rootcontext"};

template <size_t N>
bool In(const std::array<std::string_view, N>& set, std::string_view name) {
  return std::find(set.begin(), set.end(), name) != set.end();
}

Status Bad(std::string_view option, const std::string& why) {
  return InvalidArgumentError("mount option '" + std::string(option) + "': " + why);
}

Result<uint64_t> ParseCount(std::string_view option, std::string_view value) {
  uint64_t n = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
  if (ec != std::errc() || end != value.data() + value.size()) {
    return Bad(option, "'" + std::string(value) + "' is not a whole number");
  }
  return n;
}

Status CheckSize(std::string_view option, std::string_view value) {
  auto n = io::ParseByteSize(std::string(value));
  if (!n.ok()) return Bad(option, n.error().message());
  return Status::Ok();
}

enum class Kind { kFlag, kValue };

// One of ucpfs's own options: `value` is empty for a flag. Errors: Bad(...) for a bad value.
Status ApplyOwn(std::string_view name, std::string_view option, const std::string& value, MountArgs* a) {
  if (name == "ro" || name == "read_only") {
    a->read_only = true;
  } else if (name == "rw") {
    a->read_only = false;
  } else if (name == "read_only_index") {
    a->source.read_only_index = true;
  } else if (name == "foreground") {
    a->foreground = true;
  } else if (name == "layout") {
    if (auto l = layout::ParseLayout(value); !l.ok()) return Bad(option, l.error().message());
    a->layouts.push_back(value);
  } else if (name == "preset") {
    if (auto p = layout::ParsePreset(value); !p.ok()) return Bad(option, p.error().message());
    a->preset = value;
  } else if (name == "pp_split") {
    std::string commas = value;
    std::replace(commas.begin(), commas.end(), ':', ',');
    if (auto s = layout::ParsePpSplit(commas); !s.ok()) {
      return Bad(option, s.error().message() + " (write the layers per stage as a:b:c)");
    }
    a->pp_split = commas;
  } else if (name == "make_vocab_size_divisible_by") {
    UCPFS_ASSIGN_OR_RETURN(const uint64_t n, ParseCount(option, value));
    if (n < 1 || n > static_cast<uint64_t>(layout::kMaxVocabPadMultiple)) {
      return Bad(option, "not in [1, " + std::to_string(layout::kMaxVocabPadMultiple) + "]");
    }
    a->vocab_pad_multiple = static_cast<int64_t>(n);
  } else if (name == "lookup_memory_mib") {
    UCPFS_ASSIGN_OR_RETURN(a->lookup_memory_mib, ParseCount(option, value));
  } else if (name == "write_stall_timeout") {
    UCPFS_ASSIGN_OR_RETURN(a->write_stall_timeout_s, ParseCount(option, value));
    if (a->write_stall_timeout_s < 1 || a->write_stall_timeout_s > 86400) {
      return Bad(option, "the timeout is 1 to 86400 seconds");
    }
  } else if (name == "cache_size") {
    UCPFS_RETURN_IF_ERROR(CheckSize(option, value));
    a->cache_size = value;
  } else if (name == "readahead") {
    UCPFS_RETURN_IF_ERROR(CheckSize(option, value));
    a->readahead = value;
  } else if (name == "no_passthrough") {
    a->no_passthrough = true;
  } else if (name == "materialize") {
    a->materialize_dir = value;
  } else if (name == "materialize_size") {
    UCPFS_RETURN_IF_ERROR(CheckSize(option, value));
    a->materialize_size = value;
  } else if (name == "prefetch") {
    UCPFS_RETURN_IF_ERROR(CheckSize(option, value));
    a->prefetch = value;
  } else if (name == "safetensors_shard_size") {
    UCPFS_RETURN_IF_ERROR(CheckSize(option, value));
    a->safetensors_shard_size = value;
  } else if (name == "hf_dtype") {
    a->hf_dtype = value;
  } else if (name == "hf_config") {
    a->hf_config = value;
  } else if (name == "pattern_rules") {
    a->pattern_rules = value;
  } else if (name == "index_dir") {
    a->source.index_dir = value;
  } else if (name == "rules") {
    a->source.rules = value;
  } else if (name == "s3_endpoint") {
    a->source.s3_endpoint = value;
  } else if (name == "stage_dir") {
    a->stage_dir = value;
  } else if (name == "stage_keep") {
    UCPFS_ASSIGN_OR_RETURN(a->stage_keep_s, ParseCount(option, value));
    if (a->stage_keep_s < 1 || a->stage_keep_s > 31536000) return Bad(option, "the time is 1 to 31536000 seconds");
    a->stage_keep_given = true;
  } else if (name == "log") {
    a->log_file = value;
  }
  return Status::Ok();
}

// Whether `name` is one of ucpfs's own options, and if so whether it takes a value.
bool OwnKind(std::string_view name, Kind* kind) {
  static constexpr std::array<std::string_view, 6> kFlags = {"ro", "rw", "read_only", "read_only_index",
                                                             "foreground", "no_passthrough"};
  static constexpr std::array<std::string_view, 21> kValued = {"materialize", "materialize_size",
      "layout",    "preset",   "pp_split",  "lookup_memory_mib", "cache_size", "readahead", "prefetch",
      "safetensors_shard_size", "pattern_rules", "index_dir", "rules", "log", "write_stall_timeout",
      "make_vocab_size_divisible_by", "hf_dtype", "hf_config", "s3_endpoint", "stage_dir", "stage_keep"};
  if (In(kFlags, name)) {
    *kind = Kind::kFlag;
    return true;
  }
  if (In(kValued, name)) {
    *kind = Kind::kValue;
    return true;
  }
  return false;
}

// One option of the list. Errors: as ApplyMountOptions.
Status ApplyOne(std::string_view option, MountArgs* args, bool sloppy, std::vector<std::string>* warnings) {
  const size_t eq = option.find('=');
  const std::string_view name = option.substr(0, eq);
  const bool has_value = eq != std::string_view::npos;
  const std::string value = has_value ? std::string(option.substr(eq + 1)) : std::string();
  Kind kind;
  if (OwnKind(name, &kind)) {
    if (kind == Kind::kFlag && has_value) return Bad(option, "'" + std::string(name) + "' takes no value");
    if (kind == Kind::kValue && value.empty()) {
      return Bad(option, "'" + std::string(name) + "' needs a value (" + std::string(name) + "=...)");
    }
    return ApplyOwn(name, option, value, args);
  }
  if (In(kDropped, name) && !has_value) return Status::Ok();
  if (name == "comment" || name.starts_with("x-")) return Status::Ok();
  if ((In(kKernelFlags, name) || In(kFuseFlags, name)) && !has_value) {
    args->fuse_options.emplace_back(option);
    return Status::Ok();
  }
  if (In(kFuseValued, name)) {
    if (value.empty()) return Bad(option, "'" + std::string(name) + "' needs a value");
    if (name == "max_read") UCPFS_RETURN_IF_ERROR(ParseCount(option, value).status());
    args->fuse_options.emplace_back(option);
    return Status::Ok();
  }
  std::string why = "unknown option";
  if (In(kDropped, name) || In(kKernelFlags, name) || In(kFuseFlags, name)) {
    why = "'" + std::string(name) + "' takes no value";
  } else if (name.find('-') != std::string_view::npos) {
    std::string underscored(name);
    std::replace(underscored.begin(), underscored.end(), '-', '_');
    if (OwnKind(underscored, &kind)) why += " (write '" + underscored + "': -o names use underscores)";
  }
  if (sloppy && why.starts_with("unknown")) {
    if (warnings != nullptr) warnings->push_back("mount option '" + std::string(option) + "' ignored (-s): " + why);
    return Status::Ok();
  }
  return Bad(option, why);
}

}  // namespace

Status ApplyMountOptions(std::string_view list, MountArgs* args, bool sloppy, std::vector<std::string>* warnings) {
  while (!list.empty()) {
    const size_t comma = list.find(',');
    const std::string_view option = list.substr(0, comma);
    if (!option.empty()) UCPFS_RETURN_IF_ERROR(ApplyOne(option, args, sloppy, warnings));
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return Status::Ok();
}

bool IsMountHelperName(std::string_view argv0) {
  const size_t slash = argv0.find_last_of('/');
  const std::string_view base = slash == std::string_view::npos ? argv0 : argv0.substr(slash + 1);
  return base == "mount.fuse.ucpfs" || base == "mount.ucpfs";
}

Result<MountHelperArgs> ParseMountHelperArgs(const std::vector<std::string>& args) {
  MountHelperArgs out;
  std::vector<std::string> positional;
  std::vector<std::string> lists;
  bool sloppy = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-o") {
      if (i + 1 == args.size()) return InvalidArgumentError("-o needs an option list");
      lists.push_back(args[++i]);
    } else if (a.starts_with("-o")) {
      lists.push_back(a.substr(2));
    } else if (a.size() > 1 && a[0] == '-') {
      for (char c : a.substr(1)) {
        switch (c) {
          case 's': sloppy = true; break;
          case 'f': out.fake = true; break;
          case 'n': break;  // no mtab: there is none to write
          case 'v': out.verbose = true; break;
          default:
            return InvalidArgumentError(std::string("unknown flag -") + c +
                                        " (usage: mount.fuse.ucpfs SRC MNT [-sfnv] [-o OPTIONS])");
        }
      }
    } else {
      positional.push_back(a);
    }
  }
  if (positional.size() != 2) {
    return InvalidArgumentError("expected SRC and MNT, got " + std::to_string(positional.size()) +
                                " arguments (usage: mount.fuse.ucpfs SRC MNT [-sfnv] [-o OPTIONS])");
  }
  out.mount.source.src = positional[0];
  out.mount.mountpoint = positional[1];
  for (const std::string& list : lists) {
    UCPFS_RETURN_IF_ERROR(ApplyMountOptions(list, &out.mount, sloppy, &out.warnings));
  }
  return out;
}

}  // namespace ucpfs::cli
