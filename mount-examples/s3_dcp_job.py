"""The job of s3-dcp.sh: a training step saved to object storage with torch's own S3 path, then
one rank of a new layout loaded through an `s3://` mount and compared with the live state.

  save URL OUT    a tiny MLP, one AdamW step; dcp.save of its model and optimizer (keyed by
                  parameter names, get_state_dict) to s3://BUCKET/PREFIX through FsspecWriter
                  (s3fs; endpoint and keys from the AWS variables); the live state to OUT/live.pt
  check MNT OUT   torch.load of MNT/target/tp1_pp1_dp2_zero1/rank_1/{model,optim}.pt: the model
                  equals the live one, and the optimizer file holds rank 1's half of the
                  parameters and Adam moments flattened in parameter order (ZeRO-1 over 2 ranks)
"""
import os
import sys

import torch

LAYOUT = "tp1_pp1_dp2_zero1"


def s3fs_options():
    return {"key": os.environ["AWS_ACCESS_KEY_ID"], "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"],
                              "region_name": os.environ.get("AWS_REGION", "us-east-1")}}


def save(url, out):
    import s3fs
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    fs = s3fs.S3FileSystem(**s3fs_options())
    if not fs.exists(bucket):
        fs.call_s3("create_bucket", Bucket=bucket)  # (s3fs's mkdir sends a region RGW refuses)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=FsspecWriter(url, **s3fs_options()))
    params = list(model.parameters())
    live = {"model": model.state_dict(),
            "fp32": torch.cat([p.detach().flatten() for p in params]),
            "exp_avg": torch.cat([opt.state[p]["exp_avg"].flatten() for p in params]),
            "exp_avg_sq": torch.cat([opt.state[p]["exp_avg_sq"].flatten() for p in params])}
    torch.save(live, os.path.join(out, "live.pt"))
    fs.invalidate_cache()
    print(f"saved with FsspecWriter: {sorted(o.rsplit('/', 1)[1] for o in fs.ls(url.removeprefix('s3://')))}")


def check(mnt, out):
    live = torch.load(os.path.join(out, "live.pt"))
    rank = os.path.join(mnt, "target", LAYOUT, "rank_1")
    model = torch.load(os.path.join(rank, "model.pt"))
    assert list(model) == list(live["model"]), (list(model), list(live["model"]))
    for k, v in live["model"].items():
        assert torch.equal(model[k], v), f"model.pt {k} differs from the live model"
    optim = torch.load(os.path.join(rank, "optim.pt"))
    n = live["fp32"].numel()
    half = (n + 1) // 2  # rank 1 holds the second half (padded to an equal share)
    for field in ("fp32", "exp_avg", "exp_avg_sq"):
        got = optim[field].flatten()
        assert torch.equal(got[:n - half], live[field][half:]), f"optim.pt {field} is not rank 1's half"
    print(f"rank_1 of {LAYOUT}: model.pt = the live model ({len(model)} tensors), optim.pt = rank 1's half "
          f"of fp32, exp_avg, exp_avg_sq ({n - half} of {n} elements each), bit for bit")


if __name__ == "__main__":
    {"save": save, "check": check}[sys.argv[1]](*sys.argv[2:])
