#!/usr/bin/env bash
# A real S3 store for the tests: a one-node Ceph cluster (Debian 12's Ceph 16.2.15: one monitor,
# one OSD on memstore, radosgw's beast frontend on a loopback port) under a private directory,
# with one S3 user whose test keys are fixed. No mock: the S3 tests talk to the same RGW that
# serves buckets in production, SigV4 and all.
#
#   tests/s3/rgw.sh start [DIR]   start it, or reuse the one already running in DIR (idempotent)
#   tests/s3/rgw.sh env [DIR]     print AWS_ACCESS_KEY_ID=... lines to eval (a started cluster)
#   tests/s3/rgw.sh stop [DIR]    stop every daemon it started in DIR and remove DIR
#   tests/s3/rgw.sh status [DIR]  exit 0 when it is up and answers S3
#   tests/s3/rgw.sh check [DIR]   with curl's SigV4: bucket create, PUT, ranged GET (206), GET
#   tests/s3/rgw.sh exec DIR CMD...  run CMD with the env's variables set (fails when it is down)
#
# DIR defaults to $UCPFS_RGW_DIR, else /tmp/ucpfs-rgw. Everything lives there (config, monitor
# and OSD data, sockets, logs, pid files); nothing under /etc/ceph or /var/lib/ceph is read or
# written. The OSD keeps objects in memory (memstore), bounded by UCPFS_RGW_MEM_MIB (default
# 2048 MiB): enough for the tests, and no disk to clean. Authentication inside the cluster is off
# (auth_* = none): the daemons listen on 127.0.0.1 only. S3 clients still sign with SigV4.
set -euo pipefail

cmd=${1:-}
DIR=${2:-${UCPFS_RGW_DIR:-/tmp/ucpfs-rgw}}
ACCESS_KEY=UCPFSTESTACCESSKEY01
SECRET_KEY=ucpfs/test/secret/key/0123456789abcdefghij
REGION=us-east-1
MEM_MIB=${UCPFS_RGW_MEM_MIB:-2048}
START_TIMEOUT_S=${UCPFS_RGW_START_TIMEOUT_S:-240}

die() { echo "rgw.sh: $*" >&2; exit 1; }

need() {
  for b in ceph-mon ceph-osd radosgw radosgw-admin ceph monmaptool ceph-authtool curl python3; do
    command -v "$b" >/dev/null || die "$b not found: install Ceph with tests/install-deps.sh (ceph-mon ceph-osd radosgw ceph-common)"
  done
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# The pids of the daemons this directory's cluster started (from their pid files), alive or not.
daemon_pids() {
  local f
  for f in "$DIR"/run/*.pid; do
    [ -e "$f" ] && cat "$f"
  done
  return 0
}

# True when the process is alive and is a Ceph daemon using this directory's config (a pid file
# left by a dead cluster may name an unrelated process by now: never signal that one).
ours() {
  local pid=$1
  [ -d "/proc/$pid" ] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$DIR/ceph.conf"
}

s3_up() {
  [ -f "$DIR/env" ] || return 1
  local port
  port=$(sed -n 's/^UCPFS_RGW_PORT=//p' "$DIR/env")
  [ -n "$port" ] || return 1
  local pid
  for pid in $(daemon_pids); do ours "$pid" || return 1; done
  [ -n "$(daemon_pids)" ] || return 1
  # An anonymous GET of the service answers 200 with an empty bucket list.
  curl -s -o /dev/null -m 5 -w '%{http_code}' "http://127.0.0.1:$port/" | grep -q '^200$'
}

stop() {
  local pid
  local pids=()
  for pid in $(daemon_pids); do
    ours "$pid" && pids+=("$pid")
  done
  if ((${#pids[@]})); then
    # Asked politely first; the OSD's goodbye to the monitor can take 4 s, and nothing here is
    # worth keeping (memstore), so what still runs after 2 s is killed.
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 1 20); do
      local alive=0
      for pid in "${pids[@]}"; do [ -d "/proc/$pid" ] && alive=1; done
      ((alive)) || break
      sleep 0.1
    done
    for pid in "${pids[@]}"; do
      [ -d "/proc/$pid" ] && kill -KILL "$pid" 2>/dev/null || true
    done
  fi
  # Only a directory this script made (its marker inside) is removed.
  if [ -f "$DIR/.ucpfs-rgw" ]; then
    rm -rf "$DIR"
  fi
}

write_conf() {
  local fsid=$1 mon_port=$2 rgw_port=$3
  cat >"$DIR/ceph.conf" <<EOF
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$mon_port
public network = 127.0.0.0/8
ms bind ipv6 = false
ms bind msgr1 = false
auth cluster required = none
auth service required = none
auth client required = none
auth supported = none
run dir = $DIR/run
admin socket = $DIR/run/\$name.asok
pid file = $DIR/run/\$name.pid
log file = $DIR/log/\$name.log
log to stderr = false
err to stderr = true
keyring = $DIR/keyring
# One OSD: every pool holds one copy, and the CRUSH rule places it on any OSD.
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
# RGW makes about eight pools at start: few placement groups each, no autoscaler (there is no
# manager), so one OSD stays under its limit of placement groups.
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon max pg per osd = 1000
mon allow pool delete = true

[mon]
mon data = $DIR/mon/\$cluster-\$id
mon cluster log file = $DIR/log/cluster.log

[osd]
osd data = $DIR/osd/\$cluster-\$id
osd objectstore = memstore
# memstore keeps every object in this process's memory; bound it.
memstore device bytes = $((MEM_MIB * 1024 * 1024))
osd memory target = 536870912
osd max object size = 134217728

[client.rgw.a]
# radosgw asks for "secure" connections to the monitor by default, which auth none cannot give.
ms mon client mode = crc
# tcp_nodelay: else each body waits ~40 ms for the delayed ACK of its header (kept-open connections).
rgw frontends = beast endpoint=127.0.0.1:$rgw_port tcp_nodelay=1
rgw data = $DIR/rgw
rgw dns name = localhost
rgw enable usage log = false
rgw thread pool size = 64
# Deleted objects' data is collected after 2 hours by default: within a minute here, so tests
# that write and delete again and again stay inside the memstore bound.
rgw gc obj min wait = 60
rgw gc processor period = 60
EOF
}

# Waits until `$@` succeeds, at most `secs` seconds.
wait_for() {
  local what=$1 secs=$2
  shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "$what not ready after ${secs}s (logs in $DIR/log)"
    sleep 0.5
  done
}

start() {
  need
  if s3_up; then
    echo "rgw.sh: reusing the cluster in $DIR" >&2
    return 0
  fi
  # A cluster that is half up or was left by a crash: stop what of it runs, start afresh.
  stop
  [ -e "$DIR" ] && die "$DIR exists and is not this script's: give another directory"
  local t0=$SECONDS
  mkdir -p "$DIR"/{run,log,mon,osd/ceph-0,rgw}
  touch "$DIR/.ucpfs-rgw"
  local fsid mon_port rgw_port
  fsid=$(python3 -c 'import uuid; print(uuid.uuid4())')
  mon_port=$(free_port)
  rgw_port=$(free_port)
  write_conf "$fsid" "$mon_port" "$rgw_port"
  local conf=$DIR/ceph.conf
  ceph-authtool --create-keyring "$DIR/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
  monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$mon_port]" "$DIR/monmap" >/dev/null
  ceph-mon -c "$conf" --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/keyring"
  # The daemons must not inherit the lock's descriptor (9), or it stays held after this script.
  ceph-mon -c "$conf" -i a 9>&-
  wait_for "the monitor" 60 ceph -c "$conf" --connect-timeout 5 mon stat
  local osd_uuid
  osd_uuid=$(python3 -c 'import uuid; print(uuid.uuid4())')
  local id
  id=$(ceph -c "$conf" osd new "$osd_uuid")
  [ "$id" = 0 ] || die "osd new gave id $id, expected 0"
  ceph-osd -c "$conf" -i 0 --mkfs --osd-uuid "$osd_uuid" 2>>"$DIR/log/osd-mkfs.log"
  ceph-osd -c "$conf" -i 0 9>&- 2>>"$DIR/log/osd-start.log"
  wait_for "the OSD" 90 bash -c "ceph -c '$conf' --connect-timeout 5 osd dump | grep -q '^osd.0 up'"
  # radosgw connects to the cluster before it forks into the background: bound that wait.
  timeout 120 radosgw -c "$conf" -n client.rgw.a --client-mount-timeout 60 9>&- ||
    die "radosgw did not start (logs in $DIR/log)"
  echo "UCPFS_RGW_PORT=$rgw_port" >"$DIR/env"
  wait_for "radosgw" "$START_TIMEOUT_S" curl -sf -m 5 -o /dev/null "http://127.0.0.1:$rgw_port/"
  radosgw-admin -c "$conf" user create --uid ucpfs-test --display-name "ucpfs tests" \
    --access-key "$ACCESS_KEY" --secret-key "$SECRET_KEY" >/dev/null
  echo "rgw.sh: started in $DIR on http://127.0.0.1:$rgw_port in $((SECONDS - t0)) s" >&2
}

print_env() {
  s3_up || die "no cluster answers in $DIR: run tests/s3/rgw.sh start $DIR"
  local port
  port=$(sed -n 's/^UCPFS_RGW_PORT=//p' "$DIR/env")
  echo "AWS_ACCESS_KEY_ID=$ACCESS_KEY"
  echo "AWS_SECRET_ACCESS_KEY=$SECRET_KEY"
  echo "AWS_ENDPOINT_URL=http://127.0.0.1:$port"
  echo "AWS_REGION=$REGION"
}

# start and stop hold a lock beside DIR, so tests that start the shared cluster at once get one.
lock() {
  mkdir -p "$(dirname "$DIR")"
  exec 9>"$DIR.lock"
  flock -w "$((START_TIMEOUT_S + 120))" 9 || die "$DIR.lock: held by another start for too long"
}

# A smoke test with curl's own SigV4 signing (no ucpfs code): what the S3 tests rely on.
check() {
  eval "$(print_env)"
  local work
  work=$(mktemp -d)
  # shellcheck disable=SC2064
  trap "rm -rf '$work'" RETURN
  # The secret goes to curl in a config file, not on its command line (ps shows that).
  printf 'user = "%s:%s"\n' "$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY" >"$work/curlrc"
  local c=(curl -s -K "$work/curlrc" --aws-sigv4 "aws:amz:$AWS_REGION:s3" -H "x-amz-content-sha256: UNSIGNED-PAYLOAD")
  local bucket="rgw-check-$$" url="$AWS_ENDPOINT_URL"
  head -c 300000 /dev/urandom >"$work/obj"
  [ "$("${c[@]}" -o /dev/null -w '%{http_code}' -X PUT "$url/$bucket")" = 200 ] || die "check: bucket create failed"
  [ "$("${c[@]}" -o /dev/null -w '%{http_code}' -X PUT --data-binary @"$work/obj" "$url/$bucket/obj")" = 200 ] ||
    die "check: PUT failed"
  [ "$("${c[@]}" -o "$work/range" -w '%{http_code}' -r 1000-70999 "$url/$bucket/obj")" = 206 ] ||
    die "check: ranged GET did not answer 206"
  cmp -s -n 70000 -i 1000:0 "$work/obj" "$work/range" || die "check: ranged GET bytes differ"
  [ "$("${c[@]}" -o "$work/full" -w '%{http_code}' "$url/$bucket/obj")" = 200 ] || die "check: GET failed"
  cmp -s "$work/obj" "$work/full" || die "check: GET bytes differ"
  "${c[@]}" -o /dev/null -X DELETE "$url/$bucket/obj"
  "${c[@]}" -o /dev/null -X DELETE "$url/$bucket"
  echo "rgw.sh: check passed on $url (bucket create, PUT, ranged GET 206, GET)" >&2
}

case "$cmd" in
  start) lock; start ;;
  stop) lock; stop; rm -f "$DIR.lock" ;;
  env) print_env ;;
  status) s3_up ;;
  check) check ;;
  exec)
    [ $# -ge 3 ] || die "usage: rgw.sh exec DIR CMD..."
    env_lines=$(print_env)
    # Nothing of the machine's own AWS setup (a profile, a session token, another endpoint, its
    # ~/.aws files) may leak into what the tests talk to.
    unset AWS_PROFILE AWS_SESSION_TOKEN AWS_ENDPOINT_URL_S3 AWS_DEFAULT_REGION
    export AWS_CONFIG_FILE=/dev/null AWS_SHARED_CREDENTIALS_FILE=/dev/null
    while IFS= read -r line; do export "${line?}"; done <<<"$env_lines"
    exec "${@:3}" ;;
  *) die "usage: rgw.sh start|stop|env|status|check|exec [DIR]" ;;
esac
