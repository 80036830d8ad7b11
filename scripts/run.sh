#!/usr/bin/env bash
# Set up, then serve the default model (SmolLM2-135M-Instruct) with the OpenAI-compatible API
# on http://127.0.0.1:1919. Extra arguments go to `python -m minisgl` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
exec .venv/bin/python -m minisgl "$@"
