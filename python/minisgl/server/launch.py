"""`python -m minisgl`: start the worker processes and the API server, stop them together.

Process tree: this process runs the API server (uvicorn); it spawns the scheduler (the
engine, on all cores), the tokenizer and the detokenizer (one thread each). A child that
dies takes the server down with a log line naming it; Ctrl-C / SIGTERM stop every child.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from minisgl.utils import init_logger

from .prestart import WORKER_MODULES, prestart_workers

if TYPE_CHECKING:
    from .args import ServerArgs

# torch, FastAPI and the arguments' modules are imported where used: `main` starts the workers'
# fork server first (prestart.py), so that its imports overlap these.
logger = init_logger(__name__)


class WorkerDied(RuntimeError):
    """A child process exited while the server needed it."""


def _describe(p: BaseProcess) -> str:
    code = p.exitcode
    how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return f"the {p.name} process (pid {p.pid}) died ({how})"


class Terminated(BaseException):
    """SIGTERM, as an exception: unwinds (and cleans up) like Ctrl-C, but code that catches
    KeyboardInterrupt to stop one action (the shell's Ctrl-C) does not swallow it."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(f"signal {signum}")


def build_scheduler_config(args: ServerArgs, model_path: str) -> Any:
    import torch

    from minisgl.llm.llm import parse_dtype
    from minisgl.scheduler import SchedulerConfig
    from minisgl.utils.hf import gguf_source

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gguf = gguf_source(args.model_path)
    return SchedulerConfig(
        model_path=model_path,
        dtype=parse_dtype(args.dtype),
        device=torch.device(device),
        gguf_path=None if gguf is None else str(gguf),
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        **args.engine_kwargs(),
    )


def server_info(args: ServerArgs, config: Any, info: dict[str, Any]) -> dict[str, Any]:
    """/get_server_info's body: the launch arguments (the API key left out) with what they
    resolved to, and the engine's limits as the scheduler reported them."""
    out: dict[str, Any] = {k: v for k, v in dataclasses.asdict(args).items() if k != "api_key"}
    out.update(
        model_path=config.model_path,
        pid=os.getpid(),  # this server's process (its workers are its children)
        quantization=config.quantization,
        gguf_path=config.gguf_path,
        dtype=str(config.dtype).removeprefix("torch."),
        device=str(config.device),
        api_key_required=args.api_key is not None,
        speculative_num_draft_tokens=config.speculative_num_draft_tokens,
        speculative_num_steps=config.speculative_num_steps,
        **info,
    )
    # SGLang's name for the KV pool's size in tokens.
    out["max_total_num_tokens"] = info.get("num_pages", 0) * info.get("page_size", 1)
    return out


def start_workers(config: Any, addrs: Any) -> tuple[list[BaseProcess], dict[str, Any]]:
    """Spawn scheduler, tokenizer and detokenizer; wait until each reports ready.

    Returns the processes and the scheduler's ready info (max_model_len, num_pages, ...).
    Raises WorkerDied if one exits first (its own log says why).
    """
    from minisgl.scheduler.io import run_scheduler_process
    from minisgl.tokenizer.server import run_detokenizer_worker, run_tokenizer_worker
    from minisgl.utils.mp import spawn

    targets = [
        ("scheduler", run_scheduler_process, (config,)),
        ("tokenizer", run_tokenizer_worker, (config.model_path,)),
        ("detokenizer", run_detokenizer_worker, (config.model_path,)),
    ]
    procs: list[BaseProcess] = []
    pending: dict[Connection, tuple[str, BaseProcess]] = {}
    info: dict[str, Any] = {}
    ctx = mp.get_context("spawn")
    try:
        for name, target, args in targets:
            reader, writer = ctx.Pipe(duplex=False)
            procs.append(spawn(target, name, (*args, addrs, writer)))
            writer.close()  # the child holds its own copy; EOF here means it died
            pending[reader] = (name, procs[-1])
        while pending:
            ready = wait(list(pending) + [p.sentinel for p in procs])
            for p in procs:
                if p.sentinel in ready and not p.is_alive():
                    raise WorkerDied(_describe(p) + " during startup")
            for reader in ready:
                if reader in pending:
                    name, proc = pending.pop(reader)
                    try:
                        msg = reader.recv()
                    except EOFError:  # it died before reporting; its exit code says how
                        proc.join(5.0)
                        raise WorkerDied(_describe(proc) + " during startup") from None
                    reader.close()
                    if name == "scheduler":
                        info = msg
                    logger.info("%s process ready (pid %s)", name, proc.pid)
    except BaseException:
        from minisgl.utils.mp import stop_processes

        stop_processes(procs)
        raise
    return procs, info


def _monitor(procs: list[BaseProcess], on_death: Any, is_stopping: Any) -> None:
    """Wait for any child to exit; unless the server is stopping anyway, report it."""
    wait([p.sentinel for p in procs])
    # A signal sent to the whole process group (`kill -- -PGID`, systemd) reaches the
    # children and this process at once: give our own handler a moment to notice it.
    time.sleep(0.5)
    if is_stopping():
        return
    dead = next((p for p in procs if not p.is_alive()), procs[0])
    on_death(f"{_describe(dead)}; shutting down the server")


# What the worker processes import (start_workers): the fork server loads them once.
def launch_server(args: ServerArgs) -> int:
    """Run the server until a signal or a dead child; returns the exit code."""
    from minisgl.utils.mp import start_fork_server

    start_fork_server(WORKER_MODULES)  # its imports overlap this process's set-up
    import uvicorn

    from minisgl.message.queue import ZmqAddresses
    from minisgl.models.pooling import pooling_config
    from minisgl.utils.hf import resolve_model_path
    from minisgl.utils.mp import set_worker_threads, stop_processes

    from .api_server import ServerState, create_app
    from .frontend import FrontendManager
    from .metrics import ServerMetrics
    from .response_store import ResponseStore
    from .tools import tool_parser_for

    path = resolve_model_path(args.model_path)
    config = build_scheduler_config(args, str(path))
    socket_dir = tempfile.mkdtemp(prefix="minisgl-")
    addrs = ZmqAddresses(socket_dir)
    procs: list[BaseProcess] = []
    stopping = threading.Event()
    failure: list[str] = []
    try:
        procs, info = start_workers(config, addrs)
        set_worker_threads(1)  # this process only serves HTTP; the cores are the engine's
        metrics = ServerMetrics()
        frontend = FrontendManager(addrs, metrics)
        state = ServerState(
            model_name=args.model_name(path),
            model_path=str(path),
            max_model_len=info["max_model_len"],
            frontend=frontend,
            metrics=metrics,
            api_key=args.api_key,
            vocab_size=info.get("vocab_size"),
            server_info=server_info(args, config, info),
            tool_parser=tool_parser_for(args.tool_call_parser, path),
            reasoning_parser=args.reasoning_parser,
            max_batch_prompts=args.max_batch_prompts,
            lora_adapters=dict(args.lora_modules or []),
            pooling=pooling_config(path),
            responses=ResponseStore(
                args.responses_max_stored,
                int(args.responses_max_stored_mb * (1 << 20)),
                args.responses_store_dir,
            ),
        )
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(state),
                host=args.host,
                port=args.port,
                log_level=args.log_level,
                access_log=args.log_level == "debug",
                # Open streams must not keep a dying server alive.
                timeout_graceful_shutdown=3,
            )
        )

        def on_death(reason: str) -> None:
            logger.error("%s", reason)
            failure.append(reason)
            frontend.fail_all_threadsafe(reason)  # waiting requests get a 503 now
            server.should_exit = True

        threading.Thread(
            target=_monitor,
            args=(procs, on_death, lambda: stopping.is_set() or server.should_exit),
            name="monitor",
            daemon=True,
        ).start()
        logger.info(
            "serving %s at http://%s:%d (OpenAI API under /v1)",
            state.model_name,
            args.host,
            args.port,
        )
        server.run()
    except WorkerDied as exc:
        logger.error("%s; shutting down", exc)
        failure.append(str(exc))
    finally:
        stopping.set()
        # A second Ctrl-C must not cut the cleanup short and leave children behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # The scheduler writes its cache's KV to the disk tier as it stops: give it time.
        stop_processes(procs, timeout_s=120.0 if config.kv_cache_dir else 5.0)
        shutil.rmtree(socket_dir, ignore_errors=True)
        logger.info("all server processes stopped")
    return 1 if failure else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m minisgl` and the `minisgl` console script."""
    prestart_workers(sys.argv[1:] if argv is None else argv)
    from .args import parse_args

    args = parse_args(argv)
    # Children inherit the environment, so they log at the same level.
    os.environ["MINISGL_LOG_LEVEL"] = args.log_level.upper()
    logging.getLogger("minisgl").setLevel(args.log_level.upper())
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        if args.shell:
            from minisgl.server.shell import run_shell

            return run_shell(args)
        if args.node_rank > 0:  # another machine's share of the --tp ranks, no server
            from minisgl.distributed.worker import serve_node
            from minisgl.utils.hf import resolve_model_path

            return serve_node(
                build_scheduler_config(args, str(resolve_model_path(args.model_path)))
            )
        if args.dp_size > 1:
            from minisgl.server.dp import launch_data_parallel

            return launch_data_parallel(args, sys.argv[1:] if argv is None else argv)
        return launch_server(args)
    except (KeyboardInterrupt, Terminated):
        return 0


if __name__ == "__main__":
    sys.exit(main())
