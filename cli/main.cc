// The `ucpfs` command. Subcommands call the same core/index/fs APIs the filesystem uses.
#include <CLI/CLI.hpp>
#include <sys/stat.h>

#include <iostream>
#include <string>
#include <vector>

#include "core/io/curl_api.h"
#include "core/io/lazy_file_source.h"
#include "cli/checkpoint_cmds.h"
#include "cli/mount_control.h"
#include "cli/convert_cmd.h"
#include "cli/inspect.h"
#include "cli/mount_helper.h"
#include "cli/mount_options.h"
#include "cli/verify_cmd.h"
#include "cli/view_args.h"
#include "cli/plan_cmd.h"
#include "fs/fuse_mount.h"

namespace {

void AddSourceOptions(CLI::App* cmd, ucpfs::cli::SourceArgs& a) {
  cmd->add_option("--index-dir", a.index_dir,
                  "where the LMDB index lives (default: SRC/.ucpfs when writable, else ~/.cache/ucpfs/...)");
  cmd->add_option("--rules", a.rules, "key-mapping rules file (.json or .toml), tried before the built-ins");
  cmd->add_flag("--read-only-index", a.read_only_index,
                "never write the index; fail if it is missing or stale (shared, prebuilt indexes)");
  cmd->add_flag("-q,--quiet", a.quiet, "no progress on stderr");
  cmd->add_option("--s3-endpoint", a.s3_endpoint,
                  "S3 endpoint URL for an s3://BUCKET/PREFIX source (else AWS_ENDPOINT_URL, ~/.aws/config; "
                  "credentials only from the AWS environment and files)");
}

}  // namespace

int main(int argc, char** argv) {
  // A checkpoint may have more files than the default soft limit; source files are reached
  // through a bounded descriptor cache sized from the limit in force (FdCache).
  ucpfs::RaiseOpenFileLimit();
  if (ucpfs::cli::IsMountHelperName(argv[0])) return ucpfs::cli::RunMountHelper(argc, argv);
  CLI::App app{"ucpfs: mount a distributed training checkpoint (PyTorch DCP, Megatron-Core torch_dist, DeepSpeed,\n"
               "Megatron-LM, Hugging Face safetensors or a torch.save state dict) as resharded views:\n"
               "  MNT/atomic/<param>/{fp32,exp_avg,exp_avg_sq}.pt   consolidated per-parameter state\n"
               "  MNT/target/<layout>/rank_N/{model,optim}.pt       each rank's shard for a new layout\n"
               "  MNT/target/<layout>/rank_N/model.safetensors      the same weights as safetensors\n"
               "  MNT/safetensors/model-0000K-of-0000N.safetensors  the weights consolidated, sharded as\n"
               "                                                    Hugging Face saves them (+ index.json)\n"
               "  MNT/hf/                                           a Hugging Face model folder that\n"
               "                                                    from_pretrained loads (config.json,\n"
               "                                                    Llama names; or hf.error: what is missing)\n"
               "  MNT/<tag>_universal/, MNT/latest_universal        DeepSpeed: what ds_to_universal writes\n"
               "  MNT/<source files>                                the checkpoint's own files, read-write:\n"
               "                                                    saves return at memory speed, are made\n"
               "                                                    durable in the background and shown as\n"
               "                                                    views without a remount\n"
               "  MNT/.ucpfs/status.json, stats.json                what is mounted; counters"};
  app.set_version_flag("--version", std::string("ucpfs ") + UCPFS_VERSION + "\n" + ucpfs::fs::LinkedFuseText() + "\n" +
                                         ucpfs::s3::CurlLibraryText());
  app.require_subcommand(0, 1);

  ucpfs::cli::MountArgs mount;
  std::vector<std::string> mount_opts;  // -o lists (repeatable)
  CLI::App* mount_cmd = app.add_subcommand("mount", "Mount checkpoint SRC at MNT (returns once the mount is ready)");
  mount_cmd->add_option("SRC", mount.source.src, "checkpoint directory")->required();
  mount_cmd->add_option("MNT", mount.mountpoint, "mount point (an existing directory)")->required();
  mount_cmd->add_flag("-f,--foreground", mount.foreground, "stay in the foreground");
  mount_cmd->add_option("-o", mount_opts,
                        "options, comma-separated, as mount(8) takes them: every long option as name[=value] "
                        "with underscores (layout=tp2_pp1_dp1,cache_size=8G,ro,pp_split=5:6:6:5), FUSE options "
                        "(allow_other, ...) and mount's generic ones (cli/mount_options.h); repeatable");
  mount_cmd->add_option("--log", mount.log_file, "daemon log file (default: discarded)");
  mount_cmd->add_option("--layout", mount.layouts,
                        "serve target/<LAYOUT>/rank_N/ for this layout, e.g. tp2_pp2_dp4 (repeatable)");
  ucpfs::cli::AddPatternOptions(mount_cmd, mount.preset, mount.pattern_rules, mount.pp_split,
                                mount.vocab_pad_multiple);
  mount_cmd->add_option("--lookup-memory-mib", mount.lookup_memory_mib,
                        "memory for layouts built on lookup under target/, together (default 256); "
                        "a layout that would pass it is refused")
      // Checked as text first: a negative number would otherwise wrap to 2^64 - 5.
      ->check(CLI::Range(uint64_t{0}, ucpfs::cli::kMaxLookupMemoryMib));
  mount_cmd->add_option("--cache-size", mount.cache_size,
                        "pinned host cache that captures saves into the mount (default 2G; e.g. 512M, 8G)");
  mount_cmd->add_option("--write-stall-timeout", mount.write_stall_timeout_s,
                        "seconds a write waits for a full cache while every flush fails (a dead or full "
                        "disk) before it fails with the disk's error (default 30)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{86400}));
  mount_cmd->add_flag("--read-only", mount.read_only, "serve read-only: no writes, no write capture");
  mount_cmd->add_option("--stage-dir", mount.stage_dir,
                        "an s3:// mount's local staging directory: saves land there (durable, crash-ordered) and "
                        "are uploaded to the bucket in close order (default: beside the mount's local index)");
  mount_cmd->add_option("--stage-keep", mount.stage_keep_s,
                        "seconds an uploaded staged file stays in --stage-dir after its upload and its last "
                        "close (default 60, at least 1); then it is removed (read it through the views)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{31536000}));
  mount_cmd->add_option("--readahead", mount.readahead,
                        "the mount's kernel readahead window (default: the source disk's, 1M to 64M; e.g. 16M)");
  mount_cmd->add_option("--prefetch", mount.prefetch,
                        "read source files this far ahead of a view's sequential reads into the page cache "
                        "(default 32M; 0: off)");
  mount_cmd->add_flag("--no-passthrough", mount.no_passthrough,
                      "serve every read and write through the daemon (the kernel's FUSE passthrough off)");
  mount_cmd->add_option("--materialize", mount.materialize_dir,
                        "copy each view file into DIR behind its first open (served by the daemon); later opens "
                        "are read by the kernel from that copy (passthrough: page-cache speed, mmap). Off by default");
  mount_cmd->add_option("--materialize-size", mount.materialize_size,
                        "the most --materialize keeps, least recently opened out (default 8G)");
  mount_cmd->add_option("--safetensors-shard-size", mount.safetensors_shard_size,
                        "largest file of safetensors/ (default 5000000000, Hugging Face's 5GB; e.g. 2G)");
  ucpfs::cli::AddHfOptions(mount_cmd, mount.hf_dtype, mount.hf_config);
  AddSourceOptions(mount_cmd, mount.source);

  std::string umount_path;
  CLI::App* umount_cmd = app.add_subcommand("umount", "Unmount a ucpfs mount");
  umount_cmd->add_option("MNT", umount_path, "mount point")->required();

  ucpfs::cli::SyncArgs sync_args;
  CLI::App* sync_cmd = app.add_subcommand(
      "sync", "Return once everything saved into mount MNT before now is durable in its source");
  sync_cmd->add_option("MNT", sync_args.mountpoint, "mount point")->required();
  sync_cmd->add_flag("--json", sync_args.json, "print {\"mount\", \"bytes_flushed\", \"dirty_bytes\", \"not_released\", \"seconds\"} as JSON");
  sync_cmd->add_flag("-q,--quiet", sync_args.quiet, "no progress on stderr");

  std::string status_path;
  bool status_json = false;
  CLI::App* status_cmd = app.add_subcommand(
      "status", "Show what mount MNT serves and its counters (write cache, flushes, source reads)");
  status_cmd->add_option("MNT", status_path, "mount point")->required();
  status_cmd->add_flag("--json", status_json, "print {\"status\": ..., \"stats\": ...} as JSON");

  ucpfs::cli::SourceArgs index_args;
  bool index_json = false;
  CLI::App* index_cmd = app.add_subcommand("index", "Build (or verify and reuse) the index of checkpoint SRC");
  index_cmd->add_option("SRC", index_args.src, "checkpoint directory")->required();
  index_cmd->add_flag("--json", index_json, "print the summary as one JSON object");
  AddSourceOptions(index_cmd, index_args);

  ucpfs::cli::SourceArgs inspect_args;
  bool inspect_json = false;
  CLI::App* inspect = app.add_subcommand(
      "inspect", "Show what a checkpoint directory or a torch.save file holds, without reading tensor data");
  inspect->add_option("SRC", inspect_args.src, "checkpoint directory, or a torch.save file (.pt)")->required();
  inspect->add_flag("--json", inspect_json, "print one JSON object instead of a table");
  AddSourceOptions(inspect, inspect_args);

  ucpfs::cli::ConvertArgs convert_args;
  CLI::App* convert = app.add_subcommand(
      "convert", "Materialise views of checkpoint SRC under DST without FUSE (target/<layout>/rank_<N>/, atomic/, hf/, ...)");
  convert->add_option("SRC", convert_args.source.src, "checkpoint directory")->required();
  convert->add_option("DST", convert_args.dst, "output directory (created)")->required();
  convert->add_option("--layout", convert_args.views.layouts, "target layout tp<T>_pp<P>_dp<D>[_ep<E>][_zero1] (repeatable)");
  convert->add_flag("--atomic", convert_args.views.atomic, "also write atomic/<param>/<state>.pt");
  convert->add_flag("--safetensors", convert_args.views.safetensors,
                    "also write safetensors/: the weights as sharded safetensors + model.safetensors.index.json");
  convert->add_option("--view", convert_args.views.views,
                      "also write the view NAME as a mount serves it: atomic, safetensors, hf, universal or target "
                      "(with --layout) (repeatable)");
  convert->add_option("--safetensors-shard-size", convert_args.views.safetensors_shard_size,
                      "largest safetensors shard of safetensors/ and hf/ (default 5000000000, Hugging Face's 5GB; "
                      "e.g. 2G)");
  ucpfs::cli::AddPatternOptions(convert, convert_args.views.preset, convert_args.views.pattern_rules,
                                convert_args.views.pp_split, convert_args.views.vocab_pad_multiple);
  ucpfs::cli::AddHfOptions(convert, convert_args.views.hf_dtype, convert_args.views.hf_config);
  convert->add_option("--threads", convert_args.threads, "writer threads (default: all cores)")
      ->check(CLI::Range(0, 4096));
  convert->add_flag("--json", convert_args.json, "print the summary as one JSON object");
  AddSourceOptions(convert, convert_args.source);
  ucpfs::cli::PlanArgs plan_args;
  CLI::App* plan = ucpfs::cli::AddPlanCommand(app, plan_args);
  AddSourceOptions(plan, plan_args.source);

  ucpfs::cli::VerifyArgs verify_args;
  CLI::App* verify_cmd = ucpfs::cli::AddVerifyCommand(app, verify_args);
  AddSourceOptions(verify_cmd, verify_args.source);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (mount_cmd->parsed()) {
    mount.stage_keep_given = mount_cmd->count("--stage-keep") > 0;
    for (const std::string& list : mount_opts) {
      if (ucpfs::Status o = ucpfs::cli::ApplyMountOptions(list, &mount); !o.ok()) {
        std::cerr << "ucpfs mount: " << o.message() << '\n';
        return 2;
      }
    }
    return ucpfs::cli::RunMount(mount);
  }
  if (umount_cmd->parsed()) return ucpfs::cli::RunUmount(umount_path);
  if (sync_cmd->parsed()) return ucpfs::cli::RunSync(sync_args);
  if (status_cmd->parsed()) return ucpfs::cli::RunStatus(status_path, status_json);
  if (convert->parsed()) return ucpfs::cli::RunConvert(convert_args);
  if (verify_cmd->parsed()) return ucpfs::cli::RunVerify(verify_args);
  if (index_cmd->parsed()) return ucpfs::cli::RunIndex(index_args, index_json);
  if (plan->parsed()) return ucpfs::cli::RunPlan(plan_args);
  if (inspect->parsed()) {
    struct stat st;
    if (ucpfs::cli::IsS3Source(inspect_args.src) || (::stat(inspect_args.src.c_str(), &st) == 0 && S_ISDIR(st.st_mode))) {
      return ucpfs::cli::RunInspectCheckpoint(inspect_args, inspect_json);
    }
    return ucpfs::cli::RunInspect(inspect_args.src, inspect_json, std::cout, std::cerr);
  }
  std::cerr << app.help() << "ucpfs: a subcommand is required\n";
  return 2;
}
