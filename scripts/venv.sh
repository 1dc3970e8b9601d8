#!/usr/bin/env bash
# Create .venv on first use and install ppserve into it (editable), with optional extras.
#   scripts/venv.sh [extras]      e.g. scripts/venv.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".${1:+[$1]}"
