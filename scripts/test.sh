#!/usr/bin/env bash
# Run the checks and the test suite. Creates .venv and installs ppserve[test] on first use.
#   scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/venv.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
