#!/usr/bin/env bash
# What CI runs: lint (ruff), format check, types (mypy), then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff"; .venv/bin/ruff check src tests bench
echo "== ruff format"; .venv/bin/ruff format --check src tests bench
echo "== mypy"; .venv/bin/mypy
echo "== pytest"; .venv/bin/python -m pytest "$@"
