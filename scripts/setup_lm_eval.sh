#!/usr/bin/env bash
# Set up EleutherAI's lm-evaluation-harness (lm-eval 0.4.x) as an evaluation peer in its own
# venv, .peers/lm-eval, with what its `local-completions` model type (requests, aiohttp,
# tenacity, tiktoken: the `api` extra) and its `hf` backend (transformers, accelerate, peft: the
# `hf` extra) need. Safe to run repeatedly. Needs ~2 GB of disk and a few minutes.
# Used by `.venv/bin/python scripts/lm_eval_check.py` (docs/evaluation.md).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
venv=.peers/lm-eval
lm_eval_spec="${MINISGL_LM_EVAL:-lm-eval[api,hf]==0.4.13}"
pip_flags=(--quiet --disable-pip-version-check)
# pip's "WARNING: Location ... is ignored" lines (local index mirrors) are noise here.
quiet_pip() { "$venv/bin/pip" "$@" 2>&1 | grep -v "^WARNING: Location" || true; }

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
stamp="$venv/.minisgl-peer-installed"
if [ ! -f "$stamp" ]; then
  # The CPU torch first, so the hf extra's `torch>=1.8` keeps it rather than pulling a CUDA build.
  quiet_pip install "${pip_flags[@]}" torch==2.13.0
  quiet_pip install "${pip_flags[@]}" "$lm_eval_spec"
  "$venv/bin/python" -c "
import lm_eval, torch, transformers, aiohttp, requests, tenacity
from importlib.metadata import version
print('lm-eval', version('lm-eval'), '| torch', torch.__version__, '| transformers', transformers.__version__)
assert not torch.version.cuda, 'a CUDA torch was installed: ' + torch.__version__
"
  touch "$stamp"
fi
echo "lm-eval peer ready in $venv ($venv/bin/lm_eval)"
