"""A verify step's rows: one sampled row per query position of a request with drafts, each
knowing the drafts before it, and how many drafts the sampled tokens keep."""

from __future__ import annotations

import copy

from minisgl.core import Req

from .grammar import allowed_prefix


def accepted_length(draft: list[int], sampled: list[int]) -> int:
    """How many drafts a verify step keeps: those up to the first that differs from the token
    sampled at the position before it (sampled[i] was drawn where draft[i] was guessed)."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == sampled[accepted]:
        accepted += 1
    return accepted


def verify_rows(reqs: list[Req], drafts: list[list[int]]) -> list[Req]:
    """One sampled row per query position of a verify step: a request with k drafts gets k + 1,
    row i a copy that knows i more tokens (the drafts before it), as if decoded one by one."""
    rows: list[Req] = []
    for req, draft in zip(reqs, drafts):
        if not draft:
            rows.append(req)
            continue
        for i in range(len(draft) + 1):
            row = copy.copy(req)
            row.device_len = req.cached_len + 1 + i
            rows.append(row)
    return rows


def within_grammar(reqs: list[Req], drafts: list[list[int]]) -> list[list[int]]:
    """Each constrained request's drafts cut to the run its grammar takes."""
    return [
        draft if req.grammar is None else draft[: allowed_prefix(req.grammar, draft)]
        for req, draft in zip(reqs, drafts)
    ]


def verify_prefixes(drafts: list[list[int]]) -> list[list[int]]:
    """For each row of `verify_rows(reqs, drafts)`, the drafts before its position: a
    constrained row's token mask is its grammar's after them."""
    return [draft[:i] for draft in drafts for i in range(len(draft) + 1)]
