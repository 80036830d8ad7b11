"""Fault injection for tests: make one request's processing fail at a named site.

`MINISGL_FAULT_INJECT="site[,site...]:marker[;site...:marker]"` makes `inject(site, texts)` raise
`InjectedFault` when one of `texts` contains that site's marker. Sites pass what identifies a
request there: the tokenizer its prompt text ("tokenize"), the scheduler ("schedule") and the
detokenizer ("detokenize", at each token) its stop strings. "crash" (the scheduler process, on
receiving the request; stop strings) raises outside any request's error handling: the engine
failure that is nobody's request. "compile_stall" does not raise: `stall(site, texts)` sleeps
`STALL_S` where its marker is in a structured-output constraint's spec, so that compile runs past
a short `--grammar-compile-timeout`. Unset (the default), `inject` and `stall` are one comparison.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

SITES = ("tokenize", "schedule", "detokenize", "crash", "compile_stall")
# How long an armed "compile_stall" holds its compile thread.
STALL_S = 5.0


class InjectedFault(RuntimeError):
    """The failure a test asked for."""


def _parse(raw: str | None) -> dict[str, str] | None:
    """Site -> marker, from the environment variable's value."""
    if not raw:
        return None
    markers: dict[str, str] = {}
    for group in raw.split(";"):
        sites, sep, marker = group.partition(":")
        names = [s.strip() for s in sites.split(",") if s.strip()]
        unknown = set(names) - set(SITES)
        if not sep or not marker or not names or unknown:
            raise ValueError(
                f"MINISGL_FAULT_INJECT={raw!r}: expected 'site[,site]:marker[;...]' with sites "
                f"from {SITES}"
            )
        markers.update(dict.fromkeys(names, marker))
    return markers


_FAULT = _parse(os.environ.get("MINISGL_FAULT_INJECT"))


def inject(site: str, texts: Iterable[str]) -> None:
    """Raise InjectedFault if this site is armed and a text carries its marker."""
    if _FAULT is None:
        return
    marker = _FAULT.get(site)
    if marker is not None and any(marker in text for text in texts):
        raise InjectedFault(f"fault injected at {site} (MINISGL_FAULT_INJECT)")


def stall(site: str, texts: Iterable[str]) -> None:
    """Sleep STALL_S if this site is armed and a text carries its marker."""
    if _FAULT is None:
        return
    marker = _FAULT.get(site)
    if marker is not None and any(marker in text for text in texts):
        time.sleep(STALL_S)
