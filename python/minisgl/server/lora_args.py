"""The LoRA options of the CLI (vLLM's names; SGLang's --lora-paths too; engine/lora.py)."""

from __future__ import annotations

import argparse
import json


def lora_module(text: str) -> tuple[str, str]:
    """argparse type: NAME=PATH, or vLLM's JSON form {"name": ..., "path": ...}."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return str(spec["name"]), str(spec["path"])
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(
                f'expected {{"name": ..., "path": ...}}, got {text!r}'
            ) from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters")
    group.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (PEFT folders) beside the base model, requests of different "
        "adapters in one batch; on with --lora-modules",
    )
    group.add_argument(
        "--lora-modules",
        "--lora-paths",
        nargs="+",
        type=lora_module,
        default=None,
        metavar="NAME=PATH",
        help="adapters to load at start; a request picks one by `model` (OpenAI APIs) or "
        "`lora_path` (/generate); more come with POST /v1/load_lora_adapter",
    )
    group.add_argument(
        "--max-loras",
        type=int,
        default=4,
        metavar="N",
        help="adapters resident at once; a request of another waits for a slot no running "
        "request holds (least recently used first; default: 4)",
    )
    group.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        metavar="R",
        help="the largest adapter rank served; a slot's memory is sized by it (default: 16)",
    )
