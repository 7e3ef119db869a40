#!/usr/bin/env bash
# `cmake --install` of the build (README's install line) into a DESTDIR, run from there against
# the tests' RGW (run under tests/s3/rgw.sh exec): the installed binary names its libcurl in
# --version and loads it for an s3:// source — the HTTP(S)-only copy installed beside it when the
# build chose one (tests/build-curl.sh), with none of Debian libcurl4's protocol libraries —
# and reads a real object through it: `ucpfs inspect` of a safetensors file PUT into the bucket
# says what it says of a local copy.
# Usage: install_test.sh BUILD_DIR S3_PUT_TREE SAFETENSORS_FILE
set -euo pipefail
build=$1 put=$2 file=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The mount helper links go under DESTDIR too (cli/CMakeLists.txt): nothing outside $tmp.
DESTDIR=$tmp/root cmake --install "$build" --prefix /usr/local >"$tmp/install.log"
bin=$tmp/root/usr/local/bin/ucpfs
[ -x "$bin" ] || { echo "FAIL: no $bin"; cat "$tmp/install.log"; exit 1; }
# Installed without debug sections, its symbol table kept (backtraces name functions).
# (grep -c reads all its input: with pipefail, grep -q's early exit would fail the pipe.)
if [ "$(readelf -S --wide "$bin" | grep -c '\.debug_info')" != 0 ]; then
  echo "FAIL: $bin was installed with its debug sections ($(stat -c %s "$bin") bytes)"; exit 1
fi
[ "$(nm "$bin" | grep -c 'FileSource')" != 0 ] || { echo "FAIL: $bin has no symbol table"; exit 1; }
echo "installed $(stat -c %s "$bin") bytes (build: $(stat -c %s "$build/cli/ucpfs"))"
version=$("$bin" --version)
echo "$version"
if grep -q 'lib/ucpfs/libcurl.so.4' "$tmp/install.log"; then
  want="$tmp/root/usr/local/bin/../lib/ucpfs/libcurl.so.4"
  [[ $version == *"libcurl for s3://: $want (HTTP and HTTPS only)"* ]] ||
    { echo "FAIL: --version does not name the installed copy $want"; exit 1; }
else
  want=libcurl.so.4
  [[ $version == *"libcurl for s3://: the system's libcurl.so.4"* ]] ||
    { echo "FAIL: --version names no libcurl"; exit 1; }
  echo "no HTTP(S)-only libcurl was built here (tests/build-curl.sh): the system's is used"
fi
bucket=ucpfs-install-$$
"$put" "$file" "s3://$bucket/w/model.safetensors"
LD_DEBUG=files "$bin" inspect "s3://$bucket/w" >"$tmp/inspect.out" 2>"$tmp/ld.log" ||
  { echo "FAIL: inspect"; cat "$tmp/inspect.out"; grep -v '^ *[0-9]*:' "$tmp/ld.log"; exit 1; }
# What it read through that libcurl (headers by ranged GETs) equals a local copy's, path aside.
mkdir -p "$tmp/local/w"
cp "$file" "$tmp/local/w/model.safetensors"
"$bin" inspect "$tmp/local/w" >"$tmp/local.out" 2>/dev/null
if ! diff <(tail -n +2 "$tmp/inspect.out") <(tail -n +2 "$tmp/local.out") ||
   [ "$(head -1 "$tmp/inspect.out" | cut -d: -f3-)" != "$(head -1 "$tmp/local.out" | cut -d: -f2-)" ] ||
   ! grep -q "weights (safetensors)" "$tmp/local.out"; then
  echo "FAIL: inspect of the object differs from the local copy's"
  cat "$tmp/inspect.out" "$tmp/local.out"
  exit 1
fi
loaded=$(grep -o 'file=[^ ]*libcurl[^ ]*' "$tmp/ld.log" | head -1)
echo "loaded: $loaded"
if [ "$want" != libcurl.so.4 ]; then
  [ "$loaded" = "file=$want" ] || { echo "FAIL: loaded $loaded, not $want"; exit 1; }
  if grep -E 'file=[^ ]*(libldap|libkrb5|libgssapi|librtmp|libssh|libnghttp2|libidn2|libpsl|libbrotli|libgnutls)' "$tmp/ld.log"; then
    echo "FAIL: an unused protocol's library was loaded"
    exit 1
  fi
fi
echo "install: ok"
