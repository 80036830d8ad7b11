"""Tensor parallelism over gloo: TP=2 greedy tokens equal TP=1's and HF float32's, and a rank
that dies makes the engine raise instead of hang."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch
from helpers import (
    MIXED_PROMPTS,
    assert_all_pages_free,
    build_llm,
    greedy,
    hf_greedy,
    model_path,
)

from minisgl.distributed.worker import TPWorkerError

# Different lengths: requests leave at different steps and slots are reused mid-run.
MAX_NEW = [12, 5, 16, 9, 3, 14, 7, 10]


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks on a shared 2-core machine: one thread each (workers inherit the env)."""
    monkeypatch.setenv("MINISGL_NUM_THREADS", "1")
    monkeypatch.setenv("MINISGL_TP_TIMEOUT", "60")
    torch.set_num_threads(1)


# llama3: biases on q/k/v, o and the MLP (row-parallel biases added once); qwen3: tied head,
# q/k norms; qwen3-kv1: one KV head replicated on both ranks, untied head, overlap scheduling
# (the step is described as prepared, its input ids sent as it runs).
@pytest.mark.parametrize(
    ("arch", "page_size", "overlap"),
    [
        ("llama3", 1, False),
        ("qwen3", 16, False),
        ("qwen3-kv1", 4, True),
        ("qwen2", 1, False),
        ("mistral", 4, False),
        ("qwen3-moe", 1, False),
        ("qwen3-moe-mixed", 16, True),
    ],
)
def test_tp2_greedy_matches_tp1_and_hf(arch: str, page_size: int, overlap: bool) -> None:
    params = [greedy(n) for n in MAX_NEW]
    kw = dict(page_size=page_size, max_running_req=3, overlap_schedule=overlap)
    # Fewer running slots than prompts (continuous batching), radix cache on.
    llm = build_llm(arch, tp_size=2, **kw)
    try:
        shard = llm.engine.model.shard
        assert shard.size == 2 and llm.engine.num_kv_heads == shard.kv_heads
        outputs = llm.generate(MIXED_PROMPTS, params)
        # Again: the prompts now hit the prefix cache, the page-table rows come from the tree.
        again = llm.generate(MIXED_PROMPTS, params)
        assert_all_pages_free(llm)
        assert sum(o["cached_tokens"] for o in again) > 0
    finally:
        llm.shutdown()
    ref = build_llm(arch, **kw)
    expected = [o["token_ids"] for o in ref.generate(MIXED_PROMPTS, params)]
    ref.shutdown()
    assert [o["token_ids"] for o in outputs] == expected
    assert [o["token_ids"] for o in again] == expected
    assert expected == hf_greedy(arch, MIXED_PROMPTS, MAX_NEW)


def test_tp2_prompt_logprobs_and_chunked_prefill() -> None:
    """Steps that run the head on prompt rows, and chunks that sample nothing, replay too."""
    sp = greedy(4, logprobs=2, prompt_logprobs=1)
    prompts = MIXED_PROMPTS[:4]
    outs = []
    for tp_size in (2, 1):
        llm = build_llm("qwen3-kv1", tp_size=tp_size, max_prefill_length=32)
        try:
            outs.append(llm.generate(prompts, sp))
            assert_all_pages_free(llm)
        finally:
            llm.shutdown()
    for tp2, tp1 in zip(*outs):
        assert tp2["token_ids"] == tp1["token_ids"]
        for got, want in zip(tp2["prompt_logprobs"][1:], tp1["prompt_logprobs"][1:]):
            assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-4)
        for got, want in zip(tp2["logprobs"], tp1["logprobs"]):
            assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-4)


def test_tp2_serves_weights_quantized_at_load_as_tp1() -> None:
    """Each rank quantizes its shard (row-parallel ones cut at whole groups of 32, so the
    groups are TP=1's): greedy output equals TP=1's. A quantized checkpoint's shards:
    test_quantized_checkpoint.py."""
    from minisgl.layers.quantized import QuantizedProjection

    prompts, params = MIXED_PROMPTS[:4], [greedy(n) for n in MAX_NEW[:4]]
    outputs = []
    for tp_size in (2, 1):
        llm = build_llm("qwen3", tp_size=tp_size, quantization="int4-g32")
        try:
            layer = llm.engine.model.model.layers[0]
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                assert isinstance(proj.cpu_projection, QuantizedProjection)
            outputs.append([o["token_ids"] for o in llm.generate(prompts, params)])
            assert_all_pages_free(llm)
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("when", ["idle", "during a step"])
def test_dead_rank_raises_instead_of_hanging(when: str) -> None:
    llm = build_llm("qwen3", tp_size=2)
    assert llm.tp_workers is not None
    worker = llm.tp_workers.processes[0]
    try:
        assert llm.generate(["Hello"], greedy(2))[0]["finish_reason"] == "length"
        if when == "idle":
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(5)
        else:  # killed after rank 0 broadcast the step: rank 0 is inside a collective
            send_step = llm.engine.tp.send_step

            def send_then_kill(*args: object) -> None:
                send_step(*args)  # type: ignore[arg-type]
                os.kill(worker.pid, signal.SIGKILL)

            llm.engine.tp.send_step = send_then_kill  # type: ignore[method-assign]
        start = time.monotonic()
        with pytest.raises(TPWorkerError, match="rank 1"):
            llm.generate(["Hello again"], greedy(2))
        assert time.monotonic() - start < 30
    finally:
        llm.shutdown()
    assert not worker.is_alive()


def test_server_tp_flag() -> None:
    from minisgl.server.args import parse_args

    assert parse_args(["--tp", "2"]).engine_kwargs()["tp_size"] == 2
    assert parse_args(["--tp-size", "3"]).tp_size == 3
    assert parse_args([]).engine_kwargs()["tp_size"] == 1


def test_shard_refuses_what_does_not_split() -> None:
    from minisgl.models import load_model_config
    from minisgl.models.sharding import Shard

    config = load_model_config(model_path("qwen3-kv1"))  # 4 q heads, 1 KV head
    assert Shard(config, 1, 4).kv_heads == 1 and Shard(config, 3, 4).kv_head_start == 0
    with pytest.raises(ValueError, match="attention heads"):
        Shard(config, 0, 3)
    moe = load_model_config(model_path("qwen3-moe"))
    assert Shard(moe, 1, 2).moe_intermediate == moe.moe_intermediate_size // 2
    odd = dataclasses.replace(moe, moe_intermediate_size=moe.moe_intermediate_size + 1)
    with pytest.raises(ValueError, match="expert intermediate size"):
        Shard(odd, 0, 2)


def test_two_nodes_on_one_machine_serve_one_model() -> None:
    """`--nnodes 2 --node-rank 0/1 --dist-init-addr`: two processes, one rank each, serve one
    model (greedy text equal to one process's); stopping node 0 ends node 1."""
    import json
    import socket
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        meet = s.getsockname()[1]
    port = meet + 1 if meet < 65000 else meet - 1
    common = [sys.executable, "-m", "minisgl", "--model", str(model_path("llama3"))]
    common += ["--dtype", "float32", "--tp", "2", "--nnodes", "2", "--num-pages", "512"]
    common += ["--dist-init-addr", f"127.0.0.1:{meet}", "--served-model-name", "m"]
    node1 = subprocess.Popen([*common, "--node-rank", "1"], start_new_session=True)
    node0 = subprocess.Popen([*common, "--node-rank", "0", "--port", str(port)])
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert node0.poll() is None and node1.poll() is None, "a node exited"
                assert time.monotonic() < deadline, "the nodes did not come up"
                time.sleep(0.5)
        prompt = "The capital of France is"
        body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            text = json.loads(response.read())["choices"][0]["text"]
        ref = build_llm("llama3")
        assert text == ref.generate([prompt], greedy(8))[0]["text"]
        ref.shutdown()
        node0.send_signal(signal.SIGTERM)
        assert node0.wait(timeout=60) == 0
        node1.wait(timeout=60)  # its rank saw rank 0 leave
    finally:
        if node0.poll() is None:
            node0.kill()
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)


def test_multi_node_needs_the_meeting_point_and_the_pool_size() -> None:
    from minisgl.engine.config import EngineConfig

    with pytest.raises(ValueError, match="dist_init_addr"):
        EngineConfig(model_path="x", tp_size=2, nnodes=2, num_page_override=64)
    with pytest.raises(ValueError, match="nnodes"):
        EngineConfig(model_path="x", tp_size=3, nnodes=2)
