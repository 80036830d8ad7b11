"""Offline API: bad input raises naming the parameter and loses nothing; model resolution."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_all_pages_free, build_llm, greedy

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.utils.hf import default_gguf_path, resolve_model_path


@pytest.fixture(scope="module")
def llm():
    llm = build_llm("qwen3", max_seq_len_override=64, num_page_override=256)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
    ],
)
def test_bad_sampling_params_name_the_parameter(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_engine_keeps_serving(llm) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy(2))
    with pytest.raises(ValueError, match="context"):
        llm.generate([list(range(100, 200))], greedy(2))
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, 10**6]], greedy(2))
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [greedy(2)] * 3)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["a"], greedy(2, stop_token_ids=[5, 10**6]))
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([3.5], greedy(2))  # type: ignore[list-item]
    assert not llm.has_work
    out = llm.generate(["Hello there"], greedy(3))
    assert len(out[0]["token_ids"]) == 3
    assert_all_pages_free(llm)


def test_max_tokens_clipped_to_context(llm) -> None:
    out = llm.generate([list(range(100, 160))], greedy(50))[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 64 - 60
    assert_all_pages_free(llm)


def test_request_larger_than_pool() -> None:
    """The pool bounds the context (max_model_len) like the model and --max-seq-len do."""
    small = build_llm("qwen3", num_page_override=8, max_seq_len_override=64)
    assert small.max_model_len == 8
    with pytest.raises(ValueError, match="max_tokens"):
        small.add_request([5] * 6, greedy(40), clip_to_context=False)
    with pytest.raises(ValueError, match="context length is 8"):
        small.generate([[5] * 8], greedy(1))
    out = small.generate([[5] * 6], greedy(40))[0]
    assert len(out["token_ids"]) == 2 and out["finish_reason"] == "length"
    assert small.generate([[5] * 3], greedy(3))[0]["token_ids"]
    assert_all_pages_free(small)
    small.shutdown()


def test_stop_token_ids_and_eos(llm) -> None:
    free = llm.generate(["Hello there"], greedy(8))[0]["token_ids"]
    stop = free[3]
    out = llm.generate(["Hello there"], greedy(8, stop_token_ids=[stop]))[0]
    assert out["token_ids"] == free[: free.index(stop) + 1] and out["finish_reason"] == "stop"
    llm.eos_ids = llm.eos_ids | {stop}
    try:
        assert llm.generate(["Hello there"], greedy(8))[0]["finish_reason"] == "stop"
        ignored = llm.generate(["Hello there"], greedy(8, ignore_eos=True))[0]
        assert ignored["token_ids"] == free and ignored["finish_reason"] == "length"
    finally:
        llm.eos_ids = llm.eos_ids - {stop}


def test_abort_releases_everything(llm) -> None:
    uids = [llm.add_request(list(range(10, 30)), greedy(10)) for _ in range(3)]
    llm.step()  # prefill all three
    assert llm.abort_request(uids[0])
    llm.step()
    assert llm.abort_request(uids[2]) and not llm.abort_request(12345)
    while llm.has_work:
        llm.step()
    assert_all_pages_free(llm)


def test_bad_config_values() -> None:
    with pytest.raises(ValueError, match="cache_type"):
        build_llm("qwen3", cache_type="lru")
    with pytest.raises(ValueError, match="page_size"):
        build_llm("qwen3", page_size=0, num_page_override=64)
    with pytest.raises(ValueError, match="max_prefill_length"):
        build_llm("qwen3", max_prefill_length=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(resolve_model_path(None)), dtype="int8")


def test_missing_model_and_unreachable_hub(monkeypatch) -> None:
    with pytest.raises(FileNotFoundError):
        resolve_model_path("/nonexistent/model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="local folder"):
        resolve_model_path("someone/some-model")


@pytest.mark.skipif(os.environ.get("MINISGL_SKIP_GGUF") == "1", reason="explicitly disabled")
def test_gguf_file_as_model_path() -> None:
    llm = LLM(str(default_gguf_path()), dtype=torch.float32, num_page_override=256)
    out = llm.generate(["The capital of France is"], greedy(3))[0]
    assert out["text"].startswith(" Paris")
    llm.shutdown()


def test_stop_strings_cut_the_text(llm) -> None:
    free = llm.generate(["The capital of France is"], greedy(12))[0]
    text = free["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    out = llm.generate(["The capital of France is"], greedy(12, stop=[stop, "never-there"]))[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[: text.index(stop)]
    assert stop not in out["text"]
    assert out["token_ids"] == free["token_ids"][: len(out["token_ids"])]
    # min_tokens holds stop strings off too (vLLM, SGLang): the first that ends in the text of
    # token 10 or later ends the request.
    held = llm.generate(["The capital of France is"], greedy(12, stop=[stop], min_tokens=10))[0]
    before = len(llm.tokenizer.decode(free["token_ids"][:9]))
    at = text.find(stop, before - len(stop) + 1)
    assert 0 <= at != text.index(stop), "pick a stop string seen before token 10 and after"
    assert held["text"] == text[:at] and held["finish_reason"] == "stop"
    assert_all_pages_free(llm)
