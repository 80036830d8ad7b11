"""The API behaviour options of the CLI: logprobs, tool calls, reasoning, stored Responses."""

from __future__ import annotations

import argparse

from minisgl.engine.config import LOGPROBS_MODES

from .arg_types import positive_float, positive_int
from .reasoning import REASONING_PARSERS
from .tools import TOOL_CALL_PARSERS


def add_api_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("API behaviour")
    group.add_argument(
        "--logprobs-mode",
        default="raw_logprobs",
        choices=list(LOGPROBS_MODES),
        help="what logprobs report: the model's distribution (raw_logprobs, default) or the one "
        "the sampler draws from (processed_logprobs: after grammar masks, penalties, logit_bias, "
        "min_tokens, temperature, top-k/top-p/min-p)",
    )
    group.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", *TOOL_CALL_PARSERS],
        help="how tool calls are read from the model's output: hermes (<tool_call> JSON "
        "blocks, Qwen's), llama3_json (bare JSON); auto: from the chat template",
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        choices=list(REASONING_PARSERS),
        help="a reasoning model's thinking (<think>...</think>) as the chat message's "
        "reasoning_content, apart from its content: qwen3 (where the output opens with "
        "<think>), qwen3-thinking and deepseek-r1 (their templates open it); default: none",
    )
    group.add_argument(
        "--responses-max-stored",
        type=positive_int,
        default=1024,
        metavar="N",
        help="the most stored /v1/responses results (store: true) kept for "
        "previous_response_id and GET; the oldest dropped past it (default: 1024)",
    )
    group.add_argument(
        "--responses-max-stored-mb",
        type=positive_float,
        default=256.0,
        metavar="MB",
        help="the most megabytes of stored /v1/responses results (default: 256)",
    )
    group.add_argument(
        "--responses-store-dir",
        default=None,
        metavar="DIR",
        help="keep stored /v1/responses results in DIR too, so they outlive a restart "
        "(default: in memory only)",
    )
