"""Embeddings (Req.pooling, server/embeddings.py): a decoder folder with sentence-transformers'
files embeds as sentence-transformers embeds it (float32, cosine distance within 1e-5), in
batches of mixed lengths prefilled in chunks, last-token and mean pooling; over HTTP the
official client's embeddings.create (float and base64, dimensions) gives the same vectors."""

from __future__ import annotations

import base64
import functools
import json
import shutil
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from helpers import PROMPTS, tiny_model
from sentence_transformers import SentenceTransformer

from minisgl.llm import LLM

TEXTS = [PROMPTS[0], "Hi", PROMPTS[3], "A longer sentence about the sea and its many waves."]


@functools.cache
def st_folder(pooling: str, normalize: bool) -> Path:
    """The tiny Qwen3 with sentence-transformers' modules: Transformer, Pooling, Normalize."""
    folder = tiny_model("qwen3").parent / f"st-qwen3-{pooling}-{int(normalize)}"
    if not (folder / "modules.json").is_file():
        shutil.copytree(tiny_model("qwen3"), folder, dirs_exist_ok=True)
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            },
        ]
        if normalize:
            modules.append(
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                }
            )
            (folder / "2_Normalize").mkdir(exist_ok=True)
        hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
        (folder / "1_Pooling").mkdir(exist_ok=True)
        flags = {
            f"pooling_mode_{k}": False
            for k in ("cls_token", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens")
        }
        flags["pooling_mode_lasttoken"] = pooling == "last"
        flags["pooling_mode_mean_tokens"] = pooling == "mean"
        config = {"word_embedding_dimension": hidden, **flags, "include_prompt": True}
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
        (folder / "modules.json").write_text(json.dumps(modules))
    return folder


@functools.cache
def st_vectors(pooling: str, normalize: bool) -> torch.Tensor:
    model = SentenceTransformer(str(st_folder(pooling, normalize)), device="cpu").float()
    # One at a time: no padding in the reference.
    return torch.stack([model.encode(t, convert_to_tensor=True).float() for t in TEXTS])


def assert_same_vectors(got: torch.Tensor, want: torch.Tensor) -> None:
    cosine = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=-1)
    assert bool((1 - cosine < 1e-5).all()), cosine
    assert torch.allclose(got.norm(dim=-1).double(), want.norm(dim=-1).double(), rtol=1e-4)


@pytest.mark.parametrize(("pooling", "normalize"), [("last", True), ("mean", False)])
def test_embeddings_equal_sentence_transformers(pooling: str, normalize: bool) -> None:
    torch.set_num_threads(2)
    llm = LLM(st_folder(pooling, normalize), dtype="float32", max_prefill_length=8)
    try:
        got = torch.tensor(llm.embed(TEXTS))  # one batch, mixed lengths, in chunks of 8
        assert_same_vectors(got, st_vectors(pooling, normalize))
        # Nothing stays cached: free + cached pages == all (checked by embed) and no hits.
        again = torch.tensor(llm.embed(TEXTS[:1]))
        assert torch.equal(again[0], got[0])
        cut = torch.tensor(llm.embed(TEXTS[:1], dimensions=16))
        want = got[0, :16] / got[0, :16].norm() if normalize else got[0, :16]
        assert torch.allclose(cut[0], want, atol=1e-6)
        with pytest.raises(ValueError, match="dimensions must lie in"):
            llm.embed(TEXTS[:1], dimensions=10_000)
    finally:
        llm.shutdown()


def test_the_openai_client_embeds_over_http(tiny_qwen3_server) -> None:
    """The shared tiny Qwen3 server (its folder has no sentence-transformers files: the last
    token's, normalized, as st_folder("last", True) says for the same weights)."""
    from test_server import wait_healthy

    server = wait_healthy(tiny_qwen3_server)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    want = st_vectors("last", True)
    for encoding in ("float", "base64"):
        reply = client.embeddings.create(model=model, input=TEXTS, encoding_format=encoding)
        if encoding == "base64":  # the client hands base64 back as it came
            vectors = [
                np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist()
                for d in reply.data
            ]
        else:
            vectors = [d.embedding for d in reply.data]
        assert [d.index for d in reply.data] == list(range(len(TEXTS)))
        assert_same_vectors(torch.tensor(vectors), want)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(TEXTS)
    default = client.embeddings.create(model=model, input=TEXTS[0])  # base64 underneath
    assert_same_vectors(torch.tensor([default.data[0].embedding]), want[:1])
    short = client.embeddings.create(model=model, input=[TEXTS[0]], dimensions=8)
    assert len(short.data[0].embedding) == 8
    assert abs(torch.tensor(short.data[0].embedding).norm().item() - 1) < 1e-5
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=model, input=[TEXTS[0]], dimensions=100_000)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=model, input=[])
    assert "Traceback" not in server.log_text()


def hf_rerank_scores(query: str, documents: list[str]) -> list[float]:
    """The Qwen3-Reranker recipe in HF transformers (float32): softmax of the next-token logits
    of "no" and "yes" after the reranker's prompt, the yes share."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minisgl.server.rerank import INSTRUCTION, PREFIX, SUFFIX, pair_text

    folder = tiny_model("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    scores = []
    for document in documents:
        ids = (
            tokenizer.encode(PREFIX, add_special_tokens=False)
            + tokenizer.encode(pair_text(INSTRUCTION, query, document), add_special_tokens=False)
            + tokenizer.encode(SUFFIX, add_special_tokens=False)
        )
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1]
        scores.append(torch.softmax(logits[[no, yes]].double(), 0)[1].item())
    return scores


def test_rerank_and_score_equal_the_hf_recipe(tiny_qwen3_server) -> None:
    import httpx
    from test_server import wait_healthy

    url = wait_healthy(tiny_qwen3_server).url
    query = "What is the capital of France?"
    documents = ["Paris is the capital of France.", "Bananas are yellow.", TEXTS[3], "Paris"]
    want = hf_rerank_scores(query, documents)
    reply = httpx.post(
        f"{url}/v1/rerank", json={"query": query, "documents": documents, "top_n": 3}, timeout=120
    )
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    order = sorted(range(len(want)), key=lambda i: -want[i])[:3]
    assert [r["index"] for r in results] == order
    for r in results:
        assert abs(r["relevance_score"] - want[r["index"]]) < 1e-4, (r, want)
        assert r["document"]["text"] == documents[r["index"]]
    scored = httpx.post(
        f"{url}/v1/score", json={"text_1": query, "text_2": documents}, timeout=120
    ).json()
    assert [d["index"] for d in scored["data"]] == list(range(len(documents)))
    for d in scored["data"]:
        assert abs(d["score"] - want[d["index"]]) < 1e-4
    bad = httpx.post(f"{url}/v1/rerank", json={"query": query, "documents": []}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] is not None
    mismatch = {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}
    assert httpx.post(f"{url}/v1/score", json=mismatch, timeout=30).status_code == 400
