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
  "$PY" -m venv .venv
fi
# uv installs the same set as pip in a tenth of the time: pip spends about a minute of CPU checking tens of
# thousands of release files against the wheel tags (2-core VM, 2026-11-29: 40 s with uv against 175-194 s).
# uv does not read pip's configuration, so pip's find-links (where a machine keeps wheels such as torch's CPU
# build) are handed to it. --compile-bytecode: with PYTHONDONTWRITEBYTECODE set, as on the machines the suite
# runs on, an uncompiled torch costs every new interpreter 9 s of CPU to import instead of 3.4 s.
uv_install() {
  .venv/bin/python -m pip install --quiet --disable-pip-version-check uv >/dev/null 2>&1 || return 1
  local links="${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}"
  local args=(--python .venv/bin/python --quiet --compile-bytecode)
  for link in $links; do args+=(--find-links "$link"); done
  if [ $# -gt 0 ] && .venv/bin/uv pip install "${args[@]}" -e '.[dev]' "$@" 2>/dev/null; then
    return 0
  fi
  [ $# -eq 0 ] || echo "setup: uv could not install $1; the pinned torch as PyPI has it instead"
  .venv/bin/uv pip install "${args[@]}" -e '.[dev]'
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
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
    log="$(mktemp)"
    if [ ${#cpu[@]} -eq 0 ] ||
       ! .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]' "${cpu[@]}" 2>"$log"; then
      [ ${#cpu[@]} -eq 0 ] || echo "setup: no CPU build of torch found ($(grep -m1 ERROR "$log" || true)); installing $pin"
      .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
    fi
    rm -f "$log"
  fi
  echo "$want" > "$stamp"
fi
