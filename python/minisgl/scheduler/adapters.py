"""LoRA adapters as the scheduler sees them: a request takes its adapter's slot when admitted,
and an adapter being unloaded is dropped once no request uses it (a mixin of Scheduler)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from minisgl.core import Req
from minisgl.engine import Engine


class AdaptersMixin:
    """Slot taking and adapter dropping; the state it reads is Scheduler's."""

    engine: Engine
    waiting: deque[Req]
    grammars: Any
    _in_flight: Any
    _admitted: Callable[[], list[Req]]

    def forget_unused_adapters(self) -> None:
        """Drop the adapters being unloaded that no request (queued or running) uses."""
        assert self.engine.lora is not None
        queued = [r for r, _ in self.grammars.pending.values()] if self.grammars else []
        in_use = {r.lora for r in [*self.waiting, *self._admitted(), *queued]}
        if self._in_flight is not None:
            in_use |= {r.lora for r in self._in_flight.batch.reqs}
        for name in self.engine.lora.unregistering - in_use:
            self.engine.lora.forget(name)

    def _take_adapter_slot(self, req: Req) -> bool:
        assert self.engine.lora is not None and req.lora is not None
        slot = self.engine.lora.acquire(req.lora)
        req.lora_slot = -1 if slot is None else slot
        return slot is not None
