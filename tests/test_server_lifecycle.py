"""Server lifecycle on a tiny model: a dying worker takes the server down, never a hang."""

from __future__ import annotations

import re
import signal
import threading

import httpx
import psutil
from helpers import tiny_model
from test_server import start_server

ARGS = ["--dtype", "float32", "--num-pages", "2048", "--max-seq-len", "1024"]


def test_dead_scheduler_takes_the_server_down(tmp_path):
    server = start_server(tiny_model("qwen3"), ARGS, tmp_path / "server.log")
    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
        pid = int(re.search(r"scheduler process ready \(pid (\d+)\)", server.log_text())[1])
        # A long stream in flight when the scheduler dies must end, not hang.
        body = {"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        started, ended = threading.Event(), threading.Event()

        def stream() -> None:
            try:
                with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                    for _ in r.iter_lines():
                        started.set()
            except httpx.HTTPError:
                pass
            finally:
                started.set()
                ended.set()

        threading.Thread(target=stream, daemon=True).start()
        assert started.wait(60)
        psutil.Process(pid).kill()
        assert server.proc.wait(30) == 1
        assert ended.wait(10), "the in-flight stream hung"
        log = server.log_text()
        assert f"the scheduler process (pid {pid}) died (signal 9); shutting down" in log
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, [p.pid for p in alive]
    finally:
        server.stop(signal.SIGKILL)
