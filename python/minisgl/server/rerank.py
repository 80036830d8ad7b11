"""Reranking and scoring (`POST /v1/rerank`, `/rerank`; `/v1/score`, `/score`; vLLM's shapes) by
the Qwen3-Reranker recipe: each (query, document) pair in the reranker's prompt, scored by the
causal LM's next-token logits of "yes" against "no" at its end (softmax over the two)."""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from minisgl.core import SamplingParams
from minisgl.message import EncodeMsg, ErrorMsg, TokenizeMsg

from .frontend import api_error
from .generation import collect_outputs, start_group
from .responses import APIError, now
from .state import ServerState
from .validation import Strict, check_batch_size, parse_request

PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def pair_text(instruction: str, query: str, document: str) -> str:
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


def relevance(no_yes: list[float]) -> float:
    """softmax([no, yes])[yes] of the two logits."""
    no, yes = no_yes
    top = max(no, yes)
    return math.exp(yes - top) / (math.exp(no - top) + math.exp(yes - top))


class RerankRequest(Strict):
    """vLLM's (and Jina's, Cohere's) rerank body; `instruction`: the recipe's task line."""

    query: str
    documents: list[str] = Field(min_length=1)
    model: str | None = None
    top_n: int = Field(0, ge=0)  # 0: all
    return_documents: bool = True
    instruction: str = INSTRUCTION


class ScoreRequest(Strict):
    """vLLM's score body: text_1 against each text_2 (one or as many as text_2)."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    instruction: str = INSTRUCTION

    def pairs(self) -> list[tuple[str, str]]:
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not first or not second:
            raise APIError("text_1 and text_2 must not be empty", param="text_1")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise APIError(
                f"text_1 has {len(first)} texts for {len(second)} in text_2 (one, or as many)",
                param="text_1",
                code="invalid_value",
            )
        return list(zip(first, second))


def register_rerank_routes(app: FastAPI, state: ServerState, check_model: Any) -> None:
    """Add the rerank and score routes (`check_model`: the model or adapter a request names)."""
    frontend = state.frontend
    known: dict[str, list[int]] = {}  # the recipe's texts, encoded once

    async def encode(text: str) -> list[int]:
        if text in known:
            return known[text]
        reply = await frontend.call(EncodeMsg(frontend.new_rid(), text, add_special_tokens=False))
        if isinstance(reply, ErrorMsg):
            raise api_error(reply, {"prompt": "documents"})
        if text in (PREFIX, SUFFIX, "yes", "no"):
            known[text] = reply.tokens
        return reply.tokens

    async def scores(
        request: Request, pairs: list[tuple[str, str]], instruction: str, lora: str | None
    ) -> tuple[list[float], int] | None:
        check_batch_size(len(pairs), len(pairs), state.max_batch_prompts, "documents")
        yes, no = await encode("yes"), await encode("no")
        if len(yes) != 1 or len(no) != 1:
            raise APIError(
                "this model's tokenizer spells 'yes' or 'no' in several tokens: not a reranker",
                param="model",
                code="invalid_value",
            )
        prefix, suffix = await encode(PREFIX), await encode(SUFFIX)
        # Every pair's encoding at once: one round trip's wait, not one per document.
        encoded = await asyncio.gather(*(encode(pair_text(instruction, q, d)) for q, d in pairs))
        msgs = []
        for pair_ids in encoded:
            ids = prefix + pair_ids + suffix
            msgs.append(
                TokenizeMsg(
                    frontend.new_rid(),
                    SamplingParams(max_tokens=1),
                    input_ids=ids,
                    lora=lora,
                    pooling="score",
                    score_tokens=[no[0], yes[0]],
                )
            )
        group = await start_group(frontend, msgs, {"prompt": "documents"})
        outputs = await collect_outputs(request, group)
        if outputs is None:
            return None
        if any(out.embedding is None for out in outputs):
            raise APIError("a pair gave no score", status=500, type="server_error")
        return [relevance(out.embedding or []) for out in outputs], sum(group.prompt_tokens)

    async def rerank(request: Request) -> Response:
        """vLLM's rerank: documents scored against the query, best first (`top_n`)."""
        req = parse_request(RerankRequest, await request.body())
        lora = check_model(req.model)
        pairs = [(req.query, document) for document in req.documents]
        scored = await scores(request, pairs, req.instruction, lora)
        if scored is None:
            return Response(status_code=499)
        values, tokens = scored
        order = sorted(range(len(values)), key=lambda i: -values[i])
        if req.top_n:
            order = order[: req.top_n]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": values[i]}
            if req.return_documents:
                result["document"] = {"text": req.documents[i]}
            results.append(result)
        return JSONResponse(
            {
                "id": f"rerank-{uuid.uuid4().hex}",
                "model": req.model or state.model_name,
                "usage": {"total_tokens": tokens},
                "results": results,
            }
        )

    async def score(request: Request) -> Response:
        """vLLM's score: text_1 against each text_2."""
        req = parse_request(ScoreRequest, await request.body())
        lora = check_model(req.model)
        scored = await scores(request, req.pairs(), req.instruction, lora)
        if scored is None:
            return Response(status_code=499)
        values, tokens = scored
        data = [{"index": i, "object": "score", "score": v} for i, v in enumerate(values)]
        return JSONResponse(
            {
                "id": f"score-{uuid.uuid4().hex}",
                "object": "list",
                "created": now(),
                "model": req.model or state.model_name,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])
    for path in ("/v1/score", "/score"):
        app.add_api_route(path, score, methods=["POST"])
