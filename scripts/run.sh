#!/usr/bin/env bash
# Set up, then run the offline generation demo on the default model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
exec .venv/bin/python examples/offline_demo.py "$@"
