"""Helpers for the tests that save checkpoints into a real S3 store (tests/s3/rgw.sh) with torch's
own S3 path: torch.distributed.checkpoint's FsspecWriter over s3fs (fsspec), the way a training job
writes DCP checkpoints to object storage. The endpoint and credentials are the AWS variables that
`rgw.sh exec` sets; nothing here talks S3 itself."""
import contextlib
import os
import time


def s3fs_options():
    """s3fs's keyword arguments for the store in the AWS variables (FsspecWriter and
    s3fs.S3FileSystem take the same ones)."""
    assert os.environ.get("AWS_ENDPOINT_URL"), "run under tests/s3/rgw.sh exec DIR"
    return {"key": os.environ["AWS_ACCESS_KEY_ID"], "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"],
                              "region_name": os.environ.get("AWS_REGION", "us-east-1")}}


def filesystem():
    import s3fs
    return s3fs.S3FileSystem(**s3fs_options())


def make_bucket(fs, bucket):
    # Not fs.mkdir: s3fs sends the client's region as LocationConstraint, which RGW's default
    # zonegroup refuses ("us-east-1" is no zonegroup name); a plain CreateBucket is what AWS
    # expects for us-east-1 too.
    fs.call_s3("create_bucket", Bucket=bucket)
    fs.invalidate_cache()


def remove_bucket(fs, bucket):
    if fs.exists(bucket):
        fs.rm(bucket, recursive=True)


@contextlib.contextmanager
def temporary_bucket(fs, stem):
    """A new bucket `STEM-PID-TIME` (its name yielded), removed with its objects on the way out."""
    bucket = f"{stem}-{os.getpid()}-{int(time.time()) % 100000}"
    make_bucket(fs, bucket)
    try:
        yield bucket
    finally:
        remove_bucket(fs, bucket)


@contextlib.contextmanager
def cache_home(path):
    """XDG_CACHE_HOME (where ucpfs keeps its S3 index cache) set to `path` for the commands
    started inside, as on a machine of their own."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = path
    try:
        yield path
    finally:
        if old is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = old


def dcp_save_s3(state_dict, url):
    """dcp.save of `state_dict` to s3://BUCKET/PREFIX through torch's FsspecWriter (one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    dcp.save(state_dict, storage_writer=FsspecWriter(url, **s3fs_options()))


def train_tiny(seed=0, sizes=(256, 512, 128)):
    """A tiny MLP after one AdamW step: (model, optimizer) with real Adam moments."""
    import torch
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(sizes[0], sizes[1]), torch.nn.ReLU(),
                                torch.nn.Linear(sizes[1], sizes[2]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, sizes[0])).sum().backward()
    opt.step()
    return model, opt


def training_state(model, opt):
    """What a DCP training job saves: the model and the optimizer keyed by parameter names
    (torch.distributed.checkpoint.state_dict.get_state_dict, as torchtitan does)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}
