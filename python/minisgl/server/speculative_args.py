"""The speculative decoding options of the CLI (SGLang's names; scheduler/speculative.py)."""

from __future__ import annotations

import argparse

from minisgl.layers.quantized import QUANTIZATIONS
from minisgl.scheduler.config import SPECULATIVE_ALGORITHMS


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding")
    group.add_argument(
        "--speculative-algorithm",
        default=None,
        type=str.upper,
        choices=list(SPECULATIVE_ALGORITHMS),
        help="NGRAM: draft tokens from what followed the same recent tokens in the request's "
        "own prompt and output and in recent requests; STANDALONE: from a small draft model of "
        "the same vocabulary (--speculative-draft-model-path), a draft-model step per draft "
        "token. Drafts are verified several per step (off by default; lossless: the output is "
        "what decoding without it gives)",
    )
    group.add_argument(
        "--speculative-draft-model-path",
        default=None,
        metavar="PATH",
        help="STANDALONE's draft model: an HF folder, .gguf file or hub id with the target's "
        "vocabulary, run beside the target (rank 0 only under --tp) with a KV pool of as many "
        "pages as the target's, paid from the same KV budget",
    )
    group.add_argument(
        "--speculative-draft-model-quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="STANDALONE: the draft model's weights, as --quantization takes them (default: "
        "the target's load-time method, else as the draft's checkpoint holds them); the "
        "target's own path with int4 or int8 drafts with a quantized copy of the target",
    )
    group.add_argument(
        "--speculative-num-steps",
        type=int,
        default=None,
        metavar="N",
        help="STANDALONE: the most draft-model steps (draft tokens) per request and verify step "
        "(default: --speculative-num-draft-tokens - 1)",
    )
    group.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the most positions a request verifies in one step, its last token included "
        "(default 8, or --speculative-num-steps + 1); fewer are drafted where the measured cost "
        "says they do not pay",
    )
    group.add_argument(
        "--speculative-ngram-min-match-window-size",
        type=int,
        default=1,
        metavar="N",
        help="the shortest n-gram matched to draft (default 1)",
    )
    group.add_argument(
        "--speculative-ngram-max-match-window-size",
        type=int,
        default=6,
        metavar="N",
        help="the longest n-gram matched, tried first (default 6)",
    )
    group.add_argument(
        "--speculative-ngram-branch-length",
        type=int,
        default=12,
        metavar="N",
        help="tokens the shared n-gram cache keeps after each n-gram (default 12)",
    )
    group.add_argument(
        "--speculative-ngram-capacity",
        type=int,
        default=200_000,
        metavar="N",
        help="n-grams the cache of recent requests holds, least recent dropped (default 200000)",
    )
