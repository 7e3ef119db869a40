#!/usr/bin/env bash
# Builds a libcurl for ucpfs's S3 client from Debian's own source package of the curl the machine
# has installed (root): HTTP and HTTPS (OpenSSL) only. Called by tests/install-deps.sh;
# idempotent. Nothing of curl lives in the clone.
#
# Why: Debian's libcurl4 brings about 30 libraries (Kerberos, LDAP, RTMP, SSH, IDN, PSL, HTTP/2,
# brotli, zstd, GnuTLS for LDAP...) that an S3 client never uses. ucpfs loads libcurl when it
# first meets an s3:// source (core/io/curl_api.h), so every s3:// mount's start loaded them
# (about 15 ms of a cold `ucpfs mount`, 0.06 s), and a mount daemon running as root carried them.
# This one needs libssl, libcrypto and libc.
#
# - The source: the version of the machine's libcurl4 (its security fixes included), through a
#   private apt directory (tests/debian-source.sh; signature checked by apt), with Debian's
#   patches applied by `apt-get source`; configured as Debian configures its OpenSSL flavour for
#   the parts kept (CA bundle and path, threaded resolver), every other protocol and optional
#   library off.
# - Built as a shared library into $root/libcurl-<debian version>/ (a cache outside the clone,
#   like the venv; CI reruns reuse it); a `.ucpfs-built` stamp marks a finished one. CMake picks
#   the newest finished one (UCPFS_CURL in the top CMakeLists.txt); `cmake --install` copies it
#   beside the binary's lib directory.
# - Any failure (no network, no source, a failed build) is reported and returns 0: ucpfs then
#   loads the system's libcurl.so.4, as before.
# $root is ${UCPFS_CURL_ROOT:-/var/cache/ucpfs}. Prints the prefix built on its last line.
set -uo pipefail
root=${UCPFS_CURL_ROOT:-/var/cache/ucpfs}
say() { echo "build-curl: $*" >&2; }

version=$(dpkg-query -W -f='${Version}' libcurl4 2>/dev/null)
if [ -z "$version" ]; then
  say "libcurl4 is not installed; ucpfs loads whatever libcurl.so.4 the system has"
  exit 0
fi
prefix=$root/libcurl-$version
if [ -f "$prefix/.ucpfs-built" ]; then
  say "using $prefix (built before)"
  echo "$prefix"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  say "not root: cannot fetch the source; ucpfs loads the system's libcurl.so.4"
  exit 0
fi

. "$(dirname "$0")/debian-source.sh"
if ! debsrc_setup ""; then
  say "ucpfs loads the system's libcurl.so.4"
  exit 0
fi
need=()
for p in libssl-dev dpkg-dev; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
if ((${#need[@]})); then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2 || true
fi

work=$apt_dir/work/curl-$version
rm -rf "$work" "$prefix"
say "fetching curl $version (deb-src, signature checked by apt)"
if ! debsrc_fetch "curl=$version" "$work"; then
  say "apt-get source curl=$version failed ($work/source.log); ucpfs loads the system's libcurl.so.4"
  exit 0
fi
src=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'curl-*' | head -1)
log=$work/build.log
# Only the library, shared (loaded with dlopen), HTTP and HTTPS; no headers (ucpfs compiles
# against libcurl4-openssl-dev's, the same version's).
if ! (mkdir -p "$src/ucpfs-build" && cd "$src/ucpfs-build" &&
      ../configure --prefix="$prefix" --libdir="$prefix/lib" --enable-shared --disable-static \
        --with-openssl --with-ca-path=/etc/ssl/certs --with-ca-bundle=/etc/ssl/certs/ca-certificates.crt \
        --enable-threaded-resolver --enable-ipv6 \
        --disable-ftp --disable-file --disable-ldap --disable-ldaps --disable-rtsp --disable-dict \
        --disable-telnet --disable-tftp --disable-pop3 --disable-imap --disable-smb --disable-smtp \
        --disable-gopher --disable-mqtt --disable-manual --disable-ntlm-wb --disable-docs \
        --without-zlib --without-brotli --without-zstd --without-libidn2 --without-libpsl \
        --without-nghttp2 --without-libssh2 --without-libssh --without-librtmp --without-gssapi \
        >"$log" 2>&1 &&
      make -C lib -j"$(nproc)" >>"$log" 2>&1 &&
      make -C lib install >>"$log" 2>&1); then
  say "building curl $version failed ($log); ucpfs loads the system's libcurl.so.4"
  rm -rf "$prefix"
  exit 0
fi
rm -f "$prefix"/lib/*.la
printf 'version=%s\n' "$version" >"$prefix/ucpfs-libcurl.txt"
touch "$prefix/.ucpfs-built"
rm -rf "$work"
say "built libcurl $version (HTTP and HTTPS only) into $prefix"
echo "$prefix"
exit 0
