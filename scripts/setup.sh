#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs stalwart with its dev tools; does nothing when already up to date.
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
stamp=".venv/.stalwart-installed"
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing stalwart and its dev dependencies into .venv (torch==2.13.0)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
  echo "$want" > "$stamp"
fi
