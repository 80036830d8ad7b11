"""gcc builds of the C kernels (every `csrc/*.c`, linked into one shared library): the machine's
own (-march=native) and fixed instruction-set targets (the portable and AVX-512-without-bf16 forms
every machine can build and test, and the AVX-512/AMX forms emulated in software, which every
AVX2 machine runs), each cached by sources, flags and compiler, optionally under the address and
undefined-behaviour sanitizers."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import platform
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from minisgl.utils.hf import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# The library's translation units, one concept each, compiled with the same flags and linked into
# one library, and the headers they include (kernels.h: the exports). Every file of both goes into
# the cache tag: a change to any of them rebuilds.
SOURCES = tuple(
    CSRC / name
    for name in (
        "attention_blocked.c",
        "attention_decode.c",
        "attention_decode_avx512.c",
        "attention_decode_generic.c",
        "common.c",
        "elementwise.c",
        "fused_layer.c",
        "gemv.c",
        "matmul.c",
        "matmul_avx2.c",
        "packing.c",
        "quantized.c",
        "quantized_amx.c",
        "quantized_avx2.c",
        "quantized_tiled.c",
        "quantized_tiled_avx2.c",
        "quantized_tiled_avx2_int8.c",
        "quantized_w8a8.c",
        "quantized_w8a8_amx.c",
        "quantized_w8a8_vnni.c",
        "sampling.c",
    )
)
HEADERS = tuple(
    CSRC / name
    for name in (
        "attention_decode.h",
        "attention_decode_scores.h",
        "common.h",
        "emulated.h",
        "internal.h",
        "kernels.h",
        "simd.h",
    )
)
# -ffast-math lets gcc vectorise the float reductions and expf; it is given to the compile step
# only, because linking with it would flush denormals process-wide. Infinities and NaNs stay.
COMMON_FLAGS = ("-O3", "-fPIC", "-fopenmp", "-ffast-math", "-fno-finite-math-only")
NATIVE_FLAGS = ("-march=native",)
# -Bsymbolic: the kernels that call each other (the fused layer, the attention blocks) call
# their own build's copy when several builds are loaded in one process.
LINK_FLAGS = ("-shared", "-fopenmp", "-lm", "-Wl,-Bsymbolic")
# A sanitized build (tests/test_kernel_sanitized.py): every out-of-bounds access and undefined
# operation aborts with a report. It runs only in a process that loads libasan first
# (sanitizer_preload()).
SANITIZE_FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined")
SANITIZE_FLAGS += ("-fno-sanitize-recover=all",)


@dataclass(frozen=True)
class KernelTarget:
    """An instruction-set target: its gcc flags and the /proc/cpuinfo flags that run the build."""

    name: str
    flags: tuple[str, ...]
    cpu_flags: frozenset[str]
    emulated: bool = False  # AVX-512 and AMX in software (csrc/emulated.h, SIMDe's headers)


_AVX2 = frozenset({"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# Every non-native form of the kernels: SSE2 only and AVX2 (the portable C everywhere), AVX-512
# without bf16 (the vector attention and elementwise kernels, float32 dots), and avx512_bf16 with
# the AMX tiles compiled in (used only where the OS grants them, else vdpbf16ps). The emulated
# ones compile the AVX-512 paths of the classes an AVX2 machine cannot execute (Skylake-SP and
# Ice Lake without bf16, with and without VNNI's tiles; Zen 4/5, with AMX off; Sapphire Rapids,
# with it on) over AVX2, at -O1 (compile time): they are for tests, fuzzing and the sanitizer.
_EMULATED = ("-march=x86-64-v3", "-O1", "-DMINISGL_EMULATED_AVX512", "-DMINISGL_EMULATED_VNNI")
TARGETS = (
    KernelTarget("x86-64", ("-march=x86-64",), frozenset()),
    KernelTarget("x86-64-v3", ("-march=x86-64-v3",), _AVX2),
    KernelTarget("avx512-no-bf16", ("-march=x86-64-v4", "-mno-avx512bf16"), _AVX512),
    KernelTarget(
        "avx512-bf16-amx",
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16")
        + ("-mamx-int8",),
        _AVX512 | {"avx512_bf16", "avx512_vnni"},
    ),
    KernelTarget("avx512-vnni-emulated", _EMULATED, _AVX2, emulated=True),
    KernelTarget(
        "avx512-bf16-amx-emulated",
        (*_EMULATED, "-DMINISGL_EMULATED_BF16", "-DMINISGL_EMULATED_AMX"),
        _AVX2,
        emulated=True,
    ),
)


def simde_include() -> Path:
    """The folder holding SIMDe's headers (the simde-py package), which the emulated targets
    compile against."""
    spec = importlib.util.find_spec("simde_py")
    if spec is None or spec.origin is None:
        raise RuntimeError("the emulated kernel targets need SIMDe's headers: pip install simde-py")
    return Path(spec.origin).parent / "simde"


def sanitizer_preload() -> str:
    """LD_PRELOAD for a process that loads sanitized builds: gcc's ASan runtime, which must come
    before every other library."""
    found = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True)
    path = found.stdout.strip()
    if not path or not Path(path).exists():
        raise RuntimeError(f"gcc has no ASan runtime (libasan.so: {path!r})")
    return str(Path(path).resolve())


def machine_cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo has none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def can_run(target: KernelTarget) -> bool:
    """Whether this machine executes `target`'s build (it can build every target)."""
    on_x86 = platform.machine() in ("x86_64", "AMD64")
    return on_x86 and target.cpu_flags <= machine_cpu_flags()


def _compile_flags(flags: tuple[str, ...], sanitize: bool = False) -> tuple[str, ...]:
    """Every gcc flag of a compile: the common ones, the target's (an emulated one's -O1 and
    SIMDe's folder after them), the sanitizers'."""
    extra: tuple[str, ...] = ()
    if "-DMINISGL_EMULATED_AVX512" in flags:
        extra = ("-isystem", str(simde_include()))
    return COMMON_FLAGS + flags + extra + (SANITIZE_FLAGS if sanitize else ())


def _library_tag(flags: tuple[str, ...], sanitize: bool = False) -> str:
    """What a build depends on: sources and headers (SIMDe's by their version), flags, compiler,
    and for -march=native this CPU."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        text = path.read_bytes()
        digest.update(f"{path.name} {len(text)}\n".encode())
        digest.update(text)
    compile_flags = _compile_flags(flags, sanitize)
    digest.update(" ".join(compile_flags + LINK_FLAGS).encode())
    if "-isystem" in compile_flags:
        version = importlib.metadata.version("simde-py")
        digest.update(f"simde-py {version}".encode())
    digest.update(subprocess.run(["gcc", "--version"], capture_output=True).stdout)
    if "-march=native" in flags:
        cpu = " ".join(sorted(machine_cpu_flags())) or platform.processor()
        digest.update(cpu.encode())
    return digest.hexdigest()[:16]


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")


def build_library(flags: tuple[str, ...] = NATIVE_FLAGS, sanitize: bool = False) -> Path:
    """The shared library built with these target flags (built once, then cached); sanitize:
    under ASan and UBSan (loadable only after sanitizer_preload())."""
    suffix = "-sanitized" if sanitize else ""
    out = cache_dir() / "kernels" / f"cpu_kernels-{_library_tag(flags, sanitize)}{suffix}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    compile_flags = _compile_flags(flags, sanitize)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        compiles = [
            ["gcc", *compile_flags, "-c", str(source), "-o", str(obj)]
            for source, obj in zip(SOURCES, objects)
        ]
        with ThreadPoolExecutor(min(len(compiles), os.cpu_count() or 1)) as pool:
            list(pool.map(_run, compiles))  # gcc runs outside the GIL; the first error raises
        lib = Path(tmp) / "k.so"
        sanitizers = SANITIZE_FLAGS if sanitize else ()
        _run(["gcc", *map(str, objects), "-o", str(lib), *LINK_FLAGS, *sanitizers])
        os.replace(lib, out)  # atomic: concurrent builders each publish a complete file
    logger.info("built CPU kernels (%s) into %s", " ".join(compile_flags), out)
    return out


def build_all(sanitize: bool = False) -> list[Path]:
    """Every target's build and the machine's own (sanitized: only those this CPU runs, the
    ones a sanitized process can load), side by side: what the tests load, built ahead."""
    flag_sets = [NATIVE_FLAGS] + [t.flags for t in TARGETS if can_run(t) or not sanitize]
    with ThreadPoolExecutor(len(flag_sets)) as pool:
        return list(pool.map(lambda flags: build_library(flags, sanitize), flag_sets))


if __name__ == "__main__":  # scripts/setup.sh: python -m minisgl.kernel.build
    logging.basicConfig(level=logging.INFO)
    for sanitize in (False, True):
        build_all(sanitize)
