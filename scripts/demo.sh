#!/usr/bin/env bash
# The main job on its embedded defaults: see README.md. Extra arguments go to `stalwart demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/stalwart demo "$@"
