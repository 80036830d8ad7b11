"""`python -m minisgl --dp 2`: two replicas behind sglang-router. Requests sharing a system
prompt reach the replica that cached it (cache-aware policy), a replica killed mid-run loses no
request that had not started on it, and stopping the launcher stops every process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from helpers import tiny_model

from minisgl.server.dp import replica_argv, replica_cpus

SYSTEMS = [
    "You are a patient tutor for chemistry students. Explain every reaction step by step, name "
    "the reagents, give the balanced equation and mention one common mistake students make. " * 3,
    "You are a travel assistant. Suggest itineraries with train connections, museum opening "
    "hours and one local dish per city; keep each answer short and practical for families. " * 3,
    "You review Python code. Point out bugs first, then style issues, then suggest tests that "
    "would have caught each bug; quote the line numbers you talk about in every answer. " * 3,
]
QUESTIONS = ["Question one:", "Question two:", "Question three:", "Question four:"]


def _post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, {}


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _completion(port: int, prompt: str) -> tuple[int, dict]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 3, "temperature": 0}
    return _post(f"http://127.0.0.1:{port}/v1/completions", body)


@pytest.fixture(scope="module")
def dp_server():
    port = 31900 + os.getpid() % 50 * 4
    command = [sys.executable, "-m", "minisgl", "--dp", "2", "--port", str(port)]
    # The tiny random Qwen3 (SmolLM2's tokenizer): routing and caching are the subject, and
    # two replicas loading it start sooner than two loading SmolLM2.
    command += ["--model", str(tiny_model("qwen3")), "--num-pages", "2048"]
    command += ["--served-model-name", "m"]
    proc = subprocess.Popen(command, start_new_session=True)
    deadline = time.monotonic() + 300
    while True:
        try:
            if _get(f"http://127.0.0.1:{port}/v1/models")["data"]:
                break
        except OSError:
            pass
        assert proc.poll() is None, "the --dp launcher exited"
        assert time.monotonic() < deadline, "the router did not come up"
        time.sleep(1)
    yield proc, port
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def test_launcher_options_are_not_passed_to_replicas() -> None:
    argv = ["--dp", "2", "--model", "x", "--port=1919", "--router-policy", "round_robin", "--x"]
    assert replica_argv(argv) == ["--model", "x", "--x"]
    cpus = sorted(os.sched_getaffinity(0))
    shares = [replica_cpus(i, 2) for i in range(2)]
    if len(cpus) >= 2:
        assert not shares[0] & shares[1] and shares[0] | shares[1] <= set(cpus)


def test_cache_aware_routing_keeps_a_system_prompt_on_its_replica(dp_server) -> None:
    _, port = dp_server
    cached = prompt = 0
    for system in SYSTEMS:
        for i, question in enumerate(QUESTIONS):
            status, body = _completion(port, system + question)
            assert status == 200 and body["choices"][0]["text"], body
            if i > 0:  # the first of each system prompt cannot hit
                usage = body["usage"]
                cached += usage["prompt_tokens_details"]["cached_tokens"]
                prompt += usage["prompt_tokens"]
    hit_rate = cached / prompt
    print(f"cache-aware hit rate over repeated system prompts: {hit_rate:.2f}")
    # Every repeat on the replica that holds its system prompt: ~0.9 (round-robin: ~0.6).
    assert hit_rate >= 0.8, hit_rate


def test_a_killed_replica_loses_no_request_that_had_not_started_on_it(dp_server) -> None:
    proc, port = dp_server
    victim = _get(f"http://127.0.0.1:{port + 1}/get_server_info")["pid"]
    os.killpg(os.getpgid(victim), signal.SIGKILL)
    for i in range(8):
        status, body = _completion(port, SYSTEMS[i % 3] + f"After the crash {i}:")
        assert status == 200 and body["choices"][0]["text"], (i, status)
    assert proc.poll() is None  # the launcher keeps serving through the other replica
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    survivor = f"http://127.0.0.1:{port + 2}/health"
    with pytest.raises(OSError):
        urllib.request.urlopen(survivor, timeout=2)
