"""Structured output through xgrammar: a request's constraint is compiled (cached by xgrammar,
in a background thread, so no step waits on it) while the request waits here; once compiled it
joins the queue with a matcher, and each step's token bitmask is filled from the matchers of
the batch's constrained requests."""

from __future__ import annotations

import json
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from minisgl.core import Req, StructuredOutput
from minisgl.utils import init_logger

logger = init_logger(__name__)

ANY_OBJECT = '{"type": "object"}'


def compile_structured(compiler: Any, spec: StructuredOutput) -> Any:
    """The xgrammar CompiledGrammar of a constraint; raises (ValueError, RuntimeError) for a
    spec it cannot take."""
    if spec.kind == "json":
        # Compact JSON: a model sampled at a high temperature cannot stall in whitespace. No
        # schema: any JSON object (OpenAI's json_object).
        return compiler.compile_json_schema(spec.spec or ANY_OBJECT, any_whitespace=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.spec)
    if spec.kind == "choice":
        choices = json.loads(spec.spec)
        # JSON string literals are EBNF string literals (the same escapes).
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))
    return compiler.compile_grammar(spec.spec)


class GrammarQueue:
    """Requests whose constraint is being compiled, and the matchers of compiled ones."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="minisgl-grammar")
        self.pending: dict[int, tuple[Req, Future[Any]]] = {}

    def add(self, req: Req) -> None:
        """Start compiling the request's constraint; it waits here until `ready` hands it on."""
        assert req.sampling_params.structured is not None
        future = self._executor.submit(
            compile_structured, self.compiler, req.sampling_params.structured
        )
        self.pending[req.uid] = (req, future)

    def remove(self, uid: int) -> Req | None:
        """Take a request out (aborted while compiling); None if it is not here."""
        entry = self.pending.pop(uid, None)
        return None if entry is None else entry[0]

    def ready(self, wait_s: float = 0.0) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(compiled requests, each with its matcher; requests whose constraint failed to
        compile, with why), waiting up to wait_s for one when none is done yet."""
        if wait_s > 0 and self.pending and not any(f.done() for _, f in self.pending.values()):
            wait([f for _, f in self.pending.values()], wait_s, return_when=FIRST_COMPLETED)
        compiled, failed = [], []
        for uid, (req, future) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[uid]
            try:
                req.grammar = self._xgr.GrammarMatcher(future.result())
            except Exception as exc:  # the spec's fault: the request alone ends
                failed.append((req, f"invalid structured output constraint: {exc}"))
                continue
            compiled.append(req)
        return compiled, failed

    def bitmask(self, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of reqs with a grammar, int32 bitmask [rows, ceil(vocab / 32)] of the tokens
        each may take next), or None when no request of the batch is constrained."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        bitmask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, i in enumerate(rows):
            grammar = reqs[i].grammar
            assert grammar is not None
            grammar.fill_next_token_bitmask(bitmask, j)
        return torch.tensor(rows, dtype=torch.int64), bitmask

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
