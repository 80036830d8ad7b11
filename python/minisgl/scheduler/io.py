"""The scheduler process: a message loop around `Scheduler`.

Receives tokenized requests and aborts, steps the scheduler while it has work, and sends
each step's tokens to the detokenizer. When idle it blocks on its socket (no polling loop);
before every step it drains everything queued, so new requests join the next batch.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

from minisgl.core import RequestError
from minisgl.message import (
    AbortMsg,
    AcceptedMsg,
    ErrorMsg,
    FlushCacheMsg,
    FlushCacheReply,
    LoraAdapterMsg,
    LoraAdapterReply,
    StatsMsg,
    TokenMsg,
    UserMsg,
)
from minisgl.scheduler import Scheduler, TokenOutput
from minisgl.utils import init_logger
from minisgl.utils.faults import inject as inject_fault
from minisgl.utils.memory import release_freed_memory

logger = init_logger(__name__)


class SchedulerIO:
    """Connects a `Scheduler` to its inbox and to the detokenizer.

    `inbox` needs `get(timeout_s=None)` (block, then drain; [] once the timeout passes) and
    `drain()`; `outbox` needs `put_many(list)`. Request ids (`rid`, from the API server) are
    mapped to the scheduler's own uids here. After `idle_release_s` with nothing to do, the heap's
    freed memory goes back to the OS (the engine keeps it for the next step while busy).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        inbox: Any,
        outbox: Any,
        stats_interval_s: float = 0.5,
        idle_release_s: float = 5.0,
    ) -> None:
        self.scheduler = scheduler
        self.inbox = inbox
        self.outbox = outbox
        self.stats_interval_s = stats_interval_s
        self.idle_release_s = idle_release_s
        self._released = True  # nothing freed since the last release
        self.uid_to_rid: dict[int, int] = {}
        self.rid_to_uid: dict[int, int] = {}
        self._started: set[int] = set()  # uids that produced their first token
        self._last_stats = 0.0

    # ---------------------------------------------------------------- messages in
    def handle(self, msgs: list[Any]) -> list[Any]:
        """Apply received messages to the scheduler; return replies for the detokenizer."""
        replies: list[Any] = []
        for msg in msgs:
            if isinstance(msg, UserMsg):
                replies.append(self._add(msg))
            elif isinstance(msg, AbortMsg):
                uid = self.rid_to_uid.get(msg.rid)
                # Unknown: finished already, or rejected; nothing to stop.
                if uid is not None:
                    self.scheduler.abort_request(uid)
            elif isinstance(msg, FlushCacheMsg):
                replies.extend(self._flush(msg.rid, msg.tier))
            elif isinstance(msg, LoraAdapterMsg):
                replies.append(self._lora_adapter(msg))
            else:
                logger.warning("scheduler: ignoring unexpected %s", type(msg).__name__)
        return replies

    def _add(self, msg: UserMsg) -> AcceptedMsg | ErrorMsg:
        # Test hook for an engine failure: raised outside the request's own error handling.
        inject_fault("crash", msg.sampling_params.stop)
        try:
            # Refused, not clipped, past the context (as vLLM's OpenAI server).
            uid = self.scheduler.add_request(
                msg.input_ids,
                msg.sampling_params,
                clip_to_context=False,
                lora=msg.lora,
                pooling=msg.pooling,
                score_tokens=msg.score_tokens,
            )
        except RequestError as exc:
            return ErrorMsg(msg.rid, str(exc), exc.param, exc.code)
        except ValueError as exc:
            text = str(exc)
            param = "max_tokens" if "max_tokens" in text else None
            code = "context_length_exceeded" if "context" in text else "invalid_value"
            return ErrorMsg(msg.rid, text, param, code)
        except Exception as exc:  # a bug, but this request's: the engine keeps serving
            logger.exception("adding request %s failed", msg.rid)
            return ErrorMsg(
                msg.rid, f"the request could not be queued: {exc}", None, "request_failed"
            )
        self.uid_to_rid[uid] = msg.rid
        self.rid_to_uid[msg.rid] = uid
        sp = msg.sampling_params
        accepted = AcceptedMsg(
            msg.rid,
            len(msg.input_ids),
            list(sp.stop),
            msg.skip_special_tokens,
            msg.spaces_between_special_tokens,
            sp.include_stop_str_in_output,
            sp.min_tokens,
        )
        if msg.echo:
            accepted.prompt_ids = list(msg.input_ids)
        return accepted

    def _lora_adapter(self, msg: LoraAdapterMsg) -> LoraAdapterReply:
        """Register an adapter folder, or unload one (once its requests are done)."""
        lora = self.scheduler.engine.lora
        if lora is None:
            return LoraAdapterReply(msg.rid, False, "LoRA is not enabled (--enable-lora)")
        try:
            if msg.path is not None:
                self.scheduler.forget_unused_adapters()  # one unloaded since may take the name
                lora.register(msg.name, msg.path)
                return LoraAdapterReply(msg.rid, True, f"LoRA adapter {msg.name!r} loaded")
            lora.unregister(msg.name)
            self.scheduler.forget_unused_adapters()  # now, where none of its requests is left
        except KeyError:
            return LoraAdapterReply(msg.rid, False, f"no LoRA adapter {msg.name!r} is loaded")
        except (ValueError, OSError) as exc:
            return LoraAdapterReply(msg.rid, False, str(exc))
        return LoraAdapterReply(msg.rid, True, f"LoRA adapter {msg.name!r} unloaded")

    def _flush(self, rid: int, tier: bool = False) -> list[Any]:
        """Empty the prefix cache (and with `tier` the disk KV tier) when no request is queued
        or running (SGLang's /flush_cache); the reply, and fresh stats once it is done."""
        s = self.scheduler
        if s.has_work:
            running = len(s.running) + (s.chunked is not None)
            why = f"{running} running and {len(s.waiting)} waiting request(s)"
            return [FlushCacheReply(rid, False, f"the cache was not flushed: {why}")]
        pages, files = s.cache_manager.flush(tier=tier)
        text = f"cache flushed: {pages} pages freed"
        if tier:
            text += f", {files} disk tier files deleted"
        logger.info("prefix %s", text)
        return [FlushCacheReply(rid, True, text), self.stats()]

    # ---------------------------------------------------------------- tokens out
    def convert(self, outputs: list[TokenOutput]) -> list[TokenMsg | ErrorMsg]:
        """Scheduler outputs -> messages; a request's first token carries its cache hit, and a
        request that failed ends with an ErrorMsg (code "request_failed")."""
        live = None
        msgs: list[TokenMsg | ErrorMsg] = []
        for out in outputs:
            rid = self.uid_to_rid.get(out.uid)
            if rid is None:
                continue
            if out.finish_reason == "error":
                code = out.error_code or (
                    "request_failed" if out.error_param is None else "invalid_value"
                )
                msgs.append(ErrorMsg(rid, out.error or "the request failed", out.error_param, code))
                del self.uid_to_rid[out.uid], self.rid_to_uid[rid]
                self._started.discard(out.uid)
                continue
            cached = out.cached_tokens
            if out.uid not in self._started:
                self._started.add(out.uid)
                if out.finish_reason is None:
                    if live is None:  # built at most once per step
                        s = self.scheduler
                        live = {r.uid: r for r in (*s.running, *s.waiting)}
                    req = live.get(out.uid)
                    cached = req.prompt_cached_tokens if req is not None else 0
            msg = TokenMsg(rid, out.token, out.finish_reason, cached)
            msg.logprobs, msg.prompt_logprobs = out.logprobs, out.prompt_logprobs
            msg.embedding = out.embedding
            msg.spec_verify_ct, msg.spec_accepted_tokens = (
                out.spec_verify_ct,
                out.spec_accepted_tokens,
            )
            msgs.append(msg)
            if out.finish_reason is not None:
                del self.uid_to_rid[out.uid], self.rid_to_uid[rid]
                self._started.discard(out.uid)
        return msgs

    def stats(self) -> StatsMsg:
        s = self.scheduler
        cm = s.cache_manager
        cached_pages = cm.prefix_cache.size_info.total_size // s.page_size
        idle = not s.has_work
        pages_ok = None
        if idle:
            try:
                cm.check_integrity()
                pages_ok = cm.num_free_pages + cached_pages == s.engine.num_pages
            except AssertionError as exc:
                logger.error("page accounting broken while idle: %s", exc)
                pages_ok = False
        return StatsMsg(
            running=len(s.running),
            waiting=len(s.waiting),
            num_pages=s.engine.num_pages,
            free_pages=cm.num_free_pages,
            cached_pages=cached_pages,
            prompt_tokens=s.stats.prompt_tokens,
            cached_tokens=s.stats.cached_tokens,
            hit_rate=s.stats.hit_rate,
            idle=idle,
            pages_ok=pages_ok,
            evicted_tokens=getattr(cm.prefix_cache, "evicted_tokens", 0),
            eviction_policy=s.config.radix_eviction_policy,
            tier=None if cm.tier is None else dataclasses.asdict(cm.tier.stats),
            spec=None if s.speculator is None else dataclasses.asdict(s.speculator.stats),
        )

    # ---------------------------------------------------------------- the loop
    def run_once(self) -> None:
        """Receive (blocking only when there is nothing to run), then step once."""
        was_busy = self.scheduler.has_work
        if was_busy:
            msgs = self.inbox.drain()
        else:
            msgs = self.inbox.get(None if self._released else self.idle_release_s)
            if not msgs:  # idle that long: a burst's working set need not stay resident
                release_freed_memory()
                self._released = True
                return
        out = self.handle(msgs)
        if self.scheduler.has_work:
            self._released = False
            out.extend(self.convert(self.scheduler.step()))
        now = time.monotonic()
        # Stats: periodically while busy, and always on becoming idle (so a client that waits
        # for idleness sees final numbers), and right after waking up.
        if now - self._last_stats >= self.stats_interval_s or was_busy != self.scheduler.has_work:
            out.append(self.stats())
            self._last_stats = now
        self.outbox.put_many(out)

    def run_forever(self) -> None:
        self.outbox.put_many([self.stats()])
        while True:
            self.run_once()


def run_scheduler_process(config: Any, addrs: Any, ready: Connection) -> None:
    """Process entry: build the engine (on all cores), report its limits, serve forever."""
    from minisgl.message.queue import ZmqPullQueue, ZmqPushQueue
    from minisgl.tokenizer import extra_eos_ids, load_tokenizer
    from minisgl.utils.mp import worker_setup

    worker_setup()
    tokenizer = load_tokenizer(config.model_path)
    scheduler = Scheduler(config, extra_eos_ids(config.model_path, tokenizer), tokenizer)
    io = SchedulerIO(scheduler, ZmqPullQueue(addrs.scheduler), ZmqPushQueue(addrs.detokenizer))
    ready.send(
        {
            "max_model_len": scheduler.max_model_len,
            "max_seq_len": scheduler.engine.max_seq_len,
            "num_pages": scheduler.engine.num_pages,
            "page_size": scheduler.page_size,
            "vocab_size": scheduler.engine.model_config.vocab_size,
        }
    )
    ready.close()
    # The launcher stops this process with SIGTERM: unwind, so shutdown writes the cache's KV
    # to the disk tier (an engine failure does not: what failed may be in it).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        io.run_forever()
    except SystemExit:
        scheduler.shutdown()
    except Exception:
        logger.exception("scheduler process failed")
        raise


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    # A group-wide SIGTERM is followed by the launcher's own: it must not cut shutdown short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(0)
