"""Server lifecycle and fault isolation on a tiny model: a fault in one request's processing
fails that request alone; a dying engine ends every open request with an error and takes the
server down (non-zero exit, traceback logged), never a hang."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time

import httpx
import psutil
import pytest
from helpers import tiny_model
from test_server import metrics, start_server, wait_for

from minisgl.utils.faults import STALL_S

ARGS = ["--dtype", "float32", "--num-pages", "2048", "--max-seq-len", "1024"]
# Each site fails the request whose text carries its marker (see minisgl.utils.faults);
# compile_stall holds a constraint's compile for STALL_S, past the faulty server's time limit.
FAULTS = (
    "tokenize:@@tok@@;detokenize:@@detok@@;schedule:@@sched@@;crash:@@crash@@;"
    "compile_stall:@@stall@@"
)
COMPILE_TIMEOUT_S = 1
GOOD_TOKENS = 48


class Stream(threading.Thread):
    """A streamed completion read in the background: its SSE data lines, and an event set
    once the first one arrived."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True}
        self.lines: list[str] = []
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body) as r:
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started.set()
        except httpx.HTTPError as exc:
            self.lines.append(f"transport error: {exc}")
        finally:
            self.started.set()

    @property
    def ended_with_error(self) -> bool:
        return (
            len(self.lines) >= 2
            and self.lines[-1] == "data: [DONE]"
            and "error" in json.loads(self.lines[-2][len("data: ") :])
        )


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    log = tmp_path_factory.mktemp("faults") / "server.log"
    args = [*ARGS, "--grammar-compile-timeout", str(COMPILE_TIMEOUT_S)]
    server = start_server(tiny_model("qwen3"), args, log, env={"MINISGL_FAULT_INJECT": FAULTS})
    yield server
    server.stop(signal.SIGKILL if server.proc.poll() is None else signal.SIGTERM)


async def _request(http: httpx.AsyncClient, body: dict, chat: bool = False) -> dict:
    """One request: its status and JSON body, or (streamed) its parsed events and whether
    [DONE] ended them."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not body.get("stream"):
        r = await http.post(path, json=body)
        return {"status": r.status_code, "json": r.json()}
    async with http.stream("POST", path, json=body) as r:
        lines = [line async for line in r.aiter_lines() if line]
    data = [json.loads(x[6:]) for x in lines[:-1]]
    return {"status": r.status_code, "events": data, "done": lines[-1] == "data: [DONE]"}


def test_injected_faults_fail_only_their_request(faulty):
    good = {"prompt": "Hi", "max_tokens": GOOD_TOKENS, "ignore_eos": True, "temperature": 0}
    stream_usage = {"stream": True, "stream_options": {"include_usage": True}}
    faults = {
        "tokenize": ({**good, "prompt": "Hi @@tok@@"}, False),
        "tokenize-chat": ({"messages": [{"role": "user", "content": "@@tok@@"}]}, True),
        "detokenize": ({**good, "stop": ["@@detok@@"]}, False),
        "detokenize-stream": ({**good, "stop": ["@@detok@@"], "stream": True}, False),
        "schedule": ({**good, "stop": ["@@sched@@"]}, False),
    }

    async def run() -> tuple[list[dict], dict[str, dict]]:
        async with httpx.AsyncClient(base_url=faulty.url, timeout=120) as http:
            goods = [_request(http, {**good, **stream_usage}) for _ in range(4)]
            bads = [_request(http, body, chat) for body, chat in faults.values()]
            results = await asyncio.gather(*goods, *bads)
        return results[:4], dict(zip(faults, results[4:]))

    goods, bads = asyncio.run(run())
    for result in goods:  # the concurrent good requests completed in full
        assert result["status"] == 200 and result["done"]
        assert not any("error" in e for e in result["events"])
        assert result["events"][-1]["usage"]["completion_tokens"] == GOOD_TOKENS
    for name, result in bads.items():
        if name == "detokenize-stream":  # the failure came mid-stream, after the headers
            assert result["status"] == 200 and result["done"], result
            error = result["events"][-1]["error"]
        else:
            assert result["status"] == 500, (name, result)
            error = result["json"]["error"]
        assert (error["type"], error["code"]) == ("server_error", "request_failed"), name
        assert "fault injected" in error["message"], (name, error)
    # The engine kept serving, and the failed requests hold nothing.
    assert httpx.get(f"{faulty.url}/health").json() == {"status": "ok"}
    r = httpx.post(f"{faulty.url}/v1/completions", json={**good, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    settled = wait_for(
        lambda: (
            (m := metrics(faulty.url))["minisgl_num_requests_running"] == 0
            and m["minisgl_page_accounting_ok"] == 1
            and m
        ),
        what="the failed requests' pages to be freed",
    )
    assert settled["minisgl_num_requests_waiting"] == 0


def test_slow_grammar_compile_fails_alone_and_later_compiles_go_on(faulty):
    """A constraint whose compile stalls (STALL_S, past --grammar-compile-timeout) fails alone
    with a 400 naming the limit, at the limit; constrained requests beside it and after it are
    compiled meanwhile, on other threads, while the stalled compile is still running."""
    plain = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}
    choice = {**plain, "guided_choice": ["cat", "dog"]}
    digits = {**plain, "guided_regex": "[0-9]{3}"}
    stalled = {**plain, "guided_regex": "@@stall@@[0-9]"}
    native_stalled = {"text": "Hi", "sampling_params": {"regex": "[a-z]@@stall@@"}}

    async def timed(http: httpx.AsyncClient, path: str, body: dict) -> tuple[int, dict, float]:
        r = await http.post(path, json=body)
        return r.status_code, r.json(), time.monotonic() - start

    async def run() -> list[list[tuple[int, dict, float]]]:
        async with httpx.AsyncClient(base_url=faulty.url, timeout=60) as http:
            # The first constraint builds the compiler's vocabulary (~0.6 s) before any compile.
            assert (await http.post("/v1/completions", json=choice)).status_code == 200
            nonlocal start
            start = time.monotonic()
            beside = await asyncio.gather(
                timed(http, "/v1/completions", stalled),
                *(timed(http, "/v1/completions", b) for b in (choice, digits, plain)),
            )
            after = await asyncio.gather(  # past the limit, the stalled compile still running
                timed(http, "/generate", native_stalled),
                timed(http, "/v1/completions", digits),
            )
        return [beside, after]

    start = 0.0
    beside, after = asyncio.run(run())
    for status, body, _ in (beside[0], after[0]):
        assert status == 400, body
        error = body["error"]
        assert (error["code"], error["type"]) == (
            "grammar_compile_timeout",
            "invalid_request_error",
        )
        assert f"--grammar-compile-timeout={COMPILE_TIMEOUT_S}s" in error["message"], error
    # Failed at the limit, not once the stall was over.
    assert COMPILE_TIMEOUT_S <= beside[0][2] < STALL_S, beside[0]
    for status, body, elapsed in (*beside[1:], after[1]):
        assert status == 200, body
        # Done while the first stalled compile still runs: nothing queued behind it.
        assert elapsed < STALL_S, (body, elapsed)
    texts = [body["choices"][0]["text"] for _, body, _ in (beside[1], beside[2], after[1])]
    assert texts[0] in ("cat", "dog") and re.fullmatch("[0-9]{3}", texts[1]), texts
    assert re.fullmatch("[0-9]{3}", texts[2]), texts
    assert httpx.get(f"{faulty.url}/health").json() == {"status": "ok"}


def test_zz_engine_failure_ends_open_requests_and_exits(faulty):
    """Runs last on this server: the scheduler process raises outside any request's handling
    (the "crash" fault site) while a stream is open."""
    children = psutil.Process(faulty.proc.pid).children(recursive=True)
    # 16 samples of 1,000 tokens: seconds of work, so the stream is still open when the crash
    # request gets through (one sample of the tiny model once finished first).
    long = {"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True}
    stream = Stream(faulty.url, {**long, "n": 16, "temperature": 1.0})
    stream.start()
    assert stream.started.wait(60)
    r = httpx.post(f"{faulty.url}/v1/completions", json={**long, "stop": ["@@crash@@"]}, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
    assert faulty.proc.wait(30) == 1
    stream.join(10)
    assert not stream.is_alive(), "the in-flight stream hung"
    assert stream.ended_with_error, stream.lines[-3:]
    log = faulty.log_text()
    assert "scheduler process failed" in log and "InjectedFault" in log and "Traceback" in log
    assert re.search(r"the scheduler process \(pid \d+\) died \(exit code 1\)", log)
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [p.pid for p in alive]


def test_dead_scheduler_takes_the_server_down(tmp_path):
    server = start_server(tiny_model("qwen3"), ARGS, tmp_path / "server.log")
    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
        pid = int(re.search(r"scheduler process ready \(pid (\d+)\)", server.log_text())[1])
        # A long stream in flight when the scheduler dies must end with an error, not hang.
        stream = Stream(server.url, {"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True})
        stream.start()
        assert stream.started.wait(60)
        psutil.Process(pid).kill()
        assert server.proc.wait(30) == 1
        stream.join(10)
        assert not stream.is_alive(), "the in-flight stream hung"
        assert stream.ended_with_error, stream.lines[-3:]
        log = server.log_text()
        assert f"the scheduler process (pid {pid}) died (signal 9); shutting down" in log
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, [p.pid for p in alive]
    finally:
        server.stop(signal.SIGKILL)


def _slow_to_stop(folder: str) -> None:
    """A worker whose shutdown takes a second after SIGTERM (a scheduler writing the disk tier)."""
    import os
    from pathlib import Path

    def stop(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's own SIGTERM follows
        time.sleep(1.0)
        (Path(folder) / "stopped").write_text("done")
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    (Path(folder) / "ready").write_text("")
    while True:
        time.sleep(0.05)


def test_stopping_waits_for_a_worker_whose_fork_server_died(tmp_path):
    """A SIGTERM to the whole process group (`kill -- -PGID`, systemd) kills the fork server
    too, after which multiprocessing reports its workers dead while they still shut down: the
    launcher waited on nothing, exited, and the scheduler (its parent gone) quit mid-write of the
    disk tier. stop_processes waits for the worker's own exit."""
    import os
    from multiprocessing import forkserver

    from minisgl.utils.mp import running, spawn, start_method, stop_processes

    if start_method() != "forkserver":
        pytest.skip("workers start without a fork server on this platform")
    worker = spawn(_slow_to_stop, "slow-to-stop", (str(tmp_path),))
    wait_for(lambda: (tmp_path / "ready").exists(), timeout=60)
    os.kill(forkserver._forkserver._forkserver_pid, signal.SIGTERM)
    worker.join(10)
    assert not worker.is_alive() and running(worker)  # multiprocessing's view, and the pid's
    os.kill(worker.pid, signal.SIGTERM)  # the group-wide signal's share
    stop_processes([worker], timeout_s=30)
    assert (tmp_path / "stopped").read_text() == "done"
    assert not running(worker)
