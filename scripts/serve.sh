#!/usr/bin/env bash
# Start the HTTP server with 2 pipeline stages; with no --model, on the built-in demo model.
# Creates .venv and installs ppserve on first use. Any `ppserve serve` flag can follow, e.g.
#   scripts/serve.sh --model ./qwen3-0.6b --pp-size 4 --port 8080
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/venv.sh
exec .venv/bin/ppserve serve --pp-size 2 "$@"
