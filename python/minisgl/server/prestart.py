"""The worker processes' fork server, started before the launcher imports torch and FastAPI:
the fork server's own imports (the modules every worker needs) then run beside the launcher's
on the other core, instead of after them (a tiny model's server: healthy ~1-1.7 s sooner, of
~5.5 s, on a 2-core Zen 3)."""

from __future__ import annotations

import argparse
import os

from minisgl.utils.mp import start_fork_server

# What the fork server imports before it forks a worker: the scheduler's and the tokenizer
# workers' modules, so each starts with torch and transformers loaded.
WORKER_MODULES = (
    "minisgl.scheduler.io",
    "minisgl.tokenizer.server",
    "transformers.models.auto.tokenization_auto",
)


def prestart_workers(argv: list[str]) -> None:
    """Start the fork server now where `argv` (the command line) serves a model here: not
    --help, --shell, --dp N > 1 (its replicas are servers of their own) or --node-rank > 0.
    Children inherit the fork server's environment, so --log-level goes into it first, as the
    launcher's main does for its own."""
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument("-h", "--help", action="store_true")
    probe.add_argument("--shell", "--shell-mode", action="store_true")
    probe.add_argument("--log-level", default=None)
    probe.add_argument("--dp", "--dp-size", dest="dp_size", default="1")
    probe.add_argument("--node-rank", default="0")
    try:
        known, _ = probe.parse_known_args(argv)
    except SystemExit:  # a malformed command line: the real parser reports it
        return
    if known.help or known.shell or known.dp_size != "1" or known.node_rank != "0":
        return
    if known.log_level is not None:
        os.environ["MINISGL_LOG_LEVEL"] = known.log_level.upper()
    start_fork_server(WORKER_MODULES)
