"""serving.py's server: `python -m minisgl` started on a free port in its own process group,
with its KV pool and context sized to the workload, polled until healthy and always stopped."""

from __future__ import annotations

import argparse
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from processes import stop_process_group
from report import log, stamp


def free_port() -> int:
    """A port nobody listens on now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_sizes(args: argparse.Namespace) -> tuple[int, int]:
    """(max sequence length, KV tokens) that hold the whole workload at once, with headroom.

    The started server and the offline engine get the same figures, so that neither pays for a
    KV pool or page table the other does not have; sized like offline.py sizes its engine.
    """
    seq = args.input_len + args.output_len
    in_flight = args.num_prompts if args.max_concurrency is None else args.max_concurrency
    warmup = args.warmup_requests or 0
    kv_tokens = int(1.25 * max(in_flight, warmup, 1) * seq) + 64
    return seq, kv_tokens


@dataclass
class Server:
    """A `python -m minisgl` child in its own process group (so its workers stop with it)."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    @classmethod
    def start(cls, model: Path, args: argparse.Namespace) -> Server:
        """Start the server for `model`, sized to the workload, its output in a log file."""
        seq, kv_tokens = engine_sizes(args)
        port = free_port()
        # The same rounding MinisglRunner applies, so the offline engine matches exactly.
        max_seq = -(-(seq + 1) // 64) * 64
        cmd = [
            sys.executable,
            "-m",
            "minisgl",
            "--model",
            str(model),
            "--port",
            str(port),
            "--dtype",
            args.dtype,
            "--max-seq-len",
            str(max_seq),
            "--num-pages",
            str(kv_tokens),
            "--log-level",
            "warning",
            *shlex.split(args.server_args),  # last, so they override the flags above
        ]
        args.out.mkdir(parents=True, exist_ok=True)
        log_path = args.out / f"serving-server-{stamp()}.log"
        log(f"server: {shlex.join(cmd)} (log {log_path})")
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        return cls(proc, f"http://127.0.0.1:{port}", log_path)

    def wait_healthy(self, timeout: float) -> None:
        """Poll /health; fail early, with the log's tail, if the server exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 20) -> str:
        """The last `lines` lines of the server's log."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the whole process group, SIGKILL it if it does not exit in `timeout` s."""
        if self.proc.poll() is not None:
            return
        stop_process_group(self.proc, timeout)
        log(f"server: stopped (exit {self.proc.returncode})")
