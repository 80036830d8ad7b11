"""A `python -m minisgl` server for the scripts that drive it (bench_clients.py,
lm_eval_check.py): started in its own process group on a free port, waited for on /health,
stopped with every worker however the script ends."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m minisgl` in its own process group; stop() ends the whole group."""

    def __init__(self, model: str, log: Path, extra: list[str]) -> None:
        """extra: more `python -m minisgl` options (e.g. --dtype float32)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "minisgl", "--model", model, "--port", str(self.port), *extra]
        print("$ " + " ".join(cmd), flush=True)
        self._log_file = log.open("wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_healthy(self, timeout: float) -> None:
        """Return once /health answers 200; raise if the server exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not answer /health within {timeout:.0f}s")

    def get_json(self, path: str) -> dict:
        """GET a JSON answer from the server."""
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as r:
            return json.loads(r.read())

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the group, then SIGKILL what is left of it after `grace` seconds."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left of the group (the tokenizer, scheduler, detokenizer workers).
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        self._log_file.close()

    def log_tail(self, n: int = 40) -> str:
        """The last n lines of the server's log."""
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])


def resolve_model(path: str | None) -> str:
    """The model folder a script serves: the given path, else the default model's."""
    if path is None:
        from minisgl.utils.hf import default_model_path

        path = str(default_model_path())
    return str(Path(path).resolve())


def work_folder(keep: str | None, prefix: str) -> Path:
    """Where a run's logs and outputs go: `keep` (created), else a fresh temporary folder."""
    if keep:
        work = Path(keep).resolve()
        work.mkdir(parents=True, exist_ok=True)
        return work
    return Path(tempfile.mkdtemp(prefix=prefix))


def exit_on_termination() -> None:
    """SIGTERM or SIGHUP end the script through its finally clauses, so the server goes too."""

    def _raise(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)
    signal.signal(signal.SIGHUP, _raise)
