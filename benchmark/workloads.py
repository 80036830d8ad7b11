"""The workloads, on random token ids that are the same for every engine: offline shapes (W1,
W2, custom, decode batches) and the prefix-sharing workloads (P1, P2, P3, agent)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from phases import Phases, Request, single_phase


class TokenSource:
    """Random token ids that are never special or added tokens, from seeded streams."""

    def __init__(self, model_path: Path, seed: int) -> None:
        from transformers import AutoConfig, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        vocab = min(len(tokenizer), AutoConfig.from_pretrained(str(model_path)).vocab_size)
        excluded = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
        self.allowed = np.array([i for i in range(vocab) if i not in excluded], dtype=np.int64)
        self.seed = seed

    def rng(self, *stream: int | str) -> np.random.Generator:
        """An independent generator per (seed, stream...): same ids for every engine."""
        key = [self.seed] + [
            int(hashlib.sha256(s.encode()).hexdigest()[:8], 16) if isinstance(s, str) else s
            for s in stream
        ]
        return np.random.default_rng(key)

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        """`n` allowed ids drawn from `rng`."""
        return self.allowed[rng.integers(0, len(self.allowed), n)].tolist()


# ---------------------------------------------------------------------------- offline shapes
@dataclass(frozen=True)
class Shape:
    """A workload's shape: request count and (min, max) input/output lengths, uniform."""

    name: str
    num_prompts: int
    input_range: tuple[int, int]
    output_range: tuple[int, int]

    def describe(self) -> str:
        """E.g. `W1 (64x128->64)`: the name tables and results use."""

        def span(r: tuple[int, int]) -> str:
            return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"

        return (
            f"{self.name} ({self.num_prompts}x{span(self.input_range)}->{span(self.output_range)})"
        )

    def phases(self, tokens: TokenSource, *stream: int | str) -> Phases:
        """One phase of random prompts; the stream (e.g. repeat index) picks fresh ids."""
        rng = tokens.rng(self.name, *stream)
        in_lens = rng.integers(self.input_range[0], self.input_range[1] + 1, self.num_prompts)
        out_lens = rng.integers(self.output_range[0], self.output_range[1] + 1, self.num_prompts)
        prompts = [tokens.draw(rng, int(n)) for n in in_lens]
        return single_phase(prompts, [int(n) for n in out_lens])

    def warmup(self, tokens: TokenSource, full: bool) -> Phases:
        """Same prompt shapes (fresh ids); unless `full`, at most 4 new tokens each."""
        phases = self.phases(tokens, "warmup")
        if not full:
            for r in phases[0]:
                r.max_tokens = min(r.max_tokens, 4)
        return phases


OFFLINE_PRESETS = {
    "W1": Shape("W1", 64, (128, 128), (64, 64)),
    "W2": Shape("W2", 16, (512, 512), (32, 32)),
}
QUICK_OFFLINE = Shape("quick", 8, (32, 32), (8, 8))
DECODE_INPUT_LEN = 16
DECODE_OUTPUT_LEN = 128


def decode_shapes(batch_sizes: list[int], quick: bool) -> list[Shape]:
    """Decode mode: a batch of short prompts per size, each generating many tokens."""
    out_len = 16 if quick else DECODE_OUTPUT_LEN
    return [
        Shape(f"batch {b}", b, (DECODE_INPUT_LEN, DECODE_INPUT_LEN), (out_len, out_len))
        for b in batch_sizes
    ]


# ---------------------------------------------------------------------------- prefix sharing
def lockstep(
    first: list[Request],
    steps: int,
    follow_up: int,
    output: int,
    tokens: TokenSource,
    rng: np.random.Generator,
) -> Phases:
    """`first`, then steps - 1 phases in which every request continues its own previous one
    with `follow_up` fresh ids (drawn request by request, phase by phase)."""
    phases = [first]
    for _ in range(steps - 1):
        phases.append(
            [Request(tokens.draw(rng, follow_up), output, base=i) for i in range(len(first))]
        )
    return phases


@dataclass(frozen=True)
class SharedPrompt:
    """P1: `first` request alone, then the rest; every prompt = system + own question."""

    system: int = 1024
    questions: int = 64
    question: int = 32
    output: int = 32

    def phases(self, tokens: TokenSource, *stream: int | str) -> Phases:
        """The workload's phases on fresh ids for `stream`."""
        rng = tokens.rng("P1", *stream)
        system = tokens.draw(rng, self.system)
        reqs = [
            Request(system + tokens.draw(rng, self.question), self.output)
            for _ in range(self.questions)
        ]
        return [reqs[:1], reqs[1:]]


@dataclass(frozen=True)
class MultiTurn:
    """P2: conversations in lockstep; each turn continues the previous one with new ids."""

    conversations: int = 16
    turns: int = 4
    history: int = 256
    output: int = 48
    user: int = 32

    def phases(self, tokens: TokenSource, *stream: int | str) -> Phases:
        """The workload's phases on fresh ids for `stream`."""
        rng = tokens.rng("P2", *stream)
        first = [
            Request(tokens.draw(rng, self.history), self.output) for _ in range(self.conversations)
        ]
        return lockstep(first, self.turns, self.user, self.output, tokens, rng)


@dataclass(frozen=True)
class Distinct:
    """P3: distinct prompts, nothing shared, all at once."""

    prompts: int = 64
    length: int = 1056
    output: int = 32

    def phases(self, tokens: TokenSource, *stream: int | str) -> Phases:
        """The workload's phases on fresh ids for `stream`."""
        rng = tokens.rng("P3", *stream)
        return [[Request(tokens.draw(rng, self.length), self.output) for _ in range(self.prompts)]]


@dataclass(frozen=True)
class Agent:
    """Agents in lockstep: shared system prompt + task, then tool call + tool output per step."""

    agents: int = 8
    steps: int = 6
    system: int = 512
    task: int = 64
    output: int = 32
    tool: int = 128

    def phases(self, tokens: TokenSource, *stream: int | str) -> Phases:
        """The workload's phases on fresh ids for `stream`."""
        rng = tokens.rng("agent", *stream)
        system = tokens.draw(rng, self.system)
        first = [
            Request(system + tokens.draw(rng, self.task), self.output) for _ in range(self.agents)
        ]
        return lockstep(first, self.steps, self.tool, self.output, tokens, rng)


PrefixWorkload = SharedPrompt | MultiTurn | Distinct | Agent
PREFIX_WORKLOADS: dict[str, PrefixWorkload] = {
    "P1": SharedPrompt(),
    "P2": MultiTurn(),
    "P3": Distinct(),
    "agent": Agent(),
}
QUICK_PREFIX_WORKLOADS: dict[str, PrefixWorkload] = {
    "P1": SharedPrompt(system=128, questions=8, question=16, output=4),
    "P2": MultiTurn(conversations=4, turns=3, history=32, output=4, user=8),
    "P3": Distinct(prompts=8, length=144, output=4),
    "agent": Agent(agents=2, steps=3, system=64, task=16, output=4, tool=16),
}
