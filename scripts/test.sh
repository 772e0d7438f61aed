#!/usr/bin/env bash
# What CI runs: lint (ruff), format check, types (mypy), then the whole test suite.
# --quick: the same checks and the tests not marked slow (still real processes; a few minutes), for development.
# Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/setup.sh
quick=()
if [ "${1:-}" = "--quick" ]; then
  shift
  quick=(-m "not slow")
fi
echo "== ruff (set-up took $((SECONDS - start)) s)"; .venv/bin/ruff check src tests
echo "== ruff format"; .venv/bin/ruff format --check src tests
echo "== mypy (at $((SECONDS - start)) s)"; .venv/bin/mypy
# Three tests at a time (pytest-xdist): each is a few processes that spend much of their time waiting. On the 2-core
# VM (2026-11-27, trees one commit apart) two workers took 755 s; three took 646 s with the CPUs 3% idle (vmstat),
# every test passing (677-701 s in later fresh-clone runs). (Before the zygote and the absorbing waits, more workers gained little and made
# timing-sensitive tests flaky.) worksteal: an idle worker takes queued tests from a busy one, so no long test is
# left to run alone at the end.
echo "== pytest (at $((SECONDS - start)) s)"; .venv/bin/python -m pytest -n 3 --dist worksteal --durations=15 "${quick[@]}" "$@"
