#!/usr/bin/env bash
# Builds libfuse >= 3.17 from Debian's own source package (root), for the kernel's fast paths
# that Debian 12's libfuse 3.14 cannot reach: FUSE passthrough (3.17) and FUSE over io_uring
# (3.18). Called by tests/install-deps.sh; idempotent. Nothing of libfuse lives in the clone.
#
# - The source comes through a private apt directory (tests/debian-source.sh: `deb-src` entries
#   for the machine's own archives, sid and trixie added on the first; signature checked by apt).
# - Versions tried in order: sid's 3.18.x (io_uring), then trixie's 3.17.x (passthrough only);
#   UCPFS_LIBFUSE_VERSIONS overrides the list (Debian versions, e.g. "3.18.3-1 3.17.2-3").
# - Built with Debian's meson and ninja as a static library (no rpath, ucpfs carries it) into
#   $root/libfuse-<debian version>/, like the venv a cache outside the clone that CI reruns
#   reuse; a `.ucpfs-built` stamp marks a finished one. CMake picks the newest finished one
#   (UCPFS_LIBFUSE in the top CMakeLists.txt) and falls back to Debian 12's libfuse3-dev.
# - Any failure (no network, no source, a failed build) is reported and returns 0: the build
#   then uses libfuse 3.14 with the fast paths off, and says so.
# $root is ${UCPFS_LIBFUSE_ROOT:-/var/cache/ucpfs}. Prints the prefix built on its last line.
set -uo pipefail
root=${UCPFS_LIBFUSE_ROOT:-/var/cache/ucpfs}
versions=${UCPFS_LIBFUSE_VERSIONS:-"sid:3.18 trixie:3.17"}
say() { echo "build-libfuse: $*" >&2; }

built=$(ls -d "$root"/libfuse-*/.ucpfs-built 2>/dev/null | sort -V | tail -1)
if [ -n "$built" ]; then
  say "using $(dirname "$built") (built before)"
  dirname "$built"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  say "not root: cannot fetch the source; the build uses the system's libfuse (fast paths off)"
  exit 0
fi

. "$(dirname "$0")/debian-source.sh"
suites=""
for entry in $versions; do [[ $entry == *:* ]] && suites="$suites ${entry%%:*}"; done
[ -n "$suites" ] || suites="sid trixie"  # exact versions given: look where they come from
if ! debsrc_setup "$suites"; then
  say "the build uses the system's libfuse (fast paths off)"
  exit 0
fi

# Debian's meson (>= 0.60 is needed; bookworm's is 1.0) and libnuma (libfuse's io_uring needs it).
need=()
for p in meson ninja-build libnuma-dev liburing-dev dpkg-dev; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
if ((${#need[@]})); then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2 || true
fi

for entry in $versions; do
  suite=${entry%%:*} series=${entry#*:}
  version=$(debsrc_versions fuse3 | grep -E "^${series//./\\.}(\.|-)" | tail -1)
  # UCPFS_LIBFUSE_VERSIONS may name an exact Debian version instead of suite:series.
  [[ $entry == *-* && $entry != *:* ]] && version=$entry
  if [ -z "$version" ]; then
    say "no fuse3 $series source in $suite"
    continue
  fi
  prefix=$root/libfuse-$version
  work=$apt_dir/work/$version
  rm -rf "$work" "$prefix"
  say "fetching fuse3 $version (deb-src, signature checked by apt)"
  if ! debsrc_fetch "fuse3=$version" "$work"; then
    say "apt-get source fuse3=$version failed ($work/source.log)"
    continue
  fi
  src=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'fuse3-*' | head -1)
  # Only the library: no utilities (the system's fusermount3 stays), examples or tests; no
  # custom-io (ucpfs needs it only below 3.17). Static, so ucpfs needs nothing of the cache to run.
  uring_opt=()  # 3.18 and later (3.17 has no io_uring)
  grep -q "enable-io-uring" "$src/meson_options.txt" && uring_opt=(-Denable-io-uring=true)
  if ! (cd "$src" && /usr/bin/meson setup build --prefix="$prefix" --libdir=lib --buildtype=release \
          -Ddefault_library=static -Dutils=false -Dexamples=false -Dtests=false -Duseroot=false \
          -Dinitscriptdir= -Dudevrulesdir="$prefix/udev" "${uring_opt[@]}" \
          >"$work/meson.log" 2>&1 &&
        ninja -C build -j"$(nproc)" >>"$work/meson.log" 2>&1 &&
        ninja -C build install >>"$work/meson.log" 2>&1); then
    say "building fuse3 $version failed ($work/meson.log)"
    rm -rf "$prefix"
    continue
  fi
  uring=0
  grep -q '^#define HAVE_URING' "$src/build/fuse_config.h" 2>/dev/null && uring=1
  printf 'version=%s\nio_uring=%s\n' "$version" "$uring" >"$prefix/ucpfs-libfuse.txt"
  touch "$prefix/.ucpfs-built"
  rm -rf "$work"
  say "built libfuse $version into $prefix (io_uring support: $uring)"
  echo "$prefix"
  exit 0
done
say "no libfuse >= 3.17 source could be had; the build uses the system's libfuse 3.14 (fast paths off)"
exit 0
