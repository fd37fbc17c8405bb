#!/usr/bin/env bash
# Set up (if needed), then run the gates and the whole test suite on CPU with real models.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check src tests
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
