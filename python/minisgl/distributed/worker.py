"""The tensor-parallel ranks 1..N-1 as processes of rank 0: started, connected, watched, and
stopped by `TPWorkers`; each runs `worker_main`, replaying rank 0's steps on its shard. Across
machines (`nnodes`), node 0 starts its own share of the ranks and every other node runs its
share with `serve_node`, all meeting at `dist_init_addr`."""

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
from minisgl.utils.mp import start_fork_server, start_method, stop_processes, worker_setup

logger = init_logger(__name__)


class TPWorkerError(RuntimeError):
    """A tensor-parallel rank died or failed: the engine cannot run another step."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_ranks(config: EngineConfig) -> range:
    """The ranks this node runs: an equal, consecutive share of tp_size."""
    per_node = config.tp_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def init_method_for(config: EngineConfig) -> str:
    """Where the ranks meet: dist_init_addr, or a free port of this machine."""
    if config.dist_init_addr is not None:
        return f"tcp://{config.dist_init_addr}"
    return f"tcp://127.0.0.1:{_free_port()}"


def prepare_workers() -> None:
    """Start the fork server the other ranks' processes fork from, importing this module (the
    engine, the models, torch) while this process goes on loading rank 0: otherwise each rank
    imports them after rank 0 has loaded."""
    start_fork_server([__name__])


def _spawn(
    config: EngineConfig, rank: int, init_method: str, timeout_s: float, num_pages: int
) -> tuple[BaseProcess, Event]:
    """One rank's process (daemon: its launcher's exit takes it along) and its ready event."""
    ctx = mp.get_context(start_method())
    rank_config = dataclasses.replace(config, tp_rank=rank, num_page_override=num_pages)
    ready = ctx.Event()
    process = ctx.Process(
        target=worker_main,
        name=f"minisgl-tp{rank}",
        args=(EngineConfig(**_engine_fields(rank_config)), init_method, timeout_s, ready),
        daemon=True,
    )
    process.start()
    return process, ready


def serve_node(config: EngineConfig) -> int:
    """A node other than 0: run its ranks until rank 0 stops them (or they fail); the exit
    code is non-zero if any rank failed."""
    assert config.num_page_override is not None and config.node_rank > 0
    prepare_workers()
    init_method, timeout_s = init_method_for(config), ENV.TP_TIMEOUT.value
    spawned = [
        _spawn(config, rank, init_method, timeout_s, config.num_page_override)
        for rank in local_ranks(config)
    ]
    logger.info(
        "node %d: ranks %s of %d, meeting at %s",
        config.node_rank,
        list(local_ranks(config)),
        config.tp_size,
        init_method,
    )
    processes = [process for process, _ in spawned]
    try:
        for process in processes:
            process.join()
    finally:
        stop_processes(processes, timeout_s=1.0)
    return max((abs(p.exitcode or 0) for p in processes), default=0)


def worker_main(config: EngineConfig, init_method: str, timeout_s: float, ready: Event) -> None:
    """Rank `config.tp_rank`: load the shard, join the group, replay steps until told to stop
    (or until rank 0, its parent, is gone: `worker_setup` watches it)."""
    worker_setup()
    engine = Engine(config)
    ready.set()
    engine.tp.connect(init_method, timeout_s)
    engine.smooth_int8()  # with rank 0's, collective by collective
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
        init_method = init_method_for(config)
        processes: list[BaseProcess] = []
        events: list[Event] = []
        for rank in local_ranks(config)[1:]:  # this process is rank 0
            process, ready = _spawn(config, rank, init_method, timeout_s, engine.num_pages)
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
        engine.smooth_int8()  # with every worker's, collective by collective
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

    def shutdown(self, engine: Engine) -> None:
        """Tell the ranks to stop (where they can still hear it), stop them, leave the group."""
        try:
            if all(p.is_alive() for p in self.processes):
                engine.tp.send_stop()
        except Exception as e:  # a rank already gone: it is stopped below regardless
            logger.warning("tensor-parallel stop message failed: %s", e)
        self.stop()
        engine.tp.close()


def _engine_fields(config: EngineConfig) -> dict:
    """The EngineConfig part of a (scheduler) config: what a worker's engine takes."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(EngineConfig)}
