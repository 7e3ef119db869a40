#!/usr/bin/env bash
# A DCP checkpoint in object storage, mounted from s3:// (+ s3_dcp_job.py, torch 2.13, s3fs):
#   1. starts an S3 store: a one-node Ceph RGW on loopback (tests/s3/rgw.sh; stopped on exit);
#   2. a training step saves its model and AdamW state to s3://BUCKET/run/step-1 with torch's
#      own S3 path (dcp.save through FsspecWriter, s3fs);
#   3. `ucpfs index s3://...` builds the index once and keeps it in the bucket (.ucpfs/);
#   4. a node mounts the prefix with --read-only-index (the bucket's index, nothing written) and
#      a ZeRO-1 layout over 2 ranks; torch.load of rank 1's files equals the live state, and the
#      mount's S3 client GETs only about rank 1's share of the checkpoint (stats.json);
#   5. unmounts and stops the store.
# Exits non-zero if a check fails.
. "$(dirname "$0")/common.sh" s3-dcp
need_torch2
rgw=$work/rgw
trap 'tests/s3/rgw.sh stop "$rgw" >/dev/null 2>&1 || true; cleanup' EXIT
url=s3://ucpfs-example/run/step-1 layout=tp1_pp1_dp2_zero1

echo "== 1. an S3 store: tests/s3/rgw.sh start $rgw"
tests/s3/rgw.sh start "$rgw"
eval "$(tests/s3/rgw.sh env "$rgw")"
export AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_ENDPOINT_URL AWS_REGION
export XDG_CACHE_HOME=$work/cache   # ucpfs's local copy of the index goes here

echo
echo "== 2. dcp.save to $url through torch's FsspecWriter (s3fs)"
"$PY2" mount-examples/s3_dcp_job.py save "$url" "$work"

echo
echo "== 3. ucpfs index $url   (once; kept in the bucket)"
"$UCPFS" index "$url" -q

echo
echo "== 4. a node: ucpfs mount $url MNT --layout=$layout --read-only-index"
mkdir "$work/mnt"
"$UCPFS" mount "$url" "$work/mnt" --layout=$layout --read-only-index
ls -l "$work/mnt/target/$layout/rank_1"
"$PY2" mount-examples/s3_dcp_job.py check "$work/mnt" "$work"
"$PY2" - "$work/mnt" "$UCPFS" "$url" "$layout" <<'PY'
import json, subprocess, sys
mnt, ucpfs, url, layout = sys.argv[1:]
s3 = json.load(open(f"{mnt}/.ucpfs/stats.json"))["s3"]
plan = json.loads(subprocess.run([ucpfs, "plan", url, f"--layout={layout}", "--json", "--read-only-index"],
                                 check=True, capture_output=True, text=True).stdout)
need = plan["ranks"][1]["read_bytes"]
print(f"the mount's S3 client: {s3['requests']} requests, {s3['bytes_get']} bytes GET "
      f"(rank 1 needs {need} of the checkpoint's {plan['totals']['distinct_bytes']} tensor bytes)")
assert s3["bytes_get"] <= 1.1 * need, "the mount GET more than rank 1's share"
PY
"$UCPFS" umount "$work/mnt"
echo "s3-dcp: done in ${SECONDS} s"
