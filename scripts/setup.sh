#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs stalwart with its dev tools; does nothing when already up to date.
# On a Linux x86_64 machine without an NVIDIA GPU it installs torch's CPU build (torch==X+cpu) when pip can find one
# (CI's machine has it on its disk): a 1.5 GB .venv against 5.3 GB with the CUDA build and the NVIDIA libraries a
# machine without a GPU never loads, and about a tenth less CPU for each `import torch` (2-core VM, 2026-11-28).
# Elsewhere, or when pip finds no CPU build, the pinned release as PyPI has it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=""
for candidate in python3.11 python3 python; do
  if command -v "$candidate" >/dev/null 2>&1 &&
     "$candidate" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 11) else 1)' 2>/dev/null; then
    PY="$candidate"; break
  fi
done
[ -n "$PY" ] || { echo "setup: Python 3.11 or newer is needed (python3.11 not found)" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $("$PY" --version)"
  # pip comes below, from uv: venv's own (ensurepip) took 10 s of the set-up's 53 (2-core VM, 2026-11-29).
  "$PY" -m venv --without-pip .venv
fi
ensure_pip() {  # .venv's own pip, as `python -m venv` gives it
  .venv/bin/python -m pip --version >/dev/null 2>&1 || .venv/bin/python -m ensurepip --quiet >/dev/null 2>&1
}
# uv installs the same set as pip in a tenth of the time: pip spends about a minute of CPU checking tens of
# thousands of release files against the wheel tags (2-core VM, 2026-11-29: 5 s with uv against 175-194 s).
# It comes from the machine's pip (pip >= 22.3 installs into another interpreter), else from .venv's own pip.
# uv does not read pip's configuration, so pip's find-links (where a machine keeps wheels such as torch's CPU
# build) are handed to it.
uv_install() {
  if ! "$PY" -m pip --python .venv/bin/python install --quiet --disable-pip-version-check uv >/dev/null 2>&1; then
    ensure_pip && .venv/bin/python -m pip install --quiet --disable-pip-version-check uv >/dev/null 2>&1 || return 1
  fi
  local links="${PIP_FIND_LINKS:-$("$PY" -m pip config get global.find-links 2>/dev/null || true)}"
  local args=(--python .venv/bin/python --quiet)
  for link in $links; do args+=(--find-links "$link"); done
  if [ $# -gt 0 ] && .venv/bin/uv pip install "${args[@]}" -e '.[dev]' "$@" 2>/dev/null; then
    :
  else
    [ $# -eq 0 ] || echo "setup: uv could not install $1; the pinned torch as PyPI has it instead"
    .venv/bin/uv pip install "${args[@]}" -e '.[dev]' || return 1
  fi
  .venv/bin/uv pip install "${args[@]}" pip >/dev/null 2>&1 || ensure_pip || true
}
# Bytecode for what the suite's processes import, written once here by importing it: where PYTHONDONTWRITEBYTECODE
# is set (as on the machines the suite runs on) no interpreter keeps what it compiles, and an uncompiled torch cost
# each new one 9 s of CPU to import instead of 3.4 s. Two processes, one per half, on two cores: about 20 s, against
# 34 s for uv's --compile-bytecode of every installed package (2-core VM, 2026-11-29). A module left out is
# compiled by each process that imports it, as before.
warm_imports() {
  local torch_side="import torch, torch._dynamo, torch.distributed.run, torch.distributed.fsdp, torch.distributed.checkpoint
import torch.distributed.tensor, stalwart.cli, stalwart.job, stalwart.supervisor.cli
from stalwart.supervisor.worker_host import import_training_side
import_training_side()"
  local tools_side="import numpy, pytest, xdist, matplotlib.pyplot, s3fs, boto3, moto.server, rich, prometheus_client"
  env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c "$torch_side" >/dev/null 2>&1 &
  local first=$!
  env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c "$tools_side" >/dev/null 2>&1 || true
  wait "$first" || true
}
stamp=".venv/.stalwart-installed"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  pin="$(.venv/bin/python -c '
import tomllib
dev = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["dev"]
print(next(d for d in dev if d.startswith("torch==")))')"
  cpu=()
  if [ "$(uname -sm)" = "Linux x86_64" ] && ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
    cpu=("$pin+cpu")
  fi
  echo "setup: installing stalwart and its dev dependencies into .venv (${cpu[0]:-$pin})"
  if ! uv_install "${cpu[@]}"; then
    echo "setup: uv could not install them; pip instead (about 3 min on a 2-core machine)"
    ensure_pip
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
    log="$(mktemp)"
    if [ ${#cpu[@]} -eq 0 ] ||
       ! .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]' "${cpu[@]}" 2>"$log"; then
      [ ${#cpu[@]} -eq 0 ] || echo "setup: no CPU build of torch found ($(grep -m1 ERROR "$log" || true)); installing $pin"
      .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
    fi
    rm -f "$log"
  else
    warm_imports  # pip compiles what it installs; uv does not
  fi
  # torchtitan, for stalwart.integrations.torchtitan and its tests, with the modules those import and without its
  # declared dependencies: they are its training entry point's (wandb, tensorboard, datasets with pandas and
  # pyarrow; datasets caps fsspec below the s3fs the object-storage tests run), and its Trainer needs triton (1 GB)
  # and a GPU all the same, so on CPU the tests run its components and its loop (tests/test_torchtitan.py).
  titan=(torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 spmd-types==0.2.3 torchdata==0.11.0)
  if ! { [ -x .venv/bin/uv ] && .venv/bin/uv pip install --python .venv/bin/python --quiet --no-deps "${titan[@]}"; } &&
     ! .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "${titan[@]}"; then
    # No stamp: the next run tries again, and meanwhile tests/test_torchtitan.py is skipped.
    echo "setup: torchtitan could not be installed; tests/test_torchtitan.py is skipped until it is" >&2
  else
    echo "$want" > "$stamp"
  fi
fi
