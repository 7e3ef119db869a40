#!/usr/bin/env bash
# An interpreter that is Debian 12's own /usr/bin/python3 (CPython 3.11.2) running the pinned
# packages of tests/requirements.txt (torch 2.13, DeepSpeed, Megatron-Core): the producers of the
# e2e tests then pickle exactly as a cluster on Debian's Python does. Python 3.11.2 pickles
# enums by name (`getattr(ZeroStageEnum, 'optimizer_states')`), later 3.11 releases by value.
#
# The environment is a venv of /usr/bin/python3 without pip whose site-packages holds one .pth
# that adds the shared venv's site-packages (tests/install-python.sh) with site.addsitedir; both
# are CPython 3.11 (one ABI), so the same wheels serve both and no package is installed twice.
# Debian's own dist-packages (torch 1.13) stay out: a venv without system site-packages.
# The shared venv comes first (tests/install-python.sh; UCPFS_TORCH2_PYTHON names another). Lives outside the clone, keyed by the shared venv's path: ${UCPFS_VENV_ROOT:-/var/cache/ucpfs}/
# venv-debian-<hash>. Idempotent and flocked; prints the interpreter's path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
# The shared venv must exist already (tests/install-python.sh makes it; this script never does).
shared_py=${UCPFS_TORCH2_PYTHON:-.venv/bin/python}
if [ ! -x "$shared_py" ]; then
  echo "install-python-debian: no $shared_py; run tests/install-python.sh first" >&2
  exit 1
fi
shared_site=$("$shared_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shared_site=$(readlink -f "$shared_site")
key=$(printf '%s' "$shared_site" | sha256sum | cut -c1-16)
venv=${UCPFS_VENV_ROOT:-/var/cache/ucpfs}/venv-debian-$key
pth="$venv/lib/python3.11/site-packages/ucpfs-shared-venv.pth"
want="import site; site.addsitedir('$shared_site')"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ -x "$venv/bin/python" ] && [ "$(cat "$pth" 2>/dev/null)" = "$want" ]; then
  echo "$venv/bin/python"
  exit 0
fi
if ! /usr/bin/python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "install-python-debian: /usr/bin/python3 is not CPython 3.11" >&2
  exit 1
fi
rm -rf "$venv"
/usr/bin/python3 -m venv --without-pip "$venv"
printf '%s\n' "$want" >"$pth.tmp"
mv "$pth.tmp" "$pth"
got=$("$venv/bin/python" -c 'import sys, torch, deepspeed; print(sys.executable, torch.__version__)')
case "$got" in
  *" 2.13.0"*) ;;
  *) rm -rf "$venv"; echo "install-python-debian: expected torch 2.13.0, found: $got" >&2; exit 1 ;;
esac
echo "$venv/bin/python"
