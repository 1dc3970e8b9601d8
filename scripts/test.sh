#!/usr/bin/env bash
# Run the checks and the test suite. Creates .venv and installs ppserve[test] on first use.
#   scripts/test.sh                    lint (ruff), type checks (mypy), then every test
#   scripts/test.sh [pytest args...]   only those tests (e.g. tests/server/test_cli.py, -m "not slow"), no lint
#   scripts/test.sh --checks-only      lint and type checks, no tests
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/venv.sh test
checks() {
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  # The view of the installed layout that mypy checks (see [tool.mypy] in pyproject.toml).
  mkdir -p build/typecheck/ppserve
  for pkg in engine scheduler transport server; do ln -sfn "../../../$pkg" "build/typecheck/ppserve/$pkg"; done
  ln -sfn ../../../ppserve/__init__.py build/typecheck/ppserve/__init__.py
  .venv/bin/mypy
}
if [ "$#" -eq 0 ]; then
  checks
elif [ "$1" = "--checks-only" ]; then
  checks
  exit 0
fi
exec .venv/bin/python -m pytest "$@"
