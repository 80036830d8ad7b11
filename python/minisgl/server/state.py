"""What the HTTP endpoints know about the running server."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from minisgl.models.pooling import PoolingConfig

from .frontend import FrontendManager
from .metrics import ServerMetrics
from .response_store import ResponseStore
from .responses import now
from .validation import MAX_BATCH_PROMPTS


@dataclass
class ServerState:
    """What the endpoints need to know about the running server."""

    model_name: str
    model_path: str
    max_model_len: int  # the effective context: prompt + output tokens of one request
    frontend: FrontendManager
    metrics: ServerMetrics
    api_key: str | None = None
    created: int = dataclasses.field(default_factory=now)
    vocab_size: int | None = None  # bounds logit_bias and /detokenize token ids
    # /get_server_info: the launch arguments and the engine's limits.
    server_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    tool_parser: str = "hermes"  # how tool calls are read from the output (server/tools.py)
    reasoning_parser: str | None = None  # how thinking is told from content (server/reasoning.py)
    # The most sub-requests (prompts x n) one HTTP request may make (--max-batch-prompts).
    max_batch_prompts: int = MAX_BATCH_PROMPTS
    # LoRA adapters served by name (-> their folder), the model names requests may pick them by.
    lora_adapters: dict[str, str] = dataclasses.field(default_factory=dict)
    # How /v1/embeddings pools and normalizes (the folder's sentence-transformers config).
    pooling: PoolingConfig = dataclasses.field(default_factory=PoolingConfig)
    # Stored Responses (`store: true`) that previous_response_id continues.
    responses: ResponseStore = dataclasses.field(default_factory=ResponseStore)


# Open without the API key (SGLang's rule): liveness, metrics and the version.
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics", "/version"})
