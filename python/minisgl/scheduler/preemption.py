"""Which running requests give way: the decode retraction victim, and under the priority policy
the running requests a higher-priority arrival preempts (a mixin of Scheduler)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from minisgl.core import Req

from .budget import PageBudget
from .cache import CacheManager


class PreemptionMixin:
    """Victim choice; the state it reads and `_retract` / `_is_in_flight` are Scheduler's."""

    config: Any
    waiting: deque[Req]
    running: list[Req]
    budget: PageBudget
    cache_manager: CacheManager
    page_size: int

    # Scheduler's methods (annotations only: a stub here would shadow ResultsMixin's).
    _admitted: Callable[[], list[Req]]
    _retract: Callable[[Req], None]
    _is_in_flight: Callable[[Req], bool]

    def _dequeue(self, req: Req) -> None:
        """Take an admitted request off the queue: its head, unless requests it preempted went
        back in front of it."""
        if self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)

    def _may_preempt(self) -> bool:
        """Whether a waiting request outranks a running one (priority policy only)."""
        if self.config.schedule_policy != "priority" or not self.waiting or not self.running:
            return False
        top = max(r.sampling_params.priority for r in self.waiting)
        return top > min(r.sampling_params.priority for r in self.running)

    def _preempt_for(self, req: Req, need: int) -> bool:
        """Under the priority policy, retract running requests of lower priority than `req`
        (lowest first, as `_retraction_victim`) until `need` pages (its own and this step's
        other admissions') fit beside what the running reserve; whether they do (SGLang's
        priority preemption)."""
        if self.config.schedule_policy != "priority":
            return False
        priority = req.sampling_params.priority

        def fits() -> bool:
            reserved = self.budget.reserved(self._admitted())
            return need <= self.cache_manager.available_size // self.page_size - reserved

        while not fits():
            victims = [
                r
                for r in self.running
                if r.sampling_params.priority < priority and not self._is_in_flight(r)
            ]
            if not victims:
                return False
            self._retract(min(reversed(victims), key=lambda r: r.sampling_params.priority))
        return True

    def _retraction_victim(self) -> Req:
        """The running request to retract: the lowest priority, and among those the most
        recently admitted (it has computed least)."""
        return min(reversed(self.running), key=lambda r: r.sampling_params.priority)
