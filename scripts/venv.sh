#!/usr/bin/env bash
# Create .venv on first use and install ppserve into it (editable), with optional extras.
#   scripts/venv.sh [extras]      e.g. scripts/venv.sh test, scripts/venv.sh client
# Later runs install again only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
target="ppserve${extras:+[$extras]}"
stamp=".venv/.installed${extras:+-$extras}"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  echo "ppserve: first run: creating .venv and installing $target with PyTorch (CPU) and its other dependencies (a minute or two)" >&2
  python3 -m venv .venv
elif [ -f "$stamp" ]; then
  echo "ppserve: installing $target into .venv (pyproject.toml changed since the last install)" >&2
else
  echo "ppserve: installing $target into .venv (first use of ${extras:+the $extras extra}${extras:-ppserve alone})" >&2
fi
.venv/bin/python -m pip install --disable-pip-version-check -e ".${extras:+[$extras]}"
echo "$want" >"$stamp"
