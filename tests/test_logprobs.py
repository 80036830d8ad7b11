"""Log-probabilities against HF's float32 `log_softmax` at the same positions (within 1e-4):
offline and over HTTP with the official client, chat and completions, streamed or not, echo'd
prompts, vLLM's prompt_logprobs, chunked prefill, overlap and radix-cache hits."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from helpers import (
    MIXED_PROMPTS,
    assert_all_pages_free,
    build_llm,
    greedy,
    hf_encode,
    hf_greedy,
    hf_logits,
)
from helpers import tiny_model as tiny_model_path
from test_server import wait_healthy

from minisgl.core import SamplingParams
from minisgl.tokenizer import encode_chat, load_tokenizer

MODEL = "qwen3"
TOL = 1e-4
# One token (no prompt logprob at all), a short one, one of several prefill chunks.
PROMPTS = [MIXED_PROMPTS[0], MIXED_PROMPTS[1], MIXED_PROMPTS[6]]


def hf_logprobs(ids: list[int]) -> torch.Tensor:
    """HF float32 log_softmax at every position of ids: [len(ids), vocab]."""
    return torch.log_softmax(hf_logits(MODEL, ids), dim=-1)


def assert_top(got: list[float], want_values: torch.Tensor) -> None:
    """A top-k list's values equal HF's k largest, in order."""
    assert len(got) == len(want_values)
    for value, want in zip(got, want_values.tolist()):
        assert abs(value - want) <= TOL, (got, want_values)


def assert_entries_match(entries: list, ids: list[int], first: int) -> None:
    """Offline entries [token, logprob, [[id, logprob], ...]] for ids[first:], each position's
    against HF's log_softmax at the position before it."""
    ref = hf_logprobs(ids)
    assert [e[0] for e in entries] == ids[first:]
    for j, (token, logprob, top) in enumerate(entries, start=first):
        if j == 0:
            assert logprob is None and top == []
            continue
        assert abs(logprob - ref[j - 1, token].item()) <= TOL
        values, alt_ids = ref[j - 1].topk(len(top))
        assert_top([lp for _, lp in top], values)
        for k, (alt, _) in enumerate(top):  # ids in HF's order where no tie blurs it
            apart = [abs(values[k] - values[m]).item() for m in (k - 1, k + 1) if 0 <= m < len(top)]
            if all(gap > 2 * TOL for gap in apart):
                assert alt == alt_ids[k].item()


@pytest.mark.parametrize("overlap", [False, True])
def test_offline_logprobs_equal_hf_with_chunks_and_cache_hits(overlap) -> None:
    torch.set_num_threads(1)
    llm = build_llm(MODEL, max_prefill_length=8, page_size=4, overlap_schedule=overlap)
    params = greedy(6, logprobs=4, prompt_logprobs=3)
    for _ in range(2):  # the second round's prompts are in the radix tree
        for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
            ids = hf_encode(MODEL, prompt)
            assert out["cached_tokens"] == 0  # prompt logprobs recompute the whole prompt
            assert_entries_match(out["prompt_logprobs"], ids, 0)
            assert_entries_match(out["logprobs"], ids + out["token_ids"], len(ids))
    # Without prompt logprobs the same prompts are cache hits, with the same token logprobs.
    plain = llm.generate(PROMPTS, greedy(6, logprobs=1))
    assert all("prompt_logprobs" not in o for o in plain)
    assert all(o["cached_tokens"] > 0 for o in plain[1:])  # the first is shorter than a page
    for prompt, out in zip(PROMPTS, plain):
        ids = hf_encode(MODEL, prompt)
        assert_entries_match(out["logprobs"], ids + out["token_ids"], len(ids))
    assert_all_pages_free(llm)
    llm.shutdown()


def test_processed_logprobs_are_the_distribution_sampled_from() -> None:
    """processed_logprobs: log_softmax of HF's logits / temperature with top-k applied."""
    llm = build_llm(MODEL, logprobs_mode="processed_logprobs")
    temperature, top_k = 0.7, 5
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=5, seed=1, logprobs=3)
    out = llm.generate([PROMPTS[1]], params)[0]
    ids = hf_encode(MODEL, PROMPTS[1])
    logits = hf_logits(MODEL, ids + out["token_ids"]).double()
    for j, (token, logprob, top) in enumerate(out["logprobs"]):
        row = logits[len(ids) - 1 + j] / temperature
        row = row.masked_fill(row < row.topk(top_k).values[-1], float("-inf"))
        ref = torch.log_softmax(row, dim=-1)
        assert torch.isfinite(ref[token]) and abs(logprob - ref[token].item()) <= TOL
        assert_top([lp for _, lp in top], ref.topk(3).values)
    llm.shutdown()


# ---------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def server(tiny_qwen3_server):
    """The session's server on the tiny float32 Qwen3 (prefill in chunks of 16; conftest.py)."""
    return wait_healthy(tiny_qwen3_server)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(tiny_model_path(MODEL)))


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token_id)])


def test_chat_logprobs_streamed_and_not(client, model, tokenizer) -> None:
    messages = [{"role": "user", "content": "Name a color."}]
    prompt_ids = encode_chat(tokenizer, messages)
    kw = dict(model=model, messages=messages, max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    ids = list(prompt_ids)
    for item in content:  # greedy: each token is the argmax of HF's row
        ref = hf_logprobs(ids)[-1]
        values, top_ids = ref.topk(3)
        assert abs(item.logprob - values[0].item()) <= TOL
        assert item.token == token_text(tokenizer, int(top_ids[0]))
        assert item.bytes == list(item.token.encode())
        assert_top([alt.logprob for alt in item.top_logprobs], values)
        ids.append(int(top_ids[0]))
    pieces = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3, stream=True)
    streamed = [
        i
        for c in pieces
        if c.choices and c.choices[0].logprobs
        for i in c.choices[0].logprobs.content
    ]
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in content]
    assert client.chat.completions.create(**kw).choices[0].logprobs is None


def test_completions_echo_logprobs_and_prompt_logprobs(client, model, tokenizer) -> None:
    prompt = PROMPTS[1]
    prompt_ids = hf_encode(MODEL, prompt)
    kw = dict(model=model, prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True)
    resp = client.completions.create(**kw, extra_body={"prompt_logprobs": 1})
    choice = resp.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    n = len(prompt_ids)
    assert len(lp.tokens) == n + resp.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    ids = prompt_ids + hf_greedy(MODEL, [prompt], resp.usage.completion_tokens)[0]
    ref = hf_logprobs(ids)
    for j in range(1, len(lp.tokens)):
        assert abs(lp.token_logprobs[j] - ref[j - 1, ids[j]].item()) <= TOL
        assert lp.tokens[j] == token_text(tokenizer, ids[j])
        # The two likeliest and the token itself (OpenAI: up to logprobs + 1 entries).
        alternatives = lp.top_logprobs[j]
        assert alternatives[lp.tokens[j]] == lp.token_logprobs[j] and len(alternatives) <= 3
        assert_top(sorted(alternatives.values(), reverse=True)[:2], ref[j - 1].topk(2).values)
    # vLLM's prompt_logprobs: None, then {id: {logprob, decoded_token}} per prompt token.
    positions = choice.model_extra["prompt_logprobs"]
    assert positions[0] is None and len(positions) == n
    for j in range(1, n):
        entry = positions[j][str(prompt_ids[j])]
        assert abs(entry["logprob"] - ref[j - 1, prompt_ids[j]].item()) <= TOL
    # Again (the prompt is in the radix tree now), streamed: the same tokens and values.
    stream = client.completions.create(**kw, stream=True)
    tokens, values, text = [], [], ""
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            if chunk.choices[0].logprobs is not None:
                tokens += chunk.choices[0].logprobs.tokens
                values += chunk.choices[0].logprobs.token_logprobs
    assert text == choice.text and tokens == lp.tokens
    assert values[0] is None
    assert all(abs(a - b) <= TOL for a, b in zip(values[1:], lp.token_logprobs[1:]))


def test_echo_of_token_ids_and_without_logprobs(client, model, tokenizer) -> None:
    text = PROMPTS[1]
    ids = hf_encode(MODEL, text)
    plain = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0)
    echoed = client.completions.create(
        model=model, prompt=ids, max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == tokenizer.decode(ids) + plain.choices[0].text
    assert echoed.choices[0].logprobs is None
    by_text = client.completions.create(
        model=model, prompt=text, max_tokens=4, temperature=0, echo=True, logprobs=0
    )
    lp = by_text.choices[0].logprobs
    assert by_text.choices[0].text == text + plain.choices[0].text
    assert lp.top_logprobs[1] == {lp.tokens[1]: lp.token_logprobs[1]}
    assert len(lp.tokens) == len(ids) + 4


def test_sglang_generate_logprobs(server) -> None:
    """SGLang's /generate: return_logprob with logprob_start_len 0 and top_logprobs_num, the
    [logprob, token id, text] triples against HF (streamed: the same, cumulative)."""
    prompt = PROMPTS[2]
    ids = hf_encode(MODEL, prompt)
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    meta = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()["meta_info"]
    inputs, outputs = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert [t[1] for t in inputs] == ids and inputs[0][0] is None
    assert len(outputs) == meta["completion_tokens"] == 4
    full = ids + [t[1] for t in outputs]
    ref = hf_logprobs(full)
    for j, (logprob, token, _text) in enumerate(inputs[1:] + outputs, start=1):
        assert token == full[j] and abs(logprob - ref[j - 1, token].item()) <= TOL
    for j, top in enumerate(meta["input_top_logprobs"][1:] + meta["output_top_logprobs"], 1):
        assert_top([v for v, _, _ in top], ref[j - 1].topk(2).values)
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    last = json.loads(events[-2])["meta_info"]  # the one before [DONE]: everything so far
    assert last["output_token_logprobs"] == outputs
