#!/usr/bin/env bash
# Creates the virtual environment with the pinned packages of tests/requirements.txt: torch 2.13
# (CPU), numpy, safetensors, deepspeed (no ops built), megatron-core and the other producers.
# The environment lives outside the clone, keyed by the requirements' hash
# (${UCPFS_VENV_ROOT:-/var/cache/ucpfs}/venv-<hash>), so every clone on a machine (CI's fresh
# ones included) reuses it; the clone's git-ignored .venv is a symlink to it. UCPFS_VENV names
# another place instead (no symlink is made). Idempotent: a stamp with the requirements' hash
# skips a venv already current. Prints the venv's python path on its last line.
#
# torch comes first, from the CPU wheel on the machine (find-links /opt/wheels), then everything
# else with that torch as a hard constraint, so no package can pull another torch; deepspeed is
# built from its sdist against the installed torch (no build isolation, DS_BUILD_OPS=0).
set -euo pipefail
cd "$(dirname "$0")/.."
req=tests/requirements.txt
want=$(sha256sum "$req" | cut -d' ' -f1)
venv=${UCPFS_VENV:-${UCPFS_VENV_ROOT:-/var/cache/ucpfs}/venv-${want:0:16}}
stamp="$venv/.ucpfs-requirements"
link_clone_venv() {
  # The clone's .venv names the shared environment (tests and examples use .venv/bin/python).
  [ -n "${UCPFS_VENV:-}" ] && return 0
  if [ -L .venv ] || [ ! -e .venv ]; then
    ln -sfn "$venv" .venv
  else
    echo "install-python: .venv is a directory of its own; leaving it (remove it to use $venv)" >&2
  fi
}
# One creator at a time: clones of one machine share the environment.
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  link_clone_venv
  echo "$venv/bin/python"
  exit 0
fi

# The base interpreter must be CPython 3.11: the torch wheel on the machines is cp311.
base=""
for cand in "${UCPFS_BASE_PYTHON:-}" python3.11 python3 /usr/bin/python3; do
  [ -n "$cand" ] || continue
  exe=$(command -v "$cand" 2>/dev/null) || continue
  if "$exe" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    base=$exe
    break
  fi
done
if [ -z "$base" ]; then
  # Debian's python3 lacks venv/ensurepip until python3-venv is installed.
  echo "install-python: no CPython 3.11 with venv; installing python3-venv" >&2
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends python3-venv >&2
  base=/usr/bin/python3
fi

echo "install-python: creating $venv from $base (torch 2.13 and the pinned producers)" >&2
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
"$base" -m venv "$venv"
py="$venv/bin/python"
pip_args=(-q --disable-pip-version-check --no-input)
[ -d /opt/wheels ] && pip_args+=(--find-links /opt/wheels)
torch_pin=$(grep -E '^torch==' "$req")
"$py" -m pip install "${pip_args[@]}" --upgrade pip setuptools wheel >&2
"$py" -m pip install "${pip_args[@]}" "$torch_pin" "$(grep -E '^numpy==' "$req")" >&2
constraints="$venv/constraints.txt"
echo "$torch_pin" >"$constraints"
DS_BUILD_OPS=0 DS_BUILD_AIO=0 DS_BUILD_CUTLASS_OPS=0 DS_BUILD_EVOFORMER_ATTN=0 \
  "$py" -m pip install "${pip_args[@]}" --no-build-isolation -c "$constraints" -r "$req" >&2
got=$("$py" -c 'import torch; print(torch.__version__)')
case "$got" in
  2.13.0*) ;;
  *) echo "install-python: expected torch 2.13.0 in $venv, found $got" >&2; exit 1 ;;
esac
"$py" -c 'import deepspeed, megatron.core, safetensors, numpy, transformers, accelerate, lightning, torchtune, torchtitan' >&2
echo "$want" >"$stamp"
link_clone_venv
echo "$py"
