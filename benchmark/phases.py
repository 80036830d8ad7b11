"""Requests grouped into phases, the shape every engine runs a workload in.

A phase is submitted at once and must finish before the next starts; a request of a later phase
may continue an earlier request (its prompt is that request's prompt + generated tokens + new
ids), which is how multi-turn and agent workloads are expressed. Offline workloads are a single
phase.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Request:
    """One request of a phase: continue `base` (index in the previous phase) with `ids`."""

    ids: list[int]
    max_tokens: int
    base: int | None = None


Phases = list[list[Request]]


def phases_to_json(phases: Phases) -> list[list[dict[str, Any]]]:
    """The phases as plain lists and dicts (what the vLLM peer reads)."""
    return [[asdict(r) for r in phase] for phase in phases]


def single_phase(prompts: Sequence[list[int]], output_lens: Sequence[int]) -> Phases:
    """One phase: every prompt at once, each with its own output length."""
    return [[Request(list(p), n) for p, n in zip(prompts, output_lens)]]


def phase_prompt_lens(phases: Phases) -> list[list[int]]:
    """Prompt lengths per phase, assuming each request generates exactly its max_tokens."""
    lens: list[list[int]] = []
    for k, phase in enumerate(phases):
        row = []
        for r in phase:
            base = 0
            if r.base is not None:
                assert k > 0, "the first phase cannot continue a request"
                base = lens[k - 1][r.base] + phases[k - 1][r.base].max_tokens
            row.append(base + len(r.ids))
        lens.append(row)
    return lens


def max_seq_len(phases: Phases) -> int:
    """The longest request: its prompt plus its new tokens."""
    return max(
        n + r.max_tokens
        for ps, ls in zip(phases, phase_prompt_lens(phases))
        for r, n in zip(ps, ls)
    )


def total_kv_tokens(phases: Phases) -> int:
    """KV slots that hold every token of every request at once (an upper bound)."""
    return sum(
        n + r.max_tokens
        for ps, ls in zip(phases, phase_prompt_lens(phases))
        for r, n in zip(ps, ls)
    )


def ideal_prefill_tokens(phases: Phases) -> int:
    """Prompt tokens a perfect token-level prefix cache would still compute.

    Each prompt reuses its longest prefix already in KV from an *earlier phase* (requests of the
    same phase are admitted together and cannot reuse each other); a finished request leaves
    its prompt and all but its last generated token in KV; at least one token is computed.
    Generated tokens are stood in for by unique placeholders, so only the workload's structure
    counts, never an accidental match.
    """
    counter = iter(range(-1, -(1 << 62), -1))
    outputs = [[[next(counter) for _ in range(r.max_tokens)] for r in phase] for phase in phases]
    trie: dict[int, Any] = {}

    def insert(ids: list[int]) -> None:
        node = trie
        for t in ids:
            node = node.setdefault(t, {})

    def match(ids: list[int]) -> int:
        node, n = trie, 0
        for t in ids:
            if t not in node:
                break
            node, n = node[t], n + 1
        return n

    computed = 0
    prompts = build_prompts(phases, outputs)
    for k, phase_prompts in enumerate(prompts):
        for p in phase_prompts:
            computed += len(p) - min(match(p), len(p) - 1)
        for p, out in zip(phase_prompts, outputs[k]):
            insert(p + out[:-1])
    return computed


def next_prompts(
    phase: list[Request], prev_prompts: list[list[int]], prev_outputs: list[list[int]]
) -> list[list[int]]:
    """The prompts of a phase, given the previous phase's prompts and generated tokens."""
    return [
        ([] if r.base is None else prev_prompts[r.base] + prev_outputs[r.base]) + r.ids
        for r in phase
    ]


def build_prompts(phases: Phases, outputs: list[list[list[int]]]) -> list[list[list[int]]]:
    """The actual prompt of every request, given the tokens generated in every phase."""
    prompts: list[list[list[int]]] = []
    for k, phase in enumerate(phases):
        prompts.append(next_prompts(phase, prompts[-1] if k else [], outputs[k - 1] if k else []))
    return prompts
