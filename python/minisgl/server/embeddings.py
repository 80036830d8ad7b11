"""OpenAI's embeddings endpoint (`POST /v1/embeddings`): each input's final hidden states
pooled by the scheduler (batched with everything else, its KV freed after), then cut to
`dimensions` and normalized as the model folder's sentence-transformers config says."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg
from minisgl.models.pooling import PoolingConfig, finish_embedding

from .generation import collect_outputs, start_group
from .responses import APIError
from .sampling import TokenId
from .state import ServerState
from .validation import Strict, check_batch_size, parse_request


class EmbeddingRequest(Strict):
    """OpenAI's /v1/embeddings body."""

    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    def prompts(self) -> list[dict[str, Any]]:
        """Each input as TokenizeMsg's prompt fields (ids as they are)."""
        raw = self.input
        if isinstance(raw, str):
            return [{"text": raw}]
        if not raw:
            raise APIError("input must not be empty", param="input", code="invalid_value")
        if all(isinstance(item, int) for item in raw):
            return [{"input_ids": list(raw)}]
        prompts: list[dict[str, Any]] = []
        for item in raw:
            if isinstance(item, str):
                prompts.append({"text": item})
            elif isinstance(item, list) and item:
                prompts.append({"input_ids": list(item)})
            else:
                raise APIError(
                    f"input[{len(prompts)}]: items must be strings or non-empty token lists "
                    f"(got {item!r})",
                    param="input",
                    code="invalid_value",
                )
        return prompts


def encode_vector(vector: list[float], encoding: str) -> list[float] | str:
    """float: the list; base64: the float32 little-endian bytes (OpenAI's form)."""
    if encoding == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


def register_embedding_routes(
    app: FastAPI,
    state: ServerState,
    check_model: Callable[[str | None], str | None],
    pooling: PoolingConfig,
) -> None:
    """Add /v1/embeddings (`check_model`: the model (or LoRA adapter) a request names)."""

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        """OpenAI's embeddings: each input's pooled hidden states."""
        req = parse_request(EmbeddingRequest, await request.body())
        lora = check_model(req.model)
        prompts = req.prompts()
        check_batch_size(len(prompts), len(prompts), state.max_batch_prompts, "input")
        frontend = state.frontend
        msgs = [
            TokenizeMsg(
                frontend.new_rid(),
                SamplingParams(max_tokens=1),
                **prompt,
                lora=lora,
                pooling=pooling.mode,
            )
            for prompt in prompts
        ]
        group = await start_group(frontend, msgs, {"prompt": "input"})
        outputs = await collect_outputs(request, group)
        if outputs is None:
            return Response(status_code=499)
        data = []
        for index, out in enumerate(outputs):
            if out.embedding is None:
                raise APIError(f"input {index} gave no embedding", status=500, type="server_error")
            try:
                vector = finish_embedding(out.embedding, req.dimensions, pooling.normalize)
            except ValueError as exc:
                raise APIError(str(exc), param="dimensions", code="invalid_value") from None
            embedding = encode_vector(vector, req.encoding_format)
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        tokens = sum(group.prompt_tokens)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        model = req.model or state.model_name
        return JSONResponse({"object": "list", "data": data, "model": model, "usage": usage})
