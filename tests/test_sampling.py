"""Sampling: per-request parameters in one batch, seeds, penalties (vs HF where it has them)."""

from __future__ import annotations

import pytest
import torch
from helpers import MIXED_PROMPTS, build_llm, greedy, hf_greedy

from minisgl.core import Req, SamplingParams
from minisgl.engine import Sampler
from minisgl.kernel.cpu import cpu_kernels
from minisgl.kernel.ops import TORCH_OPS

_sample_rows_torch = TORCH_OPS.sample_rows


@pytest.fixture(scope="module")
def llm():
    llm = build_llm("qwen3")
    yield llm
    llm.shutdown()


def _req(params: SamplingParams, ids: list[int], prompt_len: int | None = None) -> Req:
    prompt_len = len(ids) if prompt_len is None else prompt_len
    req = Req(0, torch.tensor(ids, dtype=torch.int32), params, prompt_len, len(ids) + 8)
    req.table_idx, req.device_len = 0, len(ids)
    return req


def test_seed_is_reproducible_across_batches(llm) -> None:
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=1234)
    alone = llm.generate(["Once upon a time"], seeded)[0]["token_ids"]
    mixed = llm.generate(
        ["Hello", "Once upon a time", "def f(x):"],
        [SamplingParams(temperature=0.8, max_tokens=5), seeded, greedy(7)],
    )
    assert mixed[1]["token_ids"] == alone
    other_seed = SamplingParams(temperature=1.0, max_tokens=12, seed=99)
    assert llm.generate(["Once upon a time"], other_seed)[0]["token_ids"] != alone


def test_per_request_params_in_one_batch(llm) -> None:
    want = hf_greedy("qwen3", MIXED_PROMPTS[:4], 6)
    params = [
        SamplingParams(temperature=1.0, top_k=1, max_tokens=6),  # top_k=1 is greedy
        SamplingParams(temperature=0.7, top_p=1e-6, max_tokens=6),  # only the top token left
        SamplingParams(temperature=1.3, min_p=1.0, max_tokens=6),  # only the max stays
        SamplingParams(temperature=5.0, top_k=3, max_tokens=6, seed=1),
    ]
    outputs = llm.generate(MIXED_PROMPTS[:4], params)
    assert [o["token_ids"] for o in outputs[:3]] == want[:3]
    assert len(outputs[3]["token_ids"]) == 6


def test_temperatures_too_small_to_divide_by_are_greedy(llm) -> None:
    """A temperature below 1e-6 samples the greedy tokens (dividing by 1e-45 overflowed every
    logit to infinity and drew from NaNs); the engine keeps serving."""
    want = hf_greedy("qwen3", MIXED_PROMPTS[:3], 6)
    params = [SamplingParams(temperature=t, max_tokens=6, seed=3) for t in (1e-45, 1e-30, 5e-7)]
    outputs = llm.generate(MIXED_PROMPTS[:3], params)
    assert [o["token_ids"] for o in outputs] == want


def test_temperature_sampling_varies(llm) -> None:
    outputs = llm.generate(["Hello"] * 8, SamplingParams(temperature=1.0, max_tokens=4))
    assert len({tuple(o["token_ids"]) for o in outputs}) > 1


def test_sampler_distribution_and_filters() -> None:
    torch.manual_seed(0)
    vocab = 6
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0]) + 1e-9)
    sampler = Sampler(vocab, torch.device("cpu"))
    rows = 20000

    def frequencies(params: SamplingParams) -> torch.Tensor:
        reqs = [_req(params, [1])] * rows
        args = sampler.prepare(reqs)
        tokens = sampler.sample(logits.expand(rows, vocab).clone(), args, torch.zeros(1, 1))
        return torch.bincount(tokens.long(), minlength=vocab).float() / rows

    free = frequencies(SamplingParams(temperature=1.0))
    torch.testing.assert_close(free, torch.softmax(logits, -1), atol=0.02, rtol=0)
    top2 = frequencies(SamplingParams(temperature=1.0, top_k=2))
    assert top2[2:].sum() == 0
    torch.testing.assert_close(top2[:2], torch.tensor([4 / 7, 3 / 7]), atol=0.02, rtol=0)
    nucleus = frequencies(SamplingParams(temperature=1.0, top_p=0.6))  # keeps 0.4 and 0.3
    assert nucleus[2:].sum() == 0
    min_p = frequencies(SamplingParams(temperature=1.0, min_p=0.3))  # keeps p >= 0.12
    assert min_p[3:].sum() == 0 and min_p[2] > 0


def test_presence_and_frequency_penalties() -> None:
    sampler = Sampler(4, torch.device("cpu"))
    # Prompt [0], output so far [1, 1, 2].
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, max_tokens=8)
    args = sampler.prepare([_req(params, [0, 1, 1, 2], prompt_len=1)])
    assert args.penalties is not None
    logits = torch.zeros(1, 4)
    token_pool = torch.tensor([[0, 1, 1, 2, 3, 3]], dtype=torch.int32)  # 3s: not yet known
    out = sampler._apply_penalties(logits, args.penalties, token_pool)
    torch.testing.assert_close(out, torch.tensor([[0.0, -1.0, -0.75, 0.0]]))


def test_repetition_penalty_matches_hf(llm) -> None:
    prompts = MIXED_PROMPTS[1:4]
    outputs = llm.generate(prompts, greedy(10, repetition_penalty=1.5))
    assert [o["token_ids"] for o in outputs] == hf_greedy(
        "qwen3", prompts, 10, repetition_penalty=1.5
    )


def _reference_top_k_top_p(probs, top_k, top_p) -> torch.Tensor:
    """The filters by a full sort of every row."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1])[None, :]
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if top_k is not None:
        drop |= ranks >= top_k
    if top_p is not None:
        drop |= sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))


@pytest.mark.parametrize("spread", [8.0, 0.5])  # peaked (candidates suffice) / flat (full sort)
@pytest.mark.parametrize(
    "top_k,top_p", [(None, 0.9), (5, None), (3000, 0.99), (40, 0.5), (None, 0.999)]
)
def test_top_k_top_p_filters_equal_a_full_sort(spread, top_k, top_p) -> None:
    """The filters first look among each row's top candidates and fall back to sorting the
    whole vocabulary when those cannot decide; either way the kept probabilities are exactly
    a full sort's."""
    from minisgl.engine.sample import TOP_CANDIDATES

    gen = torch.Generator().manual_seed(3)
    vocab = 4 * TOP_CANDIDATES
    probs = torch.softmax(torch.randn(4, vocab, generator=gen) * spread, dim=-1)
    k = None if top_k is None else torch.full((4, 1), top_k)
    p = None if top_p is None else torch.full((4, 1), top_p)
    want = _reference_top_k_top_p(probs, k, p)
    kept, tokens = Sampler._top_k_top_p(probs, k, p)
    got = torch.zeros_like(probs).scatter_(-1, tokens, kept)
    assert torch.equal(got, want)
    assert (got > 0).sum(dim=-1).min() >= 1


@pytest.mark.parametrize("spread", [8.0, 0.5])
def test_rows_of_other_filters_in_one_batch_equal_a_full_sort(spread) -> None:
    """Each row decides by its own filters: top-k within the candidates, top-p by its mass, a
    row without either (top_k = vocab, top_p = 1) over the whole vocabulary."""
    from minisgl.engine.sample import TOP_CANDIDATES

    gen = torch.Generator().manual_seed(5)
    vocab = 4 * TOP_CANDIDATES
    probs = torch.softmax(torch.randn(4, vocab, generator=gen) * spread, dim=-1)
    k = torch.tensor([[40], [vocab], [5], [vocab]])
    p = torch.tensor([[1.0], [0.9], [0.5], [1.0]])
    kept, tokens = Sampler._top_k_top_p(probs, k, p)
    got = torch.zeros_like(probs).scatter_(-1, tokens, kept)
    assert torch.equal(got, _reference_top_k_top_p(probs, k, p))


@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels unavailable on this machine")
def test_a_row_without_filters_draws_as_alone_beside_filtered_rows() -> None:
    """In a batch where another row sets top-k, a row that sets neither top-k nor top-p draws
    from its whole distribution the token it draws alone (the same uniform number): a seeded
    request's tokens do not depend on its batch's filters (a sort of the batch, as before,
    drew them in another order)."""
    from minisgl.engine.sample import TOP_CANDIDATES, SampleArgs
    from minisgl.kernel.ops import ops_for

    gen = torch.Generator().manual_seed(6)
    vocab = 4 * TOP_CANDIDATES
    logits = torch.randn(2, vocab, generator=gen) * 0.5  # flat: most mass past the candidates
    args = SampleArgs(
        all_greedy=False, temperatures=torch.ones(2, 1), top_k=torch.tensor([[vocab], [40]])
    )
    sampler = Sampler(vocab, torch.device("cpu"))
    for u in (0.001, 0.5, 0.999):
        uniforms = torch.tensor([u, 0.5], dtype=torch.float64)
        tokens = sampler._sample_filtered(logits, args, uniforms)
        alone = ops_for(logits).sample_tempered(logits[:1], uniforms[:1], torch.ones(1))
        assert int(tokens[0]) == int(alone[0])
        assert int(tokens[1]) in logits[1].topk(40).indices.tolist()


def test_row_draws_invert_the_distribution_function() -> None:
    """The C draw and the PyTorch one pick the first column whose running sum exceeds u times
    the row's total: the same columns, zero-weight ones never, the ends included."""
    gen = torch.Generator().manual_seed(3)
    weights = torch.rand(64, 1000, generator=gen) ** 4
    weights[:, 700:] = 0.0  # a zero tail
    weights[:, ::3] = 0.0
    weights[1], weights[1, 0] = 0.0, 0.5  # one possible column
    uniforms = torch.rand(64, dtype=torch.float64, generator=gen)
    uniforms[0], uniforms[2], uniforms[3] = 0.0, 1.0 - 2**-53, 0.5
    cdf = weights.double().cumsum(-1)
    want = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
    last = 699 if 699 % 3 else 698
    want[2] = last  # u * total rounds to the total: the last nonzero column
    kernels = cpu_kernels()
    paths = [_sample_rows_torch] + ([kernels.sample_rows] if kernels is not None else [])
    for draw in paths:
        tokens = draw(weights, uniforms)
        assert tokens[0] == 1 and tokens[1] == 0 and tokens[2] == last
        assert bool((weights.gather(1, tokens[:, None]) > 0).all())
        assert torch.equal(tokens, want)


@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels unavailable on this machine")
@pytest.mark.parametrize("k", [1, 17, 1024, 3000])
def test_top_candidates_equal_a_stable_sort(k) -> None:
    """The C selection of each row's k largest (top-k / top-p candidates): exactly the first k
    of a stable descending sort, ties (many here) first column first."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randint(0, 50, (6, 3000), generator=gen).float()
    x[0] = torch.randn(3000, generator=gen)
    x[1] = torch.arange(3000.0)  # ascending: every column beats the kept ones
    values, indices = cpu_kernels().top_candidates(x, k)
    want_values, want_indices = x.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(values, want_values[:, :k]) and torch.equal(indices, want_indices[:, :k])


@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels unavailable on this machine")
def test_draws_from_logits_equal_draws_from_their_softmax() -> None:
    """Temperature alone: the C draw computes softmax(logits / T) as it reads the logits; the
    same uniforms pick the same tokens as the probabilities would, and -inf never."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(64, 1000, generator=gen) * 4
    logits[:, 500:510] = float("-inf")
    temperatures = torch.tensor([0.3, 1.0, 2.5, 7.0]).repeat(16)
    uniforms = torch.rand(64, dtype=torch.float64, generator=gen)
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    tokens = cpu_kernels().sample_rows(logits, uniforms, temperatures)
    assert torch.equal(tokens, _sample_rows_torch(probs, uniforms))
    assert not bool(((tokens >= 500) & (tokens < 510)).any())


def test_penalties_equal_a_dense_reference() -> None:
    """Penalties computed at the history's entries equal the vocabulary-wide formulation, for
    a subset of the batch's rows, repeated tokens and histories of different lengths."""
    gen = torch.Generator().manual_seed(7)
    vocab, batch = 50, 5
    sampler = Sampler(vocab, torch.device("cpu"))
    token_pool = torch.randint(0, 12, (batch, 20), dtype=torch.int32, generator=gen)
    reqs = []
    for row in range(batch):
        params = SamplingParams(
            presence_penalty=0.1 * row, frequency_penalty=0.3, repetition_penalty=1.0 + 0.2 * row
        )
        ids = token_pool[row, : 10 + row].tolist()
        req = _req(params if row != 2 else SamplingParams(), ids, prompt_len=6)
        req.table_idx = row
        reqs.append(req)
    args = sampler.prepare(reqs)
    assert args.penalties is not None
    logits = torch.randn(batch, vocab, generator=gen) * 3
    want = logits.clone()
    for row, req in enumerate(reqs):
        sp = req.sampling_params
        if not sp.has_penalties:
            continue
        history = token_pool[row, : req.device_len].long()
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[history] = True
        counts = torch.zeros(vocab).index_add_(0, history[req.prompt_len :], torch.ones(4 + row))
        x = want[row]
        x = torch.where(
            seen, torch.where(x > 0, x / sp.repetition_penalty, x * sp.repetition_penalty), x
        )
        want[row] = x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0).float()
    for _ in range(2):  # the kept count buffer is zero again after each use
        out = sampler._apply_penalties(logits, args.penalties, token_pool)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-6)


def test_logit_bias_and_min_tokens_adjust_the_batch_in_one_op() -> None:
    """logit_bias adds to its row only, before temperature; min_tokens masks EOS and the
    stop ids of rows short of it (and never one past the vocabulary); the model's logits are
    left as they were (the non-finite check reads them)."""
    sampler = Sampler(6, torch.device("cpu"))
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, 0.0, 0.0]]).repeat(4, 1)
    reqs = [
        _req(SamplingParams(logit_bias={4: 10.0, 0: -100.0}), [1]),
        _req(SamplingParams(min_tokens=2, stop_token_ids=[1, 99]), [1]),  # 0 output so far
        _req(SamplingParams(min_tokens=2, stop_token_ids=[1]), [1, 5, 5], prompt_len=1),  # 2
        _req(SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[1]), [1]),
    ]
    args = sampler.prepare(reqs, eos_ids=frozenset({0}))
    assert args.adjust is not None and args.all_greedy
    before = logits.clone()
    tokens = sampler.sample(logits, args, torch.zeros(1, 1))
    # Row 0: biased to 4; row 1: 0 (EOS) and 1 masked; row 2: has its 2 tokens, EOS free;
    # row 3: ignore_eos leaves 0 (EOS) free, its stop id 1 is still masked.
    assert tokens.tolist() == [4, 2, 0, 0]
    assert torch.equal(logits, before)
    # Sampling (not greedy) reads the adjusted logits too: a masked token is never drawn.
    hot = SamplingParams(temperature=5.0, min_tokens=1, logit_bias={5: -100.0})
    hot_args = sampler.prepare([_req(hot, [1])] * 512, frozenset({0}))
    draws = sampler.sample(torch.zeros(512, 6), hot_args, torch.zeros(1, 1))
    assert set(draws.tolist()) == {1, 2, 3, 4}


def test_min_tokens_and_logit_bias_end_to_end(llm) -> None:
    free = llm.generate(["Hello there"], greedy(8))[0]["token_ids"]
    stop = free[1]  # would end the request at its second token
    held = llm.generate(["Hello there"], greedy(8, stop_token_ids=[stop], min_tokens=5))[0]
    assert len(held["token_ids"]) >= 5
    assert stop not in held["token_ids"][:5]
    biased = llm.generate(["Hello there"], greedy(4, logit_bias={123: 100.0}))[0]
    assert biased["token_ids"] == [123] * 4
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["Hello there"], greedy(4, logit_bias={10**7: 1.0}))
    with pytest.raises(ValueError, match="min_tokens"):
        greedy(4, min_tokens=5)
    assert not llm.has_work
