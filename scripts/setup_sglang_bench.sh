#!/usr/bin/env bash
# Set up SGLang's serving benchmark client (`python -m sglang.bench_serving`) in its own venv,
# .peers/sglang-bench, without the SGLang server: no torch, no CUDA. Safe to run repeatedly.
# Needs ~1 GB of disk and a minute or two. Used by `.venv/bin/python scripts/bench_clients.py`
# (docs/benchmark-clients.md).
#
# Why sglang 0.5.9 with --no-deps: the `sglang` package depends on a CUDA torch, flashinfer,
# sglang-kernel and dozens more. Its bench_serving.py up to 0.5.9 is a standalone module ("don't
# want to import sglang package here"): it needs only what is installed below (the package's
# __init__ pulls sglang.lang, which wants numpy, tqdm, requests, pybase64, IPython, pydantic,
# aiohttp; the module itself adds datasets, pillow and transformers). From 0.5.10 on it imports
# sglang.srt.utils, which imports torch, triton and torchvision at module level; from 0.5.16 the
# code moved to sglang.benchmark.serving, which also imports sglang.srt.disaggregation (the whole
# model stack: tvm_ffi, sglang kernels). torchvision has no CPU build that fits the CPU torch we
# can install, so those versions do not import on a CPU-only machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
venv=.peers/sglang-bench
sglang_spec="${MINISGL_SGLANG_BENCH:-sglang==0.5.9}"
pip_flags=(--quiet --disable-pip-version-check)
# pip's "WARNING: Location ... is ignored" lines (local index mirrors) are noise here, and so is
# its list of sglang's (deliberately) missing requirements after the --no-deps install.
quiet_pip() {
  "$venv/bin/pip" "$@" 2>&1 | grep -v "^WARNING: Location\|^sglang .* requires \|dependency resolver\|dependency conflicts" || true
}

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
stamp="$venv/.minisgl-peer-installed"
if [ ! -f "$stamp" ]; then
  quiet_pip install "${pip_flags[@]}" --no-deps "$sglang_spec"
  # transformers 5, as the project's own venv has: sglang 0.5.9 pins 4.57.1, which cannot load
  # tokenizer folders that transformers 5 saved ("tokenizer_class": "TokenizersBackend", as the
  # default SmolLM2 folder has); the client only uses AutoTokenizer from it.
  quiet_pip install "${pip_flags[@]}" aiohttp numpy requests tqdm pybase64 IPython pydantic \
    datasets pillow "transformers>=5.0,<6"
  "$venv/bin/python" - <<'EOF'
import importlib.util, warnings
from importlib.metadata import version
warnings.simplefilter("ignore")
import sglang.bench_serving as b  # noqa: F401  (fails here if a module it imports is missing)
assert importlib.util.find_spec("torch") is None, "torch was pulled in"
print("sglang", version("sglang"), "| transformers", version("transformers"),
      "| aiohttp", version("aiohttp"))
EOF
  touch "$stamp"
fi
echo "SGLang bench client ready in $venv ($venv/bin/python -m sglang.bench_serving)"
