"""The benchmark scripts still run against the engine (a smoke run; speed is not checked), and
benchmark/contention.py's busy loops start pinned, pause, and never outlive their owner."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import tiny_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmark"))

from contention import BusyLoops  # noqa: E402

CPUS = sorted(os.sched_getaffinity(0))


def proc_state(pid: int) -> str | None:
    """The process's state letter from /proc (R, S, T, Z...), None once it is reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def settle(pid: int, wanted: tuple[str | None, ...], deadline_s: float = 10.0) -> str | None:
    """The process's state once it is one of `wanted` (signals land asynchronously), or the
    last state seen when the deadline passes."""
    end = time.monotonic() + deadline_s
    state = proc_state(pid)
    while state not in wanted and time.monotonic() < end:
        time.sleep(0.01)
        state = proc_state(pid)
    return state


def test_offline_benchmark_quick_run(tmp_path: Path) -> None:
    env = {**os.environ, "MINISGL_LOG_LEVEL": "WARNING"}
    # With a second CPU, a contended pass too (1 busy loop beside the engine).
    contention = ["--contention", "1"] if len(CPUS) > 1 else []
    # The tiny random Qwen3 in float32: the script's path is the same as on the default model,
    # and its machine measurement takes float32 matmuls (bf16 ones crawl on a CPU without bf16
    # dot products: 10 s of the run).
    cmd = [
        sys.executable,
        str(ROOT / "benchmark" / "offline.py"),
        "--quick",
        "--skip-hf",
        *["--model", str(tiny_model("qwen3")), "--dtype", "float32"],
        *contention,
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    row = next(line for line in stdout.splitlines() if "| minisgl |" in line)
    out_tok_s = float(row.split("|")[3].replace(",", ""))
    assert out_tok_s > 0
    assert not re.search(r"\|\s*\d+\s*\|\s*$", row), f"requests of the wrong length: {row}"
    if contention:
        table = stdout.split(f"contention: 1 busy-loop process on CPU {CPUS[-1]}")[1]
        cells = next(line for line in table.splitlines() if "| minisgl |" in line).split("|")
        quiet_s, busy_s, slowdown = float(cells[3]), float(cells[4]), cells[5].strip()
        assert quiet_s > 0 and busy_s > 0 and float(slowdown.removesuffix("x")) > 0
        # None of its spinners outlives the benchmark (their argv names their parent).
        leftover = subprocess.run(
            ["pgrep", "-f", f"contention.py --spin [0-9]+ {proc.pid}$"], capture_output=True
        )
        assert leftover.stdout == b""


def test_busy_loops_pin_pause_and_stop() -> None:
    with pytest.raises(ValueError, match=f"busy-loop count {len(CPUS)}"):
        BusyLoops(len(CPUS))  # the engine must keep a CPU
    if len(CPUS) < 2:
        return  # nothing else can be taken from a single CPU
    with BusyLoops(1) as busy:
        (proc,) = busy.procs
        assert busy.cpus == [CPUS[-1]]
        assert os.sched_getaffinity(proc.pid) == {CPUS[-1]}
        assert settle(proc.pid, ("R",)) == "R"  # spinning, never sleeping
        busy.pause()
        assert settle(proc.pid, ("T",)) == "T"
        busy.resume()
        assert settle(proc.pid, ("R",)) == "R"
    assert proc_state(proc.pid) is None  # killed and reaped


@pytest.mark.parametrize("paused", [False, True])
def test_busy_loops_die_with_their_owner(paused: bool) -> None:
    """SIGKILL of the process that started them (no cleanup runs) takes the spinners along,
    stopped ones too."""
    if len(CPUS) < 2:
        return  # BusyLoops(1) is rejected on one CPU (checked above)
    owner = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(ROOT / "benchmark")!r})
        from contention import BusyLoops
        busy = BusyLoops(1, paused={paused}).__enter__()
        print(busy.procs[0].pid, flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", owner], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        spinner = int(proc.stdout.readline())
        state = "T" if paused else "R"
        assert settle(spinner, (state,)) == state
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # A zombie is dead: the process that adopted it has yet to reap it.
    assert settle(spinner, (None, "Z")) in (None, "Z")


def test_eviction_benchmark_smoke_run() -> None:
    """A few requests over three prefixes, two policies: one table row each."""
    env = {**os.environ, "MINISGL_LOG_LEVEL": "WARNING"}
    cmd = [sys.executable, str(ROOT / "benchmark" / "eviction.py"), "--policies", "lru,priority"]
    cmd += ["--model", str(tiny_model("qwen3"))]  # the tiny random Qwen3: the same cache work
    cmd += ["--requests", "8", "--prefixes", "3", "--prefix-len", "32", "--threads", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [r[1].strip() for r in rows[1:]] == ["lru", "priority"]
    for r in rows[1:]:
        assert 0.0 <= float(r[2].strip().removesuffix("%")) <= 100.0 and float(r[3]) > 0


def test_kv_tier_benchmark_smoke_run() -> None:
    """A short prompt across a restart, then a tiny P3: a row per run, the restored one cached."""
    from test_server import free_port

    env = {**os.environ, "MINISGL_LOG_LEVEL": "WARNING"}
    # The tiny random Qwen3 with a 40,960-token context (P3's prompts are 1,056 tokens): the same
    # tier work at a fraction of the compute (the default model took 73 s, 29 of them P3's).
    model = tiny_model("qwen3-long")
    cmd = [sys.executable, str(ROOT / "benchmark" / "kv_tier.py"), "--models", str(model)]
    # one P3 prompt a run, one run an engine
    cmd += ["--prompt-len", "200", "--p3-prompts", "1", "--repeat", "1", "--threads", "2"]
    cmd += ["--port", str(free_port())]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {
        r[2].strip(): r
        for r in (line.split("|") for line in proc.stdout.splitlines())
        if len(r) == 7
    }
    # The whole output on failure: the shutdown line says what the first server wrote.
    report = proc.stdout + proc.stderr[-3000:]
    assert int(rows["cold"][4]) == 0 and int(rows["restored"][4]) == 192, report
    assert "outputs equal: yes" in proc.stdout and "tier cost over naive" in proc.stdout, report


def test_ngram_bound_steps_counts_perfect_single_branch_drafts() -> None:
    from speculative import ngram_bound_steps

    prompt = list(range(100, 120))
    # Nothing in the text ever repeats: one token a step.
    assert ngram_bound_steps(prompt, [1, 2, 3, 4], max_drafts=7, max_n=6) == 4
    # A copy of the prompt: after its first token, each step keeps 7 drafts and one token.
    assert ngram_bound_steps(prompt, prompt[:17], max_drafts=7, max_n=6) == 1 + 2
    # Two earlier continuations of the last token (100 -> 101 and 100 -> 5): the better is kept,
    # whichever occurred last.
    text = [100, 101, 102, 103, 100, 5]
    assert ngram_bound_steps(text, [100, 101, 102, 103], max_drafts=7, max_n=1) == 1 + 1
    assert ngram_bound_steps(text, [100, 5, 9], max_drafts=7, max_n=1) == 1 + 1
