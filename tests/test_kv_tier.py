"""The disk KV tier (--kv-cache-dir): KV computed by one engine restores in the next, greedy
output equal to HF float32 whatever the tier serves or refuses; damaged, foreign, over-budget
and shared files handled; pages accounted for after every run."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import httpx
import openai
import pytest
import torch
from helpers import (
    assert_all_pages_free,
    build_llm,
    greedy,
    hf_greedy,
    model_path,
    spy_prefill_tokens,
)

from minisgl.kvcache import chunk_keys, chunk_tokens
from minisgl.kvcache.disk_tier import DiskKVTier
from minisgl.kvcache.tier_file import SUFFIX

torch.set_num_threads(2)

MODEL = "qwen3"
# 300 distinct-looking ids: 299 matchable tokens restore 4 whole chunks of 64.
PROMPT = [100 + (i * 7919) % 30000 for i in range(300)]
OTHER = [200 + (i * 104729) % 30000 for i in range(300)]
NEW_TOKENS = 8


def restorable(prompt: list[int], page_size: int = 1) -> int:
    """Tokens a restart can restore: the matchable prompt (all but the last) in whole chunks."""
    c = chunk_tokens(page_size)
    return (len(prompt) - 1) // c * c


def tier_of(llm) -> DiskKVTier:
    tier = llm.cache_manager.tier
    assert tier is not None, "the engine runs without its tier"
    return tier


def run(llm, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens and cached prompt tokens of one request; pages accounted for after."""
    out = llm.generate([prompt], greedy(NEW_TOKENS))[0]
    assert_all_pages_free(llm)
    return out["token_ids"], out["cached_tokens"]


def cold_run(tmp_path: Path, prompt: list[int] = PROMPT, **kw) -> Path:
    """Compute `prompt` on a fresh engine whose shutdown writes it to the tier; the tier dir."""
    llm = build_llm(MODEL, kv_cache_dir=tmp_path, **kw)
    tokens, cached = run(llm, prompt)
    assert cached == 0 and tokens == hf_greedy(MODEL, [prompt], NEW_TOKENS)[0]
    directory = tier_of(llm).dir
    llm.shutdown()
    return directory


def chunk_file(directory: Path, prompt: list[int], index: int, page_size: int = 1) -> Path:
    c = chunk_tokens(page_size)
    key = chunk_keys(directory.name, torch.tensor(prompt), c, index + 1)[index]
    return directory / key[:2] / (key + SUFFIX)


@pytest.mark.parametrize(("page_size", "overlap"), [(1, False), (16, False), (4, True)])
def test_restart_restores_the_prompt_and_matches_hf(tmp_path, page_size, overlap):
    cold_run(tmp_path, page_size=page_size, overlap_schedule=overlap)
    llm = build_llm(MODEL, kv_cache_dir=tmp_path, page_size=page_size, overlap_schedule=overlap)
    computed = spy_prefill_tokens(llm)
    tokens, cached = run(llm, PROMPT)
    assert cached == restorable(PROMPT, page_size) >= 256
    assert sum(computed) == len(PROMPT) - cached  # the restored part was not recomputed
    assert tokens == hf_greedy(MODEL, [PROMPT], NEW_TOKENS)[0]
    stats = tier_of(llm).stats
    assert stats.tokens_loaded == cached and stats.corrupt_skipped == 0
    llm.shutdown()


def test_evicted_kv_is_written_and_loaded_back_in_one_engine(tmp_path):
    # A pool of 400 tokens: the second prompt evicts the first, whose chunks go to disk.
    llm = build_llm(MODEL, kv_cache_dir=tmp_path, num_page_override=400)
    want = hf_greedy(MODEL, [PROMPT, OTHER], NEW_TOKENS)
    assert run(llm, PROMPT)[0] == want[0]
    assert run(llm, OTHER)[0] == want[1]
    tier = tier_of(llm)
    tier.wait_writes()
    assert tier.stats.chunks_written >= restorable(PROMPT) // tier.chunk
    tokens, cached = run(llm, PROMPT)
    assert tokens == want[0] and cached >= restorable(PROMPT)
    assert tier.stats.tokens_loaded > 0
    llm.shutdown()


def test_memory_match_ending_mid_chunk_continues_on_disk(tmp_path):
    cold_run(tmp_path)
    llm = build_llm(MODEL, kv_cache_dir=tmp_path)
    branch = PROMPT[:100] + OTHER[:50]  # leaves PROMPT[:100] in memory: 36 tokens into chunk 1
    assert run(llm, branch)[0] == hf_greedy(MODEL, [branch], NEW_TOKENS)[0]
    loaded = tier_of(llm).stats.tokens_loaded
    computed = spy_prefill_tokens(llm)
    tokens, cached = run(llm, PROMPT)
    assert tokens == hf_greedy(MODEL, [PROMPT], NEW_TOKENS)[0]
    assert cached == restorable(PROMPT) and sum(computed) == len(PROMPT) - cached
    assert tier_of(llm).stats.tokens_loaded - loaded == restorable(PROMPT) - 100
    llm.shutdown()


def test_a_busy_writer_drops_writes_instead_of_stalling(tmp_path, monkeypatch):
    import threading

    from minisgl.kvcache import disk_tier

    release = threading.Event()
    write_chunk = disk_tier.write_chunk

    def slow_write(*args):
        release.wait()
        return write_chunk(*args)

    monkeypatch.setattr(disk_tier, "write_chunk", slow_write)
    llm = build_llm(MODEL, kv_cache_dir=tmp_path, num_page_override=400)
    tier = tier_of(llm)
    tier.max_pending_bytes = tier.chunk_bytes  # one chunk in flight at most
    prompts = [PROMPT, OTHER, PROMPT[::-1]]
    for prompt, want in zip(prompts, hf_greedy(MODEL, prompts, NEW_TOKENS)):
        assert run(llm, prompt)[0] == want  # the writer is stuck: the engine is not
    assert tier.stats.writes_dropped > 0 and tier.stats.chunks_written == 0
    release.set()
    llm.shutdown()
    assert tier.stats.chunks_written > 0


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # inside the payload
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def _stale_version(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:12] = struct.pack("<I", 0)
    path.write_bytes(bytes(data))


def _wrong_ids(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[50] ^= 1  # a token id in the header's copy
    path.write_bytes(bytes(data))


DAMAGES = {
    "flip": _flip,
    "truncate": _truncate,
    "stale": _stale_version,
    "ids": _wrong_ids,
    "delete": Path.unlink,
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_files_are_recomputed_never_served(tmp_path, damage):
    directory = cold_run(tmp_path)
    DAMAGES[damage](chunk_file(directory, PROMPT, 2))
    want = hf_greedy(MODEL, [PROMPT], NEW_TOKENS)[0]
    llm = build_llm(MODEL, kv_cache_dir=tmp_path)
    computed = spy_prefill_tokens(llm)
    tokens, cached = run(llm, PROMPT)
    assert tokens == want
    assert cached == 2 * 64  # chunks 0 and 1; chunk 2 and what chains on it are recomputed
    assert sum(computed) == len(PROMPT) - cached
    stats = tier_of(llm).stats
    assert stats.corrupt_skipped == (0 if damage == "delete" else 1)
    llm.shutdown()  # writes the recomputed chunks again
    assert chunk_file(directory, PROMPT, 2).exists()
    llm = build_llm(MODEL, kv_cache_dir=tmp_path)
    tokens, cached = run(llm, PROMPT)
    assert tokens == want and cached == restorable(PROMPT)
    llm.shutdown()


@pytest.mark.parametrize(
    "change",
    [dict(page_size=4), dict(dtype=torch.bfloat16), dict(model="qwen3-kv1")],
    ids=["page_size", "dtype", "model"],
)
def test_another_fingerprint_never_reads_the_files(tmp_path, change):
    directory = cold_run(tmp_path)
    before = {p: p.stat().st_mtime_ns for p in directory.rglob("*" + SUFFIX)}
    assert len(before) == restorable(PROMPT) // 64
    change = dict(change)
    name = change.pop("model", MODEL)
    llm = build_llm(name, kv_cache_dir=tmp_path, **change)
    out = llm.generate([PROMPT], greedy(NEW_TOKENS))[0]
    assert out["cached_tokens"] == 0
    tier = tier_of(llm)
    assert tier.dir != directory and tier.stats.chunks_read == tier.stats.corrupt_skipped == 0
    if "dtype" not in change:  # HF float32 is the oracle of float32 runs
        assert out["token_ids"] == hf_greedy(name, [PROMPT], NEW_TOKENS)[0]
    assert_all_pages_free(llm)
    llm.shutdown()
    assert {p: p.stat().st_mtime_ns for p in directory.rglob("*" + SUFFIX)} == before


def test_disk_budget_is_respected(tmp_path):
    # Room for 5 chunk files of this model (2 layers, 2 KV heads of 128, float32).
    file_bytes = 2 * 2 * 64 * 2 * 128 * 4 + 44 + 4 * 64
    gb = 5 * file_bytes / 2**30
    prompts = [[1000 * k + (i * 31) % 997 for i in range(300)] for k in range(1, 4)]
    llm = build_llm(MODEL, kv_cache_dir=tmp_path, kv_cache_disk_gb=gb, num_page_override=400)
    want = hf_greedy(MODEL, prompts, NEW_TOKENS)
    for prompt, expected in zip(prompts, want):
        assert run(llm, prompt)[0] == expected
    tier = tier_of(llm)
    directory = tier.dir
    llm.shutdown()
    sizes = [p.stat().st_size for p in directory.rglob("*" + SUFFIX)]
    assert sizes and all(s == file_bytes for s in sizes)
    assert sum(sizes) <= gb * 2**30 and tier.stats.files_evicted > 0
    # What is left still restores correctly, and the budget holds from the start.
    llm = build_llm(MODEL, kv_cache_dir=tmp_path, kv_cache_disk_gb=gb)
    for prompt, expected in zip(prompts, want):
        assert run(llm, prompt)[0] == expected
    assert tier_of(llm).stats.disk_bytes <= gb * 2**30
    llm.shutdown()


def test_two_engines_share_one_directory(tmp_path):
    want = hf_greedy(MODEL, [PROMPT, OTHER], NEW_TOKENS)
    a = build_llm(MODEL, kv_cache_dir=tmp_path)
    b = build_llm(MODEL, kv_cache_dir=tmp_path)  # scanned the directory before `a` wrote
    assert run(a, PROMPT)[0] == want[0]
    assert run(b, OTHER)[0] == want[1]
    assert run(b, PROMPT)[0] == want[0]  # both compute PROMPT: both write its chunks
    a.shutdown()
    b.shutdown()  # replaces a's files of the same keys, atomically
    c = build_llm(MODEL, kv_cache_dir=tmp_path)
    d = build_llm(MODEL, kv_cache_dir=tmp_path)
    for llm, prompt, expected in ((c, PROMPT, want[0]), (d, OTHER, want[1]), (c, OTHER, want[1])):
        tokens, cached = run(llm, prompt)
        assert tokens == expected and cached == restorable(prompt)
    assert tier_of(c).stats.corrupt_skipped == tier_of(d).stats.corrupt_skipped == 0
    # A file another engine deleted after this one indexed it: a miss, recomputed.
    for path in tier_of(d).dir.rglob("*" + SUFFIX):
        path.unlink()
    tokens, cached = run(d, PROMPT)
    assert tokens == want[0] and cached == 0 and tier_of(d).stats.missing_skipped == 1
    c.shutdown()
    d.shutdown()


def test_flush_with_tier_empties_both(tmp_path):
    directory = cold_run(tmp_path)
    llm = build_llm(MODEL, kv_cache_dir=tmp_path)
    assert run(llm, PROMPT)[1] == restorable(PROMPT)
    pages, files = llm.cache_manager.flush()  # memory only: the files stay
    assert pages > 0 and files == 0 and any(directory.rglob("*" + SUFFIX))
    assert run(llm, PROMPT)[1] == restorable(PROMPT)  # from disk again
    pages, files = llm.cache_manager.flush(tier=True)
    assert files == restorable(PROMPT) // 64 and not any(directory.rglob("*" + SUFFIX))
    tokens, cached = run(llm, PROMPT)
    assert cached == 0 and tokens == hf_greedy(MODEL, [PROMPT], NEW_TOKENS)[0]
    llm.shutdown()


def test_unusable_directory_or_failing_disk_runs_without_the_tier(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    llm = build_llm(MODEL, kv_cache_dir=blocker / "tier")
    assert llm.cache_manager.tier is None
    assert run(llm, PROMPT)[0] == hf_greedy(MODEL, [PROMPT], NEW_TOKENS)[0]
    llm.shutdown()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("minisgl.kvcache.disk_tier.write_chunk", disk_full)
    llm = build_llm(MODEL, kv_cache_dir=tmp_path / "tier", num_page_override=400)
    for prompt in (PROMPT, OTHER, PROMPT):
        assert run(llm, prompt)[0] == hf_greedy(MODEL, [prompt], NEW_TOKENS)[0]
    tier = tier_of(llm)
    llm.shutdown()
    assert tier.stats.write_errors > 0 and tier.stats.chunks_written == 0


def test_bad_settings_are_refused_naming_them(tmp_path):
    from minisgl.scheduler import SchedulerConfig

    path = str(model_path(MODEL))
    with pytest.raises(ValueError, match="kv_cache_disk_gb"):
        SchedulerConfig(path, kv_cache_dir=str(tmp_path), kv_cache_disk_gb=0)
    with pytest.raises(ValueError, match="kv_cache_dir.*tp_size"):
        SchedulerConfig(path, kv_cache_dir=str(tmp_path), tp_size=2)
    with pytest.raises(ValueError, match="kv_cache_dir.*radix"):
        SchedulerConfig(path, kv_cache_dir=str(tmp_path), cache_type="naive")


def test_server_restart_restores_and_reports(tmp_path):
    """Through HTTP: SIGTERM writes the cache, the restarted server restores the prompt
    (usage.prompt_tokens_details.cached_tokens), /metrics counts disk hits, and
    /flush_cache?tier=1 deletes the files."""
    from test_server import SERVER_ARGS, metrics, start_server, wait_for

    from minisgl.tokenizer import load_tokenizer

    args = [*SERVER_ARGS, "--kv-cache-dir", str(tmp_path / "tier")]
    want = load_tokenizer(model_path(MODEL)).decode(
        hf_greedy(MODEL, [PROMPT], NEW_TOKENS)[0], skip_special_tokens=True
    )
    texts, cached = [], []
    for attempt in range(2):
        server = start_server(model_path(MODEL), args, tmp_path / f"server{attempt}.log")
        try:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            name = client.models.list().data[0].id
            out = client.completions.create(
                model=name, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0
            )
            texts.append(out.choices[0].text)
            cached.append(out.usage.prompt_tokens_details.cached_tokens)
            if attempt == 1:
                url, hits = server.url, "minisgl_prefix_cache_hit_tokens_total{tier=disk}"
                wait_for(lambda: metrics(url).get(hits) == cached[1], what="stats")  # noqa: B023
                assert metrics(url)["minisgl_kv_tier_chunks_total{event=read}"] == 4
                r = httpx.post(f"{server.url}/flush_cache", params={"tier": 1}, timeout=60)
                assert r.status_code == 200 and "4 disk tier files deleted" in r.text
        finally:
            assert server.stop() == 0
    assert texts == [want, want] and cached == [0, restorable(PROMPT)]
    assert not any((tmp_path / "tier").rglob("*" + SUFFIX))
