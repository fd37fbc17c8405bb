#!/usr/bin/env bash
# Set up (if needed), then run the gates and the whole test suite on CPU with real models.
#   scripts/test.sh [PYTEST ARGS]         everything (README's test command, and CI's)
#   scripts/test.sh --fast [PYTEST ARGS]  the tests that load no real model and start no
#                                         process (markers `real` and `process`, tests/conftest.py)
set -euo pipefail
cd "$(dirname "$0")/.."
fast=()
if [ "${1:-}" = --fast ]; then
  shift
  fast=(-m "not real and not process")
fi
scripts/setup.sh --dev
# The status-page test drives a real headless Chromium: Debian's package, not a download.
if ! command -v chromium >/dev/null 2>&1; then
  echo "packserve test: installing Debian's chromium for the status-page test" >&2
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get install -y -q chromium >/dev/null \
    || { $sudo apt-get update -q && $sudo apt-get install -y -q chromium >/dev/null; }
fi
.venv/bin/ruff check src benchmarks tests
.venv/bin/mypy
.venv/bin/python -m pytest ${fast[@]+"${fast[@]}"} "$@"
