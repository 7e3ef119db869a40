"""End-to-end: `<tag>_universal/` for every tag of a DeepSpeed save directory (issue 9).

Not for: the universal files' content case by case (deepspeed_sources_test.py covers every ZeRO
stage and optimizer; this test reuses its comparison helpers) or resuming from the mount.

The real DeepSpeed engine (fixtures/gen_deepspeed.py, ZeRO-2, 2 ranks, CPU) saves twice into one
save directory: after 2 steps (global_step2/) and after 3 (global_step3/, `latest`). Mounted at
the save directory:
 1. global_step2_universal/ and global_step3_universal/ both exist and each equals, file by file,
    what the installed ds_to_universal writes for that tag; latest_universal names
    global_step3_universal;
 2. status.json keeps "universal" for the latest tag and lists the other tags in
    "universal_tags";
 3. the mount does not fail for a tag it cannot serve: a copy of global_step2/ missing a dp rank
    (global_step1/) is listed with its error and gets no view; a symlink to a tag directory is not
    followed (no view); a `<tag>_universal/` directory already in the save directory is not taken
    for a tag.

Run by hand: UCPFS_BIN=build/cli/ucpfs .venv/bin/python tests/e2e/deepspeed_tags_test.py
"""
import json
import os
import shutil
import sys

from deepspeed_sources_test import GEN, universal_equals
from e2e_common import Results, run, tmpdir
from mount_common import mounted

TAGS = ("global_step2", "global_step3")


def save_twice(work):
    """One save directory holding global_step2/ and global_step3/ of the same run, `latest` -> 3."""
    src = os.path.join(work, "ds")
    for steps in (2, 3):
        run([sys.executable, GEN, "save", src, "--case", "zero2", "--ranks", "2", "--steps", str(steps),
             "--no-truth"], timeout=300)
    assert sorted(e for e in os.listdir(src) if e.startswith("global_step")) == list(TAGS), os.listdir(src)
    assert open(os.path.join(src, "latest")).read().strip() == "global_step3"
    return src


def ds_to_universal(work, src, tag):
    """The installed converter's output for src/<tag>, as <out>/<tag>_universal."""
    out = os.path.join(work, "ds-universal")
    run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", os.path.join(src, tag),
         "--output_folder", os.path.join(out, tag + "_universal"), "--num_extract_workers", "1",
         "--num_merge_workers", "1"], timeout=300)
    return os.path.join(out, tag + "_universal")


def every_tag(work, src):
    want = {tag: ds_to_universal(work, src, tag) for tag in TAGS}
    n = 0
    with mounted(src, os.path.join(work, "mnt")) as (m, _):
        for tag in TAGS:
            n += universal_equals(os.path.join(m, tag + "_universal"), want[tag])
        assert open(os.path.join(m, "latest_universal")).read() == "global_step3_universal"
        status = json.load(open(os.path.join(m, ".ucpfs", "status.json")))
        assert status["universal"] == {"dir": "global_step3_universal",
                                       "latest_universal": "global_step3_universal"}, status["universal"]
        assert status["universal_tags"] == [{"tag": "global_step2", "dir": "global_step2_universal"}], \
            status["universal_tags"]
    return n


def unservable_tags(work, src):
    # A tag missing a dp rank, a symlink to a tag, and a universal folder ds_to_universal left.
    bad = os.path.join(src, "global_step1")
    shutil.copytree(os.path.join(src, "global_step2"), bad)
    os.remove(os.path.join(bad, "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    os.symlink("global_step2", os.path.join(src, "linked_step"))
    on_disk = os.path.join(src, "global_step2_universal")
    shutil.copytree(os.path.join(work, "ds-universal", "global_step2_universal"), on_disk)
    open(os.path.join(on_disk, "on_disk_only"), "w").close()
    with mounted(src, os.path.join(work, "mnt-bad")) as (m, _):
        status = json.load(open(os.path.join(m, ".ucpfs", "status.json")))
        tags = status["universal_tags"]
        assert [t["tag"] for t in tags] == ["global_step1", "global_step2"], tags
        assert "global_step1/zero_pp_rank_0_mp_rank_00_optim_states.pt" in tags[0].get("error", ""), tags[0]
        assert "error" not in tags[1], tags[1]
        names = set(os.listdir(m))
        assert {"global_step1", "global_step2_universal", "global_step3_universal"} <= names, names
        assert not {"global_step1_universal", "linked_step_universal",
                    "global_step2_universal_universal"} & names, names
        # The served view (same files), not the folder on disk under the same name (one more).
        universal_equals(os.path.join(m, "global_step2_universal"),
                         os.path.join(work, "ds-universal", "global_step2_universal"))


def main():
    res = Results("deepspeed_tags")
    with tmpdir("ucpfs-deepspeed-tags-") as work:
        src = save_twice(work)
        res.check("global_step2_universal/ and global_step3_universal/ of one save directory equal "
                  "ds_to_universal's output for their tag; latest_universal names global_step3_universal",
                  lambda: every_tag(work, src))
        res.check("a tag that cannot be served is reported, a symlink is not followed, a universal "
                  "folder on disk is not a tag; the mount goes on", lambda: unservable_tags(work, src))
    res.finish()


if __name__ == "__main__":
    main()
