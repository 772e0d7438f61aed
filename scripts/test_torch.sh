#!/usr/bin/env bash
# The tests on another torch than the pinned one. The package accepts torch>=2.4 while .venv pins 2.13.0, and an
# older torch differs in private APIs that stalwart builds on (torch elastic's agent, the store, weights_only
# loading): `bash scripts/test_torch.sh 2.4.1` creates .venv-torch-2.4.1 with that torch from PyPI (on x86_64 a
# CUDA build of about 5 GB, which runs on the CPU), installs stalwart and its test tools there, and runs the tests
# not marked slow. `--all` runs every test; other arguments go to pytest. Lint and types are checked on the
# pinned torch only (scripts/test.sh). Can be run again at any time: an installed environment is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash scripts/test_torch.sh VERSION [--all] [pytest arguments], e.g. 2.4.1"
version="${1:-}"
[[ "$version" =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]] || { echo "test_torch: $usage" >&2; exit 2; }
shift
quick=(-m "not slow")
if [ "${1:-}" = "--all" ]; then
  shift
  quick=()
fi
command -v python3.11 >/dev/null 2>&1 || { echo "test_torch: python3.11 not found" >&2; exit 1; }
venv=".venv-torch-$version"
if [ ! -x "$venv/bin/python" ]; then
  echo "test_torch: creating $venv"
  python3.11 -m venv "$venv"
fi
stamp="$venv/.stalwart-installed"
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "test_torch: installing torch==$version (several GB on x86_64), stalwart and the test tools into $venv"
  # The dev extra without the pinned torch and the lint and type tools.
  mapfile -t tools < <("$venv/bin/python" - <<'EOF'
import tomllib
dev = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["dev"]
print("\n".join(d for d in dev if not d.startswith(("torch", "ruff", "mypy"))))
EOF
)
  # uv as in scripts/setup.sh (minutes faster than pip's resolving); pip where uv cannot be had or fails.
  if ! { "$venv/bin/python" -m pip install --quiet --disable-pip-version-check uv >/dev/null 2>&1 &&
         "$venv/bin/uv" pip install --python "$venv/bin/python" --quiet --compile-bytecode \
           -e . "${tools[@]}" "torch==$version"; }; then
    echo "test_torch: uv could not install them; pip instead"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e . "${tools[@]}" "torch==$version"
  fi
  echo "$want" > "$stamp"
fi
echo "== pytest on torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
"$venv/bin/python" -m pytest -n 2 --dist worksteal -p no:cacheprovider "${quick[@]}" "$@"
