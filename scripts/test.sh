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
# stalwart's own modules compiled once here: where PYTHONDONTWRITEBYTECODE is set (as on the machines the suite
# runs on) no interpreter keeps what it compiles, and each of the suite's ~170 new ones paid about 0.6 s of CPU
# compiling them again (2-core VM, 2026-11-29). compileall writes whatever that variable says; it skips what is
# up to date. A file that does not compile is ruff's and pytest's to report, below.
.venv/bin/python -m compileall -q -j 0 src >/dev/null 2>&1 || true
# pytest's rewrite of the tests' asserts, once instead of in each of the four workers (scripts/precompile_tests.py).
.venv/bin/python scripts/precompile_tests.py tests || true
echo "== ruff (set-up took $((SECONDS - start)) s)"; .venv/bin/ruff check src tests
echo "== ruff format"; .venv/bin/ruff format --check src tests
# mypy runs beside the tests, not before them: it is one process on one core for 25-35 s, which in front of the
# tests is that much wall time and beside them about half of it (the tests keep both cores busy). Its result is
# printed, and counts, when the tests end.
types="$(mktemp)"
trap 'rm -f "$types"' EXIT
.venv/bin/mypy >"$types" 2>&1 &
mypy_pid=$!
# Four tests at a time (pytest-xdist): each is a few processes that spend much of their time waiting. On the 2-core
# VM two workers took 755 s and three 646 s (2026-11-27, trees one commit apart); on 2026-11-30, from fresh clones of
# trees a commit apart, three took 840 s of pytest with the CPUs about a fifth idle and four 728 s with them busy
# (user and system time the same: the suite is bound by its CPU, about 1,400 s of it). (Before the zygote and the
# absorbing waits, more workers gained little and made timing-sensitive tests flaky; the tests assert what must
# hold, whatever the load.) worksteal: an idle worker takes queued tests from a busy one, so no long test is left
# to run alone at the end.
echo "== pytest (at $((SECONDS - start)) s; mypy beside it)"
tests=0
.venv/bin/python -m pytest -n 4 --dist worksteal --durations=15 "${quick[@]}" "$@" || tests=$?
typed=0
wait "$mypy_pid" || typed=$?
echo "== mypy (at $((SECONDS - start)) s)"; cat "$types"
[ "$typed" -eq 0 ] || { echo "== mypy failed"; exit "$typed"; }
exit "$tests"
