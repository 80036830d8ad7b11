#!/usr/bin/env bash
# Build llama.cpp's `llama-bench` (quantized GGUF decode and prefill) and `llama-lookup` (its
# prompt lookup decoding, benchmark/speculative.py's peer) as benchmark peers, in
# .peers/llamacpp (recipe: shared/PEERS.md). Safe to run repeatedly: the download, the unpacked
# source and the build are each kept, and the build is skipped when the binary exists for the
# same CPU flags. Needs ~300 MB of disk and a few minutes on 2 cores (niced, -j2).
# Used by benchmark/runners/llamacpp.py.
#
# The source is the llama.cpp that llama-cpp-python 0.3.36's sdist vendors (vendor/llama.cpp),
# the same llama.cpp PEERS.md's figures came from. Only the library and these two targets are
# built (MINISGL_LLAMACPP_TARGETS names others, e.g. "llama-bench llama-lookup llama-quantize";
# the examples are configured so that their targets exist, but only the named ones build);
# llama-cli and llama-server sit behind LLAMA_BUILD_SERVER and the web UI here, so they are left
# out.
#
# CPU flags: GGML_NATIVE=OFF with explicit GGML_* flags for what /proc/cpuinfo lists, and never
# AMX. PEERS.md: the GGML_NATIVE=ON build segfaults at the first decode on the Intel Xeon AMX
# machine class (-march=native turns on ggml's AMX kernels), while the explicit-flags build
# without AMX runs there. On the Zen 5 class NATIVE=ON works too, but explicit flags give both
# classes one recipe and a build whose flags are known, and cost nothing measurable: the
# x86 kernels ggml picks are gated on exactly these flags (AVX-512 F/VBMI/VNNI/BF16, AVX-VNNI).
# MINISGL_LLAMACPP_NATIVE=1 builds with GGML_NATIVE=ON instead, for a comparison on machines
# without AMX; it refuses where the CPU has AMX.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
peer=.peers/llamacpp
venv="$peer"                     # its venv (pip, and cmake/ninja when the system has none)
version=0.3.36
src="$peer/llama.cpp"
build="$peer/build"
targets="${MINISGL_LLAMACPP_TARGETS:-llama-bench llama-lookup}"
pip_flags=(--quiet --disable-pip-version-check)
# pip's "WARNING: Location ... is ignored" lines (local index mirrors) are noise here.
quiet_pip() { "$venv/bin/pip" "$@" 2>&1 | grep -v "^WARNING: Location" || true; }

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi

# cmake >= 3.14 and a build tool: the system's where it has them, else from pip into the venv.
cmake_ok() {
  command -v "$1" >/dev/null 2>&1 || return 1
  "$python" - "$("$1" --version | head -n1 | awk '{print $3}')" <<'EOF'
import sys
v = tuple(int(x) for x in sys.argv[1].split("-")[0].split(".")[:2])
sys.exit(0 if v >= (3, 14) else 1)
EOF
}
if cmake_ok cmake; then
  cmake=cmake
else
  [ -x "$venv/bin/cmake" ] || quiet_pip install "${pip_flags[@]}" cmake
  cmake="$PWD/$venv/bin/cmake"
fi
generator=()
if command -v ninja >/dev/null 2>&1 || [ -x "$venv/bin/ninja" ]; then
  generator=(-G Ninja)
elif ! command -v make >/dev/null 2>&1; then
  quiet_pip install "${pip_flags[@]}" ninja
  generator=(-G Ninja)
fi
export PATH="$PWD/$venv/bin:$PATH"   # a pip-installed ninja, if that is the one

# The source: llama-cpp-python's sdist from pip's configured index, its vendor/llama.cpp kept.
sdist="$peer/src/llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
  mkdir -p "$peer/src"
  "$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$version" -d "$peer/src" 2>&1 | grep -v "^WARNING: Location" || true
  [ -f "$sdist" ] || { echo "error: download of llama-cpp-python==$version failed" >&2; exit 1; }
fi
if [ ! -f "$src/CMakeLists.txt" ]; then
  rm -rf "$src" "$peer/src/unpack"
  mkdir -p "$peer/src/unpack"
  tar -xzf "$sdist" -C "$peer/src/unpack" "llama_cpp_python-$version/vendor/llama.cpp"
  mv "$peer/src/unpack/llama_cpp_python-$version/vendor/llama.cpp" "$src"
  rm -f "$src/.git"  # a submodule's gitlink to a folder the sdist does not carry
  rm -rf "$peer/src/unpack"
fi

# CPU flags from /proc/cpuinfo (x86; elsewhere GGML_NATIVE=ON is ggml's own default).
cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { [[ "$cpu_flags" == *" $1 "* ]]; }
onoff() { if has "$1"; then echo ON; else echo OFF; fi; }
arch="$(uname -m)"
if [ "$arch" != x86_64 ]; then
  ggml_flags=(-DGGML_NATIVE=ON)
elif [ "${MINISGL_LLAMACPP_NATIVE:-0}" = 1 ]; then
  if has amx_tile || has amx_int8 || has amx_bf16; then
    echo "error: MINISGL_LLAMACPP_NATIVE=1 on a CPU with AMX: that build segfaults (PEERS.md)" >&2
    exit 1
  fi
  ggml_flags=(-DGGML_NATIVE=ON)
else
  avx512=OFF
  if has avx512f && has avx512cd && has avx512vl && has avx512dq && has avx512bw; then
    avx512=ON
  fi
  sub() { if [ "$avx512" = ON ]; then onoff "$1"; else echo OFF; fi; }
  ggml_flags=(
    -DGGML_NATIVE=OFF
    -DGGML_SSE42="$(onoff sse4_2)" -DGGML_AVX="$(onoff avx)" -DGGML_AVX2="$(onoff avx2)"
    -DGGML_FMA="$(onoff fma)" -DGGML_F16C="$(onoff f16c)" -DGGML_BMI2="$(onoff bmi2)"
    -DGGML_AVX_VNNI="$(onoff avx_vnni)"
    -DGGML_AVX512="$avx512" -DGGML_AVX512_VBMI="$(sub avx512vbmi)"
    -DGGML_AVX512_VNNI="$(sub avx512_vnni)" -DGGML_AVX512_BF16="$(sub avx512_bf16)"
    # Never AMX, even where the CPU has it: its path is the one that segfaulted (see above).
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
  )
fi
cmake_args=(
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
  "${ggml_flags[@]}"
  -DGGML_CCACHE=OFF -DGGML_OPENMP=ON
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
)
key="llama.cpp@llama-cpp-python-$version ${cmake_args[*]} targets: $targets"
stamp="$build/.minisgl-build-key"
bin="$build/bin/llama-bench"

built=1
for t in $targets; do [ -x "$build/bin/$t" ] || built=0; done
if [ "$built" = 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then
  echo "llama.cpp already built with these flags (cached)"
else
  rm -rf "$build"
  echo "Building llama.cpp ($targets) with: ${ggml_flags[*]}"
  start=$(date +%s)
  # GIT_CEILING_DIRECTORIES: llama.cpp's build-info runs git in its source folder, which would
  # otherwise find this project's repository and record its commit as llama.cpp's.
  GIT_CEILING_DIRECTORIES="$PWD/$peer" nice -n 10 "$cmake" -S "$src" -B "$build" \
    "${generator[@]}" "${cmake_args[@]}" >"$peer/configure.log" 2>&1 \
    || { tail -n 30 "$peer/configure.log" >&2; exit 1; }
  # shellcheck disable=SC2086  # $targets is a word list
  nice -n 10 "$cmake" --build "$build" --config Release -j2 --target $targets \
    >"$peer/build.log" 2>&1 || { tail -n 30 "$peer/build.log" >&2; exit 1; }
  echo "$key" >"$stamp"
  echo "Built in $(( $(date +%s) - start )) s (logs: $peer/configure.log, $peer/build.log)"
fi
for t in $targets; do ln -sf "../build/bin/$t" "$venv/bin/$t"; done

# For llama.cpp's HF -> GGUF converter (run with the project's venv, which has its torch, numpy
# and transformers): sentencepiece, which it imports for every Llama-family model even when the
# model has no tokenizer.model, in a folder of its own rather than in the project's venv.
convert_lib="$peer/convert-lib"
if [ ! -d "$convert_lib/sentencepiece" ]; then
  quiet_pip install "${pip_flags[@]}" --target "$convert_lib" sentencepiece \
    || echo "warning: sentencepiece not installed; convert_hf_to_gguf.py may fail" >&2
fi

echo "llama.cpp peer ready: $PWD/$bin"
echo "  flags: ${ggml_flags[*]}"
echo "  a GGUF from an HF folder (float32/bf16 weights), e.g. bf16 or q8_0:"
echo "    PYTHONPATH=$src/gguf-py:$convert_lib .venv/bin/python $src/convert_hf_to_gguf.py \\"
echo "      MODEL_DIR --outtype bf16 --outfile OUT.gguf"
