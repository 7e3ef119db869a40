// The -o option list shared by `ucpfs mount -o` and mount.fuse.ucpfs: every ucpfs option,
// repeats, bad values, mount(8)'s generic options, FUSE options, unknown ones, and the
// helper's command line as util-linux passes it.
#include "cli/mount_options.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace ucpfs::cli {
namespace {

MountArgs Apply(std::string_view list) {
  MountArgs a;
  const Status s = ApplyMountOptions(list, &a);
  EXPECT_TRUE(s.ok()) << list << ": " << s.ToString();
  return a;
}

std::string Error(std::string_view list) {
  MountArgs a;
  const Status s = ApplyMountOptions(list, &a);
  EXPECT_FALSE(s.ok()) << list;
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  return s.message();
}

TEST(MountOptions, EveryUcpfsOption) {
  const MountArgs a = Apply(
      "layout=tp2_pp2_dp4,preset=megatron,pattern_rules=/r/p.json,pp_split=5:6:6:5,lookup_memory_mib=512,"
      "cache_size=8G,read_only,readahead=16M,prefetch=0,safetensors_shard_size=2G,index_dir=/idx,rules=/r/k.toml,"
      "read_only_index,log=/var/log/u.log,foreground,write_stall_timeout=5,make_vocab_size_divisible_by=64,"
      "no_passthrough,materialize=/var/cache/views,materialize_size=20G,stage_dir=/st,stage_keep=600");
  EXPECT_EQ(a.layouts, std::vector<std::string>{"tp2_pp2_dp4"});
  EXPECT_EQ(a.preset, "megatron");
  EXPECT_EQ(a.pattern_rules, "/r/p.json");
  EXPECT_EQ(a.pp_split, "5,6,6,5");  // ':' in -o, ',' as --pp-split takes it
  EXPECT_EQ(a.lookup_memory_mib, 512u);
  EXPECT_EQ(a.cache_size, "8G");
  EXPECT_EQ(a.write_stall_timeout_s, 5u);
  EXPECT_TRUE(a.read_only);
  EXPECT_EQ(a.readahead, "16M");
  EXPECT_EQ(a.prefetch, "0");
  EXPECT_EQ(a.safetensors_shard_size, "2G");
  EXPECT_EQ(a.source.index_dir, "/idx");
  EXPECT_EQ(a.source.rules, "/r/k.toml");
  EXPECT_TRUE(a.source.read_only_index);
  EXPECT_EQ(a.log_file, "/var/log/u.log");
  EXPECT_TRUE(a.foreground);
  EXPECT_EQ(a.vocab_pad_multiple, 64);
  EXPECT_TRUE(a.no_passthrough);
  EXPECT_EQ(a.materialize_dir, "/var/cache/views");
  EXPECT_EQ(a.materialize_size, "20G");
  EXPECT_EQ(a.stage_dir, "/st");
  EXPECT_EQ(a.stage_keep_s, 600u);
  EXPECT_TRUE(a.fuse_options.empty());
}

TEST(MountOptions, DefaultsUntouched) {
  const MountArgs a = Apply("");
  const MountArgs d;
  EXPECT_EQ(a.cache_size, d.cache_size);
  EXPECT_EQ(a.preset, "auto");
  EXPECT_EQ(a.lookup_memory_mib, 256u);
  EXPECT_FALSE(a.read_only);
  EXPECT_FALSE(a.foreground);
  EXPECT_FALSE(a.no_passthrough);               // the kernel's passthrough where it is offered
  EXPECT_TRUE(a.materialize_dir.empty());       // --materialize is off by default
  EXPECT_TRUE(a.layouts.empty());
  EXPECT_EQ(a.stage_keep_s, 60u);
  EXPECT_EQ(a.vocab_pad_multiple, 0) << "not given: the source's make_vocab_size_divisible_by, else 128";
}

TEST(MountOptions, RepeatsLayoutsAccumulateOthersLastWins) {
  const MountArgs a = Apply("layout=tp1_pp1_dp1,cache_size=4G,layout=tp2_pp1_dp1,cache_size=8G,,layout=tp4_pp1_dp1");
  EXPECT_EQ(a.layouts, (std::vector<std::string>{"tp1_pp1_dp1", "tp2_pp1_dp1", "tp4_pp1_dp1"}));
  EXPECT_EQ(a.cache_size, "8G");
  // Two lists (fstab's, then the command line's), as the helper applies them.
  MountArgs b;
  ASSERT_TRUE(ApplyMountOptions("ro,cache_size=4G", &b).ok());
  ASSERT_TRUE(ApplyMountOptions("rw,cache_size=1G", &b).ok());
  EXPECT_FALSE(b.read_only);
  EXPECT_EQ(b.cache_size, "1G");
}

TEST(MountOptions, ReadOnlySpellings) {
  EXPECT_TRUE(Apply("ro").read_only);
  EXPECT_TRUE(Apply("read_only").read_only);
  EXPECT_FALSE(Apply("ro,rw").read_only);
  EXPECT_TRUE(Apply("rw,ro").read_only);
}

TEST(MountOptions, GenericOptionsDroppedOrPassedToFuse) {
  const MountArgs a = Apply(
      "defaults,auto,noauto,nofail,_netdev,user,users,nouser,owner,group,atime,diratime,loud,silent,"
      "comment=systemd.automount,x-systemd.automount,x-systemd.idle-timeout=60,x-gvfs-show");
  EXPECT_TRUE(a.fuse_options.empty());
  const MountArgs k = Apply("dev,nodev,suid,nosuid,exec,noexec,sync,async,dirsync,noatime,nodiratime,relatime,"
                            "norelatime,strictatime,nostrictatime");
  EXPECT_EQ(k.fuse_options,
            (std::vector<std::string>{"dev", "nodev", "suid", "nosuid", "exec", "noexec", "sync", "async", "dirsync",
                                      "noatime", "nodiratime", "relatime", "norelatime", "strictatime",
                                      "nostrictatime"}));
}

TEST(MountOptions, FuseOptionsPassed) {
  const MountArgs a = Apply("allow_other,allow_root,auto_unmount,default_permissions,max_read=131072,fsname=ckpt,"
                            "context=system_u:object_r:tmp_t:s0");
  EXPECT_EQ(a.fuse_options,
            (std::vector<std::string>{"allow_other", "allow_root", "auto_unmount", "default_permissions",
                                      "max_read=131072", "fsname=ckpt", "context=system_u:object_r:tmp_t:s0"}));
}

TEST(MountOptions, BadValuesNameTheOption) {

  EXPECT_NE(Error("layout=tp2_pp2").find("'layout=tp2_pp2'"), std::string::npos);
  EXPECT_NE(Error("cache_size=8GB").find("'cache_size=8GB'"), std::string::npos);  // ambiguous unit
  EXPECT_NE(Error("readahead=lots").find("readahead"), std::string::npos);
  EXPECT_NE(Error("prefetch=-1").find("prefetch"), std::string::npos);
  EXPECT_NE(Error("materialize_size=big").find("materialize_size"), std::string::npos);
  EXPECT_NE(Error("safetensors_shard_size=1X").find("safetensors_shard_size"), std::string::npos);
  EXPECT_NE(Error("lookup_memory_mib=12a").find("not a whole number"), std::string::npos);
  EXPECT_NE(Error("pp_split=5:x").find("a:b:c"), std::string::npos);
  EXPECT_NE(Error("stage_keep=0").find("1 to 31536000 seconds"), std::string::npos);  // DCP's rename needs >= 1 s
  EXPECT_NE(Error("make_vocab_size_divisible_by=0").find("not in [1, 1073741824]"), std::string::npos);
  EXPECT_NE(Error("make_vocab_size_divisible_by=2147483648").find("not in [1,"), std::string::npos);
  EXPECT_NE(Error("make_vocab_size_divisible_by=-8").find("not a whole number"), std::string::npos);
  EXPECT_NE(Error("make_vocab_size_divisible_by").find("needs a value"), std::string::npos);
  EXPECT_NE(Error("preset=nemo").find("'preset=nemo'"), std::string::npos);
  EXPECT_NE(Error("max_read=big").find("max_read"), std::string::npos);
}

TEST(MountOptions, MissingAndUnwantedValues) {
  EXPECT_NE(Error("layout").find("needs a value"), std::string::npos);
  EXPECT_NE(Error("layout=").find("needs a value"), std::string::npos);
  EXPECT_NE(Error("cache_size=").find("needs a value"), std::string::npos);
  EXPECT_NE(Error("fsname=").find("needs a value"), std::string::npos);
  EXPECT_NE(Error("ro=1").find("takes no value"), std::string::npos);
  EXPECT_NE(Error("foreground=yes").find("takes no value"), std::string::npos);
  EXPECT_NE(Error("nofail=1").find("takes no value"), std::string::npos);
  EXPECT_NE(Error("allow_other=1").find("takes no value"), std::string::npos);
}

TEST(MountOptions, UnknownRefusedNamingIt) {
  const std::string e = Error("layout=tp1_pp1_dp1,cachesize=8G,ro");
  EXPECT_NE(e.find("'cachesize=8G'"), std::string::npos) << e;
  EXPECT_NE(e.find("unknown option"), std::string::npos) << e;
  const std::string dash = Error("cache-size=8G");
  EXPECT_NE(dash.find("write 'cache_size'"), std::string::npos) << dash;
  // subtype is ucpfs's own (mount(8) and `ucpfs umount` recognise the mount by it).
  EXPECT_NE(Error("subtype=other").find("unknown option"), std::string::npos);
}

TEST(MountOptions, SloppyDropsUnknownWithWarning) {
  MountArgs a;
  std::vector<std::string> warnings;
  ASSERT_TRUE(ApplyMountOptions("bogus,cache_size=1G", &a, /*sloppy=*/true, &warnings).ok());
  EXPECT_EQ(a.cache_size, "1G");
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("'bogus'"), std::string::npos);
  // Bad values stay errors under -s.
  EXPECT_FALSE(ApplyMountOptions("cache_size=lots", &a, true, &warnings).ok());
}

TEST(MountHelper, Name) {
  EXPECT_TRUE(IsMountHelperName("/sbin/mount.fuse.ucpfs"));
  EXPECT_TRUE(IsMountHelperName("mount.fuse.ucpfs"));
  EXPECT_TRUE(IsMountHelperName("/usr/sbin/mount.ucpfs"));
  EXPECT_FALSE(IsMountHelperName("/usr/bin/ucpfs"));
  EXPECT_FALSE(IsMountHelperName("/sbin/mount.fuse"));
  EXPECT_FALSE(IsMountHelperName("mount.fuse.ucpfs2"));
}

TEST(MountHelper, CommandLineAsUtilLinuxPassesIt) {
  // mount -t fuse.ucpfs SRC MNT -o layout=...,cache_size=8G,ro,nofail (util-linux 2.38).
  auto h = ParseMountHelperArgs({"/ckpt", "/mnt/c", "-o", "ro,nodev,layout=tp2_pp2_dp4,cache_size=8G,nofail,_netdev"});
  ASSERT_TRUE(h.ok()) << h.error().ToString();
  EXPECT_EQ(h->mount.source.src, "/ckpt");
  EXPECT_EQ(h->mount.mountpoint, "/mnt/c");
  EXPECT_TRUE(h->mount.read_only);
  EXPECT_EQ(h->mount.layouts, std::vector<std::string>{"tp2_pp2_dp4"});
  EXPECT_EQ(h->mount.cache_size, "8G");
  EXPECT_EQ(h->mount.fuse_options, std::vector<std::string>{"nodev"});
  EXPECT_FALSE(h->fake);
  // -s -f -n -v, separately or together, and -oLIST.
  auto f = ParseMountHelperArgs({"/ckpt", "/mnt/c", "-s", "-f", "-n", "-v", "-orw,bogus"});
  ASSERT_TRUE(f.ok()) << f.error().ToString();
  EXPECT_TRUE(f->fake);
  EXPECT_TRUE(f->verbose);
  EXPECT_EQ(f->warnings.size(), 1u);
  auto g = ParseMountHelperArgs({"-fv", "/ckpt", "/mnt/c"});
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE(g->fake && g->verbose);
}

TEST(MountHelper, CommandLineErrors) {
  EXPECT_FALSE(ParseMountHelperArgs({"/ckpt"}).ok());
  EXPECT_FALSE(ParseMountHelperArgs({"/ckpt", "/mnt", "/extra"}).ok());
  EXPECT_FALSE(ParseMountHelperArgs({"/ckpt", "/mnt", "-o"}).ok());
  auto flag = ParseMountHelperArgs({"/ckpt", "/mnt", "-x"});
  ASSERT_FALSE(flag.ok());
  EXPECT_NE(flag.error().message().find("-x"), std::string::npos);
  auto opt = ParseMountHelperArgs({"/ckpt", "/mnt", "-o", "ro,layout=nope"});
  ASSERT_FALSE(opt.ok());
  EXPECT_NE(opt.error().message().find("'layout=nope'"), std::string::npos);
}

}  // namespace
}  // namespace ucpfs::cli
