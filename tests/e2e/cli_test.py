"""End-to-end: the ucpfs command line: --help, --version, inspect's table, and clean errors
(exit code, message naming the file) on missing, directory, truncated and garbage inputs; a
rank file the mount cannot make says why beside it (model.safetensors.error)."""
import os

import torch

from e2e_common import Results, run, tmpdir, ucpfs_bin


def main():
    res = Results("e2e_cli")
    exe = ucpfs_bin()

    def help_():
        r = run([exe, "--help"])
        assert "inspect" in r.stdout and "Usage" in r.stdout, r.stdout
    res.check("--help", help_)

    def version():
        r = run([exe, "--version"])
        assert r.stdout.startswith("ucpfs "), r.stdout
    res.check("--version", version)

    def no_command():
        r = run([exe], check=False)
        assert r.returncode != 0 and "inspect" in (r.stdout + r.stderr)
    res.check("no subcommand is an error", no_command)

    with tmpdir("ucpfs-cli-") as d:
        good = os.path.join(d, "good.pt")
        torch.save({"w": torch.arange(12, dtype=torch.float32).view(3, 4),
                    "v": torch.arange(12, dtype=torch.float32).view(3, 4).t()}, good)

        def table():
            r = run([exe, "inspect", good])
            lines = r.stdout.splitlines()
            assert lines[0].startswith(good + ": torch.save, ") and "2 tensors" in lines[0], lines[0]
            assert any(l.startswith("w ") and "float32" in l and "[3,4]" in l for l in lines), r.stdout
            assert any(l.startswith("v ") and "[1,4]*" in l for l in lines), r.stdout
        res.check("inspect table", table)

        def expect_error(path, code, *needles):
            r = run([exe, "inspect", path], check=False)
            assert r.returncode == code, (r.returncode, r.stderr)
            assert r.stdout == "", r.stdout
            for n in needles:
                assert n in r.stderr, (n, r.stderr)

        res.check("missing file", lambda: expect_error(os.path.join(d, "nope.pt"), 1, "nope.pt", "not found"))
        empty = os.path.join(d, "empty")
        os.makedirs(empty)
        open(os.path.join(empty, "notes.txt"), "w").write("not a checkpoint")
        res.check("directory without a checkpoint", lambda: expect_error(empty, 1, empty))

        def weights_dir():  # one torch.save file: a weights-only source
            r = run([exe, "inspect", d])
            assert "weights (torch), 2 parameters" in r.stdout, r.stdout
        res.check("directory of one torch.save file: weights", weights_dir)

        blob = open(good, "rb").read()
        for cut in (0, 10, len(blob) // 2, len(blob) - 1):
            p = os.path.join(d, f"trunc{cut}.pt")
            open(p, "wb").write(blob[:cut])
            res.check(f"truncated at {cut}", lambda p=p: expect_error(p, 1, p, "corrupt"))
        garbage = os.path.join(d, "garbage.pt")
        open(garbage, "wb").write(os.urandom(4096))
        res.check("garbage", lambda: expect_error(garbage, 1, garbage, "corrupt"))

        def safetensors_refused():
            # safetensors cannot name a tensor "__metadata__": each rank has model.pt and, in
            # place of model.safetensors, model.safetensors.error saying why.
            from mount_common import mounted  # noqa: PLC0415 - only this check mounts
            src = os.path.join(d, "meta_src")
            os.makedirs(src)
            torch.save({"__metadata__": torch.ones(4, 4), "layer.weight": torch.zeros(4, 4)},
                       os.path.join(src, "model.pt"))
            with mounted(src, os.path.join(d, "meta_mnt")) as (m, _):
                for rank in ("rank_0", "rank_1"):
                    rdir = os.path.join(m, "target", "tp1_pp1_dp2", rank)
                    names = sorted(os.listdir(rdir))
                    assert "model.safetensors" not in names and "model.safetensors.error" in names, names
                    why = open(os.path.join(rdir, "model.safetensors.error")).read()
                    assert "__metadata__" in why and why.endswith("\n"), why
                    assert torch.load(os.path.join(rdir, "model.pt"))["__metadata__"].eq(1).all()
        res.check("a rank file that cannot be made: model.safetensors.error says why", safetensors_refused)
    res.finish()


if __name__ == "__main__":
    main()
