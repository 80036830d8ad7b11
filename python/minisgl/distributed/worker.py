"""The tensor-parallel ranks 1..N-1 as processes of rank 0: started, connected, watched, and
stopped by `TPWorkers`; each runs `worker_main`, replaying rank 0's steps on its shard."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import socket
import time
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event

from minisgl.engine import Engine, EngineConfig
from minisgl.env import ENV
from minisgl.utils import init_logger
from minisgl.utils.mp import stop_processes, worker_setup

logger = init_logger(__name__)


class TPWorkerError(RuntimeError):
    """A tensor-parallel rank died or failed: the engine cannot run another step."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_main(config: EngineConfig, init_method: str, timeout_s: float, ready: Event) -> None:
    """Rank `config.tp_rank`: load the shard, join the group, replay steps until told to stop
    (or until rank 0, its parent, is gone: `worker_setup` watches it)."""
    worker_setup()
    engine = Engine(config)
    ready.set()
    engine.tp.connect(init_method, timeout_s)
    try:
        while (step := engine.tp.receive_step(engine.page_table)) is not None:
            engine.replay(step)
    finally:
        engine.tp.close()


class TPWorkers:
    """Rank 0's handle on the other ranks: `start` spawns them with rank 0's KV pool size (so
    every rank's slots match) and joins the group; `check` raises if one has died."""

    def __init__(self, processes: list[BaseProcess]) -> None:
        self.processes = processes

    @classmethod
    def start(cls, config: EngineConfig, engine: Engine) -> TPWorkers:
        timeout_s = ENV.TP_TIMEOUT.value
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        processes: list[BaseProcess] = []
        events: list[Event] = []
        for rank in range(1, config.tp_size):
            rank_config = dataclasses.replace(
                config, tp_rank=rank, num_page_override=engine.num_pages
            )
            ready = ctx.Event()
            # daemon: a rank 0 that exits without shutdown takes its workers along.
            process = ctx.Process(
                target=worker_main,
                name=f"minisgl-tp{rank}",
                args=(EngineConfig(**_engine_fields(rank_config)), init_method, timeout_s, ready),
                daemon=True,
            )
            process.start()
            processes.append(process)
            events.append(ready)
        workers = cls(processes)
        deadline = time.monotonic() + timeout_s
        # Loading can fail: wait while watching the processes rather than in the rendezvous.
        while not all(e.is_set() for e in events):
            workers.check("while loading its shard")
            if time.monotonic() > deadline:
                workers.stop()
                raise TPWorkerError(f"tensor-parallel ranks not ready within {timeout_s:.0f} s")
            time.sleep(0.02)
        try:
            engine.tp.connect(init_method, timeout_s)
        except Exception as e:
            workers.stop()
            raise TPWorkerError(f"tensor-parallel ranks could not connect: {e}") from e
        return workers

    def check(self, when: str = "", grace_s: float = 0.0) -> None:
        """Raise TPWorkerError naming the first rank whose process has exited (waiting up to
        `grace_s` for one to: a collective sees a peer's socket close before its exit)."""
        deadline = time.monotonic() + grace_s
        while grace_s and all(p.is_alive() for p in self.processes):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                stop_processes(self.processes, timeout_s=1.0)
                where = f" {when}" if when else ""
                raise TPWorkerError(
                    f"tensor-parallel rank {rank} (pid {process.pid}) exited{where} with code "
                    f"{process.exitcode}; the engine cannot continue"
                )

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop every worker still running (after rank 0's stop message, they leave)."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        stop_processes(self.processes, timeout_s=1.0)


def _engine_fields(config: EngineConfig) -> dict:
    """The EngineConfig part of a (scheduler) config: what a worker's engine takes."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(EngineConfig)}
