"""`python -m minisgl --dp N`: N replicas of the server behind sglang-router (the Rust router
SGLang uses; its cache-aware policy sends a request to the replica whose radix cache most likely
holds its prefix). Each replica is a whole `python -m minisgl` on its own cores and port; the
router takes the front port. A replica that dies leaves the router serving through the others
(its health checks drop it); the router dying, or Ctrl-C / SIGTERM, stops everything.

sglang-router pins its own dependencies: it lives in its own venv, made by
scripts/setup_sglang_router.sh (`MINISGL_ROUTER_PYTHON` names another Python that has it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from minisgl.utils import init_logger

from .args import ServerArgs

logger = init_logger(__name__)

ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
SETUP_SCRIPT = "scripts/setup_sglang_router.sh"
# Options of this launcher, not of a replica: dropped from the replicas' command lines.
_LAUNCHER_OPTIONS = ("--dp", "--dp-size", "--router-policy", "--port", "--host")
_STARTUP_TIMEOUT_S = 600.0


def router_python() -> str:
    """A Python that can run sglang_router: MINISGL_ROUTER_PYTHON, the repo's .peers venv, or
    this one; FileNotFoundError saying how to install it otherwise."""
    candidates = [os.environ.get("MINISGL_ROUTER_PYTHON", "")]
    candidates.append(str(Path(__file__).resolve().parents[3] / ".peers/sglang-router/bin/python"))
    for candidate in filter(None, candidates):
        if Path(candidate).exists():
            return candidate
    try:
        import sglang_router  # noqa: F401

        return sys.executable
    except ImportError:
        raise FileNotFoundError(
            f"--dp needs sglang-router: run {SETUP_SCRIPT} (or set MINISGL_ROUTER_PYTHON to a "
            "Python that has the sglang-router package)"
        ) from None


def replica_argv(argv: list[str]) -> list[str]:
    """The command line without the launcher's own options (each with its value)."""
    out: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in _LAUNCHER_OPTIONS:
            skip = "=" not in token
            continue
        out.append(token)
    return out


def replica_cpus(index: int, replicas: int) -> set[int]:
    """The cores replica `index` runs on: an equal share of this process's (all of them when
    there are fewer cores than replicas)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < replicas:
        return set(cpus)
    share = len(cpus) // replicas
    return set(cpus[index * share : (index + 1) * share])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _start_replica(argv: list[str], index: int, args: ServerArgs, port: int) -> subprocess.Popen:
    cpus = replica_cpus(index, args.dp_size)
    env = dict(os.environ, MINISGL_NUM_THREADS=str(len(cpus)))
    command = [sys.executable, "-m", "minisgl", *replica_argv(argv)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    logger.info("replica %d on cores %s: port %d", index, sorted(cpus), port)
    return subprocess.Popen(
        command, env=env, preexec_fn=lambda: os.sched_setaffinity(0, cpus), start_new_session=True
    )


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def launch_data_parallel(args: ServerArgs, argv: list[str]) -> int:
    """Run args.dp_size replicas and the router until a signal or the router's exit."""
    python = router_python()
    ports = [args.port + 1 + i for i in range(args.dp_size)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    replicas: list[subprocess.Popen] = []
    router: subprocess.Popen | None = None
    try:
        replicas = [_start_replica(argv, i, args, port) for i, port in enumerate(ports)]
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not all(_healthy(url) for url in urls):
            dead = [i for i, proc in enumerate(replicas) if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"replica {dead[0]} exited" if dead else "replicas did not start in time"
                logger.error("%s; shutting down", why)
                return 1
            time.sleep(0.5)
        command = [python, "-m", "sglang_router.launch_router", "--worker-urls", *urls]
        command += ["--policy", args.router_policy, "--host", args.host, "--port", str(args.port)]
        # Ours at info is the router at warn (it logs every request at info).
        router_level = {"debug": "debug", "error": "error"}.get(args.log_level, "warn")
        command += ["--log-level", router_level]
        # A replica that refuses a connection is out at once (circuit open, health failed), so
        # the retry goes to another: with the defaults the cache-aware policy retried the dead
        # one and answered 500 until 5 failures or the next health check.
        command += ["--cb-failure-threshold", "1", "--retry-max-retries", "3"]
        command += ["--health-failure-threshold", "1", "--health-check-interval-secs", "2"]
        router = subprocess.Popen(command, start_new_session=True)
        logger.info(
            "sglang-router (%s) at http://%s:%d in front of %s",
            args.router_policy,
            args.host,
            args.port,
            ", ".join(urls),
        )
        announced: set[int] = set()
        while router.poll() is None:
            for i, proc in enumerate(replicas):
                if proc.poll() is not None and i not in announced:
                    announced.add(i)
                    logger.warning(
                        "replica %d (%s) exited with %s; the router serves through the others",
                        i,
                        urls[i],
                        proc.returncode,
                    )
            time.sleep(0.5)
        logger.error("the router exited with %s; shutting down", router.returncode)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop(([router] if router is not None else []) + replicas)
        logger.info("router and replicas stopped")
