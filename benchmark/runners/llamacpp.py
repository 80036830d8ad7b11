"""llama.cpp as a peer for quantized (GGUF) decode: its `llama-bench` tool, built into
`.peers/llamacpp` by scripts/setup_llamacpp.sh, run on a GGUF file in a subprocess; and its
`llama-lookup` example (prompt lookup decoding: n-gram drafts from the prompt and output,
verified several per step) for speculative decoding (`lookup_decode`).

`decode_tokens_per_s` is llama-bench's tg test (`-p 0 -n N`: N tokens generated one at a time
after an empty prompt, i.e. batch 1 decode); `prefill_tokens_per_s` its pp test (`-p P -n 0`: one
P-token prompt). Each is the median over a few repetitions, after llama-bench's own warm-up run.

Run directly for a quick table:
    python benchmark/runners/llamacpp.py MODEL.gguf --threads 2 1 --pp 512
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The same folder as paths.PEERS_DIR; computed here so the module also runs as a script.
PEERS_DIR = Path(__file__).resolve().parents[2] / ".peers"
SETUP_SCRIPT = "scripts/setup_llamacpp.sh"
BINARY_ENV = "MINISGL_LLAMA_BENCH"  # another llama-bench binary to use instead


class LlamaCppMissing(FileNotFoundError):
    """The llama-bench binary is not built (scripts/setup_llamacpp.sh builds it)."""


def llama_binary(name: str) -> Path | None:
    """One of the tools setup_llamacpp.sh built (`llama-bench`, `llama-lookup`), if there."""
    candidates = [
        PEERS_DIR / "llamacpp" / "bin" / name,
        PEERS_DIR / "llamacpp" / "build" / "bin" / name,
    ]
    return next((p for p in candidates if p.is_file() and os.access(p, os.X_OK)), None)


def llama_bench_binary() -> Path | None:
    """The llama-bench binary: $MINISGL_LLAMA_BENCH, else the one setup_llamacpp.sh built."""
    override = os.environ.get(BINARY_ENV)
    if override:
        path = Path(override)
        return path if path.is_file() and os.access(path, os.X_OK) else None
    return llama_binary("llama-bench")


def require_llama_bench() -> Path:
    """The llama-bench binary, or `LlamaCppMissing` saying how to build it."""
    binary = llama_bench_binary()
    if binary is None:
        where = os.environ.get(BINARY_ENV) or str(PEERS_DIR / "llamacpp" / "bin" / "llama-bench")
        raise LlamaCppMissing(
            f"llama.cpp's llama-bench not found at {where}; run {SETUP_SCRIPT} to build it "
            "(a few minutes on 2 cores)"
        )
    return binary


def converted_gguf(model_dir: Path, outtype: str, out: Path) -> Path:
    """`out`: the HF folder `model_dir` as a GGUF of `outtype` (e.g. q8_0) by llama.cpp's own
    converter (its source tree, which setup_llamacpp.sh fetches), made once."""
    if out.exists():
        return out
    source = PEERS_DIR / "llamacpp" / "llama.cpp"
    converter = source / "convert_hf_to_gguf.py"
    if not converter.is_file():
        raise LlamaCppMissing(f"llama.cpp's converter not found at {converter}; run {SETUP_SCRIPT}")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    paths = [str(source / "gguf-py"), str(PEERS_DIR / "llamacpp" / "convert-lib")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    command = [sys.executable, str(converter), str(model_dir), "--outtype", outtype]
    proc = subprocess.run(
        [*command, "--outfile", str(partial)], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{proc.stderr[-2000:]}")
    partial.rename(out)
    return out


@dataclass(frozen=True)
class BenchResult:
    """One llama-bench test: tokens per second over its repetitions."""

    test: str  # llama-bench's name for it: "tg128", "pp512"
    threads: int
    tokens_per_s: float  # median of the repetitions
    mean_tokens_per_s: float
    stddev_tokens_per_s: float
    samples: list[float]
    model_type: str  # as llama-bench describes the model, e.g. "llama 256M Q4_1"
    model_size_bytes: int
    raw: dict[str, Any] = field(repr=False, default_factory=dict)


def run_llama_bench(
    model: Path,
    threads: int,
    n_prompt: int = 0,
    n_gen: int = 128,
    repetitions: int = 3,
    extra_args: Sequence[str] = (),
    timeout_s: float = 900.0,
) -> BenchResult:
    """Run one llama-bench test on `model` (a GGUF file) with `threads` threads.

    Exactly one of `n_prompt` (pp test) and `n_gen` (tg test) should be non-zero. Raises
    `LlamaCppMissing` when the binary is not built, FileNotFoundError when the model is missing,
    RuntimeError when llama-bench fails or reports nothing.
    """
    binary = require_llama_bench()
    model = Path(model).expanduser()
    if not model.is_file():
        raise FileNotFoundError(f"GGUF model not found: {model}")
    if (n_prompt > 0) == (n_gen > 0):
        raise ValueError("give exactly one of n_prompt (pp test) and n_gen (tg test)")
    cmd = [
        str(binary),
        "-m", str(model),
        "-t", str(threads),
        "-p", str(n_prompt),
        "-n", str(n_gen),
        "-r", str(repetitions),
        "-o", "json",
        *extra_args,
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"llama-bench ran past {timeout_s:.0f} s: {' '.join(cmd)}") from e
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"llama-bench failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    try:
        rows = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise RuntimeError(f"llama-bench printed no JSON: {proc.stdout[-500:]!r}") from e
    if not rows:
        raise RuntimeError(f"llama-bench reported no test: {' '.join(cmd)}")
    return _result(rows[0])


def _result(row: dict[str, Any]) -> BenchResult:
    """One row of llama-bench's JSON output."""
    samples = [float(s) for s in row.get("samples_ts") or [row["avg_ts"]]]
    test = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
    return BenchResult(
        test=test,
        threads=int(row["n_threads"]),
        tokens_per_s=statistics.median(samples),
        mean_tokens_per_s=float(row["avg_ts"]),
        stddev_tokens_per_s=float(row.get("stddev_ts", 0.0)),
        samples=samples,
        model_type=str(row.get("model_type", "")),
        model_size_bytes=int(row.get("model_size", 0)),
        raw=row,
    )


def decode_tokens_per_s(model: Path, threads: int, n_gen: int = 128, repetitions: int = 3) -> float:
    """Batch-1 decode speed (llama-bench tg`n_gen`): median tokens per second."""
    return run_llama_bench(model, threads, 0, n_gen, repetitions).tokens_per_s


def prefill_tokens_per_s(
    model: Path, threads: int, n_prompt: int = 512, repetitions: int = 3
) -> float:
    """Prompt-processing speed (llama-bench pp`n_prompt`): median tokens per second."""
    return run_llama_bench(model, threads, n_prompt, 0, repetitions).tokens_per_s


@dataclass(frozen=True)
class LookupRun:
    """One llama-lookup generation: decode speed (the prompt's processing not counted) and its
    drafts."""

    tokens_per_s: float
    decoded: int
    drafted: int
    accepted: int


_LOOKUP_FIGURES = {
    "decoded": re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "drafted": re.compile(r"n_drafted\s*=\s*(\d+)"),
    "accepted": re.compile(r"n_accept\s*=\s*(\d+)"),
}


def lookup_decode(
    model: Path,
    prompt: str,
    max_tokens: int,
    threads: int,
    draft_max: int,
    context: int = 4096,
    timeout_s: float = 600.0,
) -> LookupRun:
    """Greedy generation of up to `max_tokens` after `prompt` (text; special tokens parsed, as
    a chat template renders them) by llama.cpp's prompt lookup decoding with at most
    `draft_max` drafts a step (0: one token a step, its baseline in the same loop)."""
    binary = llama_binary("llama-lookup")
    if binary is None:
        raise LlamaCppMissing(f"llama.cpp's llama-lookup not built; run {SETUP_SCRIPT}")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
        prompt_file = f.name
    cmd = [
        str(binary), "-m", str(model), "-f", prompt_file, "-n", str(max_tokens),
        "-t", str(threads), "-c", str(context), "--temp", "0",
        "--spec-draft-n-max", str(draft_max),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"llama-lookup ran past {timeout_s:.0f} s: {' '.join(cmd)}") from e
    finally:
        os.unlink(prompt_file)
    log = proc.stdout + proc.stderr
    found = {name: pattern.search(log) for name, pattern in _LOOKUP_FIGURES.items()}
    if proc.returncode != 0 or not all(found.values()):
        tail = "\n".join(log.strip().splitlines()[-15:])
        raise RuntimeError(f"llama-lookup failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    decoded = int(found["decoded"].group(1))  # type: ignore[union-attr]
    seconds = float(found["decoded"].group(2))  # type: ignore[union-attr]
    return LookupRun(
        tokens_per_s=decoded / seconds if seconds > 0 else 0.0,
        decoded=decoded,
        drafted=int(found["drafted"].group(1)),  # type: ignore[union-attr]
        accepted=int(found["accepted"].group(1)),  # type: ignore[union-attr]
    )


def _main() -> None:
    parser = argparse.ArgumentParser(description="llama.cpp's llama-bench on a GGUF file")
    parser.add_argument("model", type=Path)
    parser.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 1])
    parser.add_argument("--tg", type=int, default=128, help="decode tokens (0: skip)")
    parser.add_argument("--pp", type=int, default=0, help="prompt tokens for a pp test (0: skip)")
    parser.add_argument("--repetitions", "-r", type=int, default=3)
    args = parser.parse_args()
    for threads in args.threads:
        for n_prompt, n_gen in ((0, args.tg), (args.pp, 0)):
            if n_prompt or n_gen:
                r = run_llama_bench(args.model, threads, n_prompt, n_gen, args.repetitions)
                print(
                    f"{args.model.name}  {r.model_type}  t={threads}  {r.test}: "
                    f"{r.tokens_per_s:.1f} tok/s (median; mean {r.mean_tokens_per_s:.1f} "
                    f"± {r.stddev_tokens_per_s:.1f}; samples "
                    f"{', '.join(f'{s:.1f}' for s in r.samples)})"
                )


if __name__ == "__main__":
    _main()
