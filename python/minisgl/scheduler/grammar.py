"""Structured output through xgrammar: a request's constraint is compiled (cached by xgrammar)
on a small pool of background threads, so no step waits on it, while the request waits here;
once compiled it joins the queue with a matcher, and each step's token bitmask is filled from
the matchers of the batch's constrained requests.

A compile runs in C++ and cannot be stopped from Python. One that runs past the time limit
(`--grammar-compile-timeout`) fails its request alone; its thread is left to finish and a fresh
one takes its place, so later compiles never queue behind it. At most `MAX_STUCK_COMPILES` such
threads are left running: while that many are, new constrained requests are refused (the server
is busy) rather than queued behind them."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch

from minisgl.core import GrammarState, Req, RequestError, StructuredOutput
from minisgl.utils import init_logger
from minisgl.utils.faults import stall as stall_fault

logger = init_logger(__name__)

ANY_OBJECT = '{"type": "object"}'
# Compiles that run at once: one slow constraint never holds the others.
COMPILE_WORKERS = 2
# Compiles past the time limit left running (each a thread until xgrammar returns).
MAX_STUCK_COMPILES = 4
# The error codes of the two failures (server/frontend.py `api_error`: a 400 and a 503).
TIMEOUT_CODE = "grammar_compile_timeout"
BUSY_CODE = "server_busy"


# xgrammar (0.2.9) lowers a JSON-schema string with minLength or maxLength to a bounded run of
# one character class that admits raw control characters (JSON forbids them: a raw tab or \x11
# made the output unparseable) and no escape (mlc-ai/xgrammar#800, open). Such runs take a JSON
# string's characters instead, an escape counting as one; a grammar printed otherwise (a fixed
# xgrammar) is compiled as it is.
_BOUNDED_RUN = r"_characters ::= (([^\"\\\r\n]))"
_JSON_CHARACTERS = (
    r'_characters ::= (([^\0-\x1f\"\\]) | ("\\" ([\"\\/bfnrt] | ("u" [A-Fa-f0-9]{4, 4}))))'
)


def json_schema_grammar(schema: str) -> Any:
    """xgrammar's Grammar of a JSON schema (compact JSON), its length-bounded strings JSON's."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    text = str(grammar)
    if _BOUNDED_RUN not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_RUN, _JSON_CHARACTERS))


def compile_structured(compiler: Any, spec: StructuredOutput) -> Any:
    """The xgrammar CompiledGrammar of a constraint; raises (ValueError, RuntimeError) for a
    spec it cannot take."""
    stall_fault("compile_stall", [spec.spec or ""])  # test hook (utils/faults.py)
    if spec.kind == "json":
        # Compact JSON: a model sampled at a high temperature cannot stall in whitespace. No
        # schema: any JSON object (OpenAI's json_object).
        return compiler.compile_grammar(json_schema_grammar(spec.spec or ANY_OBJECT))
    if spec.kind == "regex":
        return compiler.compile_regex(spec.spec)
    if spec.kind == "choice":
        choices = json.loads(spec.spec)
        # JSON string literals are EBNF string literals (the same escapes).
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))
    return compiler.compile_grammar(spec.spec)


class CompileTimeout(Exception):
    """A compile ran past the time limit (its thread is left to finish)."""


class CompileBusy(Exception):
    """Every compile thread allowed is held by a compile past the time limit."""


class _Job:
    __slots__ = ("spec", "future", "started")

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.future: Future[Any] = Future()
        self.started = 0.0  # time.monotonic() when a worker took it


class _Worker:
    __slots__ = ("thread", "job", "stuck")

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.job: _Job | None = None
        self.stuck = False  # its job ran past the limit: it exits once the compile returns


class CompilePool:
    """Runs `compile(spec)` on `workers` threads; a compile running over `timeout_s` (None: no
    limit) fails its future with CompileTimeout and its thread is replaced. At most
    `workers + max_stuck` threads exist; `submit` raises CompileBusy while `max_stuck` compiles
    are past the limit, and queued jobs fail with it when no thread is left to run them.

    Limits are enforced by `expire`, which `submit` calls and the owner calls while it waits
    (the scheduler: every step while a constraint is compiling)."""

    def __init__(
        self,
        compile: Callable[[Any], Any],
        timeout_s: float | None,
        workers: int = COMPILE_WORKERS,
        max_stuck: int = MAX_STUCK_COMPILES,
    ) -> None:
        self._compile = compile
        self.timeout_s = timeout_s if timeout_s is not None and timeout_s > 0 else None
        self.workers = workers
        self.max_stuck = max_stuck
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._live: list[_Worker] = []  # threads alive (healthy or stuck)
        self._closed = False
        with self._cond:
            self._top_up()

    @property
    def stuck(self) -> int:
        """Compiles past the time limit that are still running."""
        with self._cond:
            return sum(w.stuck for w in self._live)

    @property
    def threads(self) -> int:
        with self._cond:
            return len(self._live)

    def submit(self, spec: Any) -> Future[Any]:
        """Queue a compile; raises CompileBusy while `max_stuck` compiles are past the limit."""
        self.expire()
        with self._cond:
            stuck = sum(w.stuck for w in self._live)
            if stuck >= self.max_stuck:
                raise CompileBusy(stuck)
            job = _Job(spec)
            self._queue.append(job)
            self._cond.notify()
        return job.future

    def cancel(self, future: Future[Any]) -> None:
        """Drop a queued job (one that already runs finishes, unread)."""
        with self._cond:
            if future.cancel():
                self._queue = deque(j for j in self._queue if j.future is not future)

    def expire(self) -> None:
        """Fail the compiles running past the limit and replace their threads; with no thread
        left to run them, fail the queued jobs (CompileBusy)."""
        if self.timeout_s is None:
            return
        now = time.monotonic()
        with self._cond:
            for w in self._live:
                job = w.job
                if job is None or w.stuck or now - job.started <= self.timeout_s:
                    continue
                w.stuck = True
                if not job.future.done():
                    job.future.set_exception(CompileTimeout(self.timeout_s))
                logger.warning(
                    "a structured output constraint is still compiling after %g s: its request "
                    "failed and its thread is left to finish (%d such)",
                    self.timeout_s,
                    sum(x.stuck for x in self._live),
                )
            self._top_up()
            if self._queue and all(w.stuck for w in self._live):
                stuck = len(self._live)
                for job in self._queue:
                    if not job.future.done():
                        job.future.set_exception(CompileBusy(stuck))
                self._queue.clear()

    def close(self) -> None:
        """Stop the threads once idle; queued jobs are cancelled (a running compile cannot be
        stopped: its daemon thread ends with it, or with the process)."""
        with self._cond:
            self._closed = True
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()
            self._cond.notify_all()

    # ------------------------------------------------------------ the threads
    # (`_top_up` runs with the lock held)
    def _top_up(self) -> None:
        healthy = sum(not w.stuck for w in self._live)
        while (
            not self._closed
            and healthy < self.workers
            and len(self._live) < self.workers + self.max_stuck
        ):
            worker = _Worker()
            # Daemon: a compile that never returns must not keep the process from exiting.
            worker.thread = threading.Thread(
                target=self._run, args=(worker,), name="minisgl-grammar", daemon=True
            )
            self._live.append(worker)
            worker.thread.start()
            healthy += 1

    def _run(self, worker: _Worker) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    self._live.remove(worker)
                    return
                job = self._queue.popleft()
                if not job.future.set_running_or_notify_cancel():
                    continue  # cancelled while queued
                job.started = time.monotonic()
                worker.job = job
            try:
                result, error = self._compile(job.spec), None
            except BaseException as exc:  # the spec's fault, reported to its request
                result, error = None, exc
            with self._cond:
                worker.job = None
                if not job.future.done():  # else it timed out: nobody reads it
                    if error is None:
                        job.future.set_result(result)
                    else:
                        job.future.set_exception(error)
                if worker.stuck or self._closed:
                    self._live.remove(worker)
                    self._top_up()
                    return


def _limit_text(timeout_s: float | None) -> str:
    return "no time limit" if timeout_s is None else f"--grammar-compile-timeout={timeout_s:g}s"


class GrammarQueue:
    """Requests whose constraint is being compiled, and the matchers of compiled ones.
    compile_timeout_s: how long one compile may run (None or <= 0: no limit)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, compile_timeout_s: float | None = None
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size
        self._pool = CompilePool(
            lambda spec: compile_structured(self.compiler, spec), compile_timeout_s
        )
        self.pending: dict[int, tuple[Req, Future[Any]]] = {}

    def add(self, req: Req) -> None:
        """Start compiling the request's constraint; it waits here until `ready` hands it on.
        Raises RequestError (code BUSY_CODE) while too many compiles are past the limit."""
        assert req.sampling_params.structured is not None
        try:
            future = self._pool.submit(req.sampling_params.structured)
        except CompileBusy as exc:
            raise RequestError(self._busy_text(exc), "structured", BUSY_CODE) from None
        self.pending[req.uid] = (req, future)

    def remove(self, uid: int) -> Req | None:
        """Take a request out (aborted while compiling); None if it is not here."""
        entry = self.pending.pop(uid, None)
        if entry is None:
            return None
        self._pool.cancel(entry[1])
        return entry[0]

    def ready(self, wait_s: float = 0.0) -> tuple[list[Req], list[tuple[Req, str, str]]]:
        """(compiled requests, each with its matcher; requests whose constraint failed to
        compile, with why and the error code), waiting up to wait_s for one when none is done
        yet."""
        self._pool.expire()
        if wait_s > 0 and self.pending and not any(f.done() for _, f in self.pending.values()):
            wait([f for _, f in self.pending.values()], wait_s, return_when=FIRST_COMPLETED)
            self._pool.expire()
        compiled: list[Req] = []
        failed: list[tuple[Req, str, str]] = []
        for uid, (req, future) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[uid]
            try:
                req.grammar = self._xgr.GrammarMatcher(future.result())
            except CompileTimeout:
                why = f"compiling the structured output constraint took longer than {self._limit}"
                failed.append((req, why, TIMEOUT_CODE))
                continue
            except CompileBusy as exc:
                failed.append((req, self._busy_text(exc), BUSY_CODE))
                continue
            except Exception as exc:  # the spec's fault: the request alone ends
                why = f"invalid structured output constraint: {exc}"
                failed.append((req, why, "invalid_value"))
                continue
            compiled.append(req)
        return compiled, failed

    @property
    def _limit(self) -> str:
        return _limit_text(self._pool.timeout_s)

    def _busy_text(self, exc: CompileBusy) -> str:
        return (
            f"the server is busy: {exc.args[0]} structured output constraints are still "
            f"compiling past {self._limit}; constrained requests are refused until they finish "
            "(try again later)"
        )

    def bitmask(
        self, reqs: list[Req], prefixes: list[list[int]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of reqs with a grammar, int32 bitmask [rows, ceil(vocab / 32)] of the tokens
        each may take next), or None when no request of the batch is constrained. prefixes[i]:
        tokens row i follows beyond its request's (a verify step's drafts before its position,
        which `allowed_prefix` checked), its mask the grammar's after them."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        bitmask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, i in enumerate(rows):
            grammar = reqs[i].grammar
            assert grammar is not None
            # (A prefix the grammar refuses part of cannot happen; were it to, the rows past the
            # refusal could not be reached: their draft differs from any token the mask allows.
            # Nor can a row after its stop token, where the request ends: its mask stays full.)
            taken = _advance(grammar, prefixes[i] if prefixes is not None else [])
            if not grammar.is_terminated():
                grammar.fill_next_token_bitmask(bitmask, j)
            if taken:
                grammar.rollback(taken)
        return torch.tensor(rows, dtype=torch.int64), bitmask

    def allows_nothing(self, req: Req) -> bool:
        """Whether `req`'s grammar, where it stands, takes no token (nor ends): a constraint
        that text can enter but not finish, which masks every logit of its next step."""
        grammar = req.grammar
        if grammar is None or grammar.is_terminated():
            return False
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        grammar.fill_next_token_bitmask(bitmask, 0)
        return not bool(bitmask.any())

    def close(self) -> None:
        self._pool.close()


def _advance(grammar: GrammarState, tokens: list[int]) -> int:
    """Accept `tokens` in order up to the first the grammar refuses (or its end); how many."""
    taken = 0
    for token in tokens:
        if grammar.is_terminated() or not grammar.accept_token(token):
            break
        taken += 1
    return taken


def allowed_prefix(grammar: GrammarState, draft: list[int]) -> int:
    """How many of `draft`'s tokens, in order, the grammar takes (it is left as it was): a
    constrained request verifies only drafts its output could hold."""
    taken = _advance(grammar, draft)
    if taken:
        grammar.rollback(taken)
    return taken
