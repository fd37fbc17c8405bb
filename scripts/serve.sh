#!/usr/bin/env bash
# Set up (if needed) and serve the built-in default models on 127.0.0.1:8000.
# Extra arguments go to `packserve serve` (e.g. --config FILE, --port 9000).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/packserve serve "$@"
