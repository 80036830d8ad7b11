"""vLLM's CPU backend as a peer: one subprocess in the `.peers/vllm` venv (set up by
scripts/setup_vllm.sh) runs every timed run through `benchmark/peers/vllm_offline.py`, with
PEERS.md's best environment."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from machine import available_cores, engine_threads
from paths import OUT_DIR, PEERS_DIR, VLLM_RUNNER
from phases import Phases, phases_to_json
from processes import stop_process_group
from results import RunResult


def vllm_python() -> Path | None:
    """The peer venv's interpreter when `scripts/setup_vllm.sh` has set it up."""
    python = PEERS_DIR / "vllm" / "bin" / "python"
    return python if python.exists() else None


def _tcmalloc() -> str | None:
    try:
        files = subprocess.run(
            ["dpkg", "-L", "libtcmalloc-minimal4"], capture_output=True, text=True, check=False
        ).stdout.split()
    except FileNotFoundError:
        return None
    return next((f for f in files if f.endswith("minimal.so.4")), None)


def vllm_env(kv_gb: float, threads: int | None = None) -> tuple[dict[str, str], list[str]]:
    """PEERS.md's best settings: OpenMP threads bound to cores, tcmalloc + Intel OpenMP preloaded.

    `threads` cores are bound (default: the in-process engines' count). Returns the environment
    and notes on what was missing.
    """
    env = dict(os.environ)
    notes = []
    cores = available_cores()[: threads or engine_threads()]
    env["VLLM_CPU_OMP_THREADS_BIND"] = (
        f"{cores[0]}-{cores[-1]}"
        if cores == list(range(cores[0], cores[-1] + 1))
        else ",".join(map(str, cores))
    )
    env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_gb) if float(kv_gb).is_integer() else kv_gb)
    preload = []
    tcmalloc = _tcmalloc()
    if tcmalloc:
        preload.append(tcmalloc)
    else:
        notes.append("libtcmalloc-minimal4 not installed (apt-get), running without it")
    iomp = PEERS_DIR / "vllm" / "lib" / "libiomp5.so"
    if iomp.exists():
        preload.append(str(iomp))
    else:
        notes.append(f"{iomp} missing, running without Intel OpenMP")
    if preload:
        env["LD_PRELOAD"] = ":".join(
            preload + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else [])
        )
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env, notes


@dataclass
class PeerRun:
    """One timed run for the peer: its name, repeat index and phases."""

    name: str
    phases: Phases
    repeat: int = 0


def run_vllm_peer(
    model_path: Path,
    dtype: str,
    runs: Sequence[PeerRun],
    warmup: Phases,
    max_model_len: int,
    enable_prefix_caching: bool,
    block_size: int | None = None,
    speculative_config: dict[str, Any] | None = None,
    kv_gb: float = 4.0,
    threads: int | None = None,
    timeout_s: float = 3600.0,
    log: Callable[[str], None] = print,
    after_run: Callable[[int], None] | None = None,
    out_dir: Path = OUT_DIR,
) -> list[RunResult] | None:
    """Run the workloads through vLLM's CPU backend in `.peers/vllm`; None when unavailable.

    One engine serves every run (its ~60 s start-up is not timed). Run names become the
    results' workload names; repeats of a name are separate runs. `speculative_config`: vLLM's
    (e.g. n-gram drafting), None for none. `after_run(i)` is called on a reader thread when the
    peer reports that runs[i] ended; the peer does not wait for it, so runs[i + 1] sees its
    effect within the thread's wake-up (about a millisecond). The peer's log goes to `out_dir`
    (the script's --out).
    """
    python = vllm_python()
    if python is None:
        log(
            "vLLM peer: ABSENT (no .peers/vllm venv); run scripts/setup_vllm.sh to install it. "
            "Continuing without it."
        )
        return None
    env, notes = vllm_env(kv_gb, threads)
    for note in notes:
        log(f"vLLM peer: {note}")
    spec = dict(
        model=str(model_path),
        dtype=dtype,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        block_size=block_size,
        speculative_config=speculative_config,
        warmup=phases_to_json(warmup),
        runs=[dict(name=r.name, repeat=r.repeat, phases=phases_to_json(r.phases)) for r in runs],
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / f"vllm-{time.strftime('%Y%m%d-%H%M%S')}.log"
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        log(
            f"vLLM peer: starting (caching={'on' if enable_prefix_caching else 'off'}, log {log_path})"
        )
        with open(log_path, "w") as log_file:
            # Its own process group: vLLM forks workers, and all of them go when we do.
            proc = subprocess.Popen(
                [str(python), str(VLLM_RUNNER), str(spec_path), str(result_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,
            )
            reader = threading.Thread(
                target=_follow_peer, args=(proc, log_file, runs, after_run), daemon=True
            )
            reader.start()
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = -1
            finally:
                stop_process_group(proc)
                reader.join(timeout=10.0)
        if rc != 0 or not result_path.exists():
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            log(f"vLLM peer: FAILED (exit {rc}); last lines of {log_path}:")
            for line in tail:
                log(f"    {line}")
            return None
        result = json.loads(result_path.read_text())
    log(f"vLLM peer: vllm {result.get('vllm_version')} started in {result['startup_s']:.0f} s")
    name = "vLLM CPU" + (" +prefix cache" if enable_prefix_caching else "")
    name += " +speculative" if speculative_config else ""
    return [_peer_result(name, run) for run in result["runs"]]


def _peer_result(engine: str, run: dict[str, Any]) -> RunResult:
    """One run as the peer reported it (cached tokens are None where vLLM does not say)."""
    cached = run["cached_tokens"]
    return RunResult(
        engine=engine,
        workload=run["name"],
        wall_s=run["wall_s"],
        prompt_tokens=run["prompt_tokens"],
        output_tokens=run["output_tokens"],
        cached_tokens=cached or 0,
        prefill_computed=None if cached is None else run["prompt_tokens"] - cached,
        bad_lengths=run["bad_lengths"],
        extra={"repeat": run["repeat"]},
    )


def _follow_peer(
    proc: subprocess.Popen[str],
    log_file: Any,
    runs: Sequence[PeerRun],
    after_run: Callable[[int], None] | None,
) -> None:
    """Copy the peer's output into its log; call `after_run(i)` on run i's progress line
    (`NAME #REPEAT: S s`, printed by vllm_offline.py as each run ends, in order)."""
    assert proc.stdout is not None
    done = 0
    for line in proc.stdout:
        log_file.write(line)
        log_file.flush()
        if done < len(runs) and line.startswith(f"{runs[done].name} #{runs[done].repeat}: "):
            if after_run is not None:
                after_run(done)
            done += 1
