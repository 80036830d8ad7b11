#!/usr/bin/env bash
# Create .venv with minisgl, its test tools and the default model; safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
# torch==2.13.0 is the CPU wheel on these machines; set MINISGL_TORCH to choose another build.
torch_spec="${MINISGL_TORCH:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
stamp=.venv/.minisgl-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install --quiet --disable-pip-version-check "$torch_spec" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import minisgl, torch, transformers" # fail here if the install did
  touch "$stamp"
fi
# Fetch and convert the default model once (cached under $MINISGL_CACHE, ~/.cache/minisgl).
.venv/bin/python -c "from minisgl.utils.hf import default_model_path; print(default_model_path())"
