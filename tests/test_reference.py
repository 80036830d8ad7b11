"""docs/reference/ cannot drift from the code: its pages are what `python -m
minisgl.server.reference` writes from the argparse parser, `minisgl.env`, the app's routes and
the request models, and every option, variable and endpoint says what it does."""

from __future__ import annotations

from pathlib import Path

from minisgl.server.reference import FIELD_ORIGINS, pages, request_models

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference"


def test_the_committed_reference_pages_are_what_the_code_writes() -> None:
    for name, text in pages().items():
        path = REFERENCE / name
        committed = path.read_text() if path.is_file() else ""
        missing = [line for line in text.splitlines() if line not in committed.splitlines()]
        stale = [line for line in committed.splitlines() if line not in text.splitlines()]
        assert not missing and not stale, (
            f"docs/reference/{name} differs from the code (run `python -m "
            f"minisgl.server.reference`); not in the page: {missing[:5]}; no longer in the code: "
            f"{stale[:5]}"
        )


def test_every_option_variable_and_endpoint_says_what_it_does() -> None:
    for name, text in pages().items():
        if name == "parameters.md":  # its last column is a range, which most fields lack
            continue
        rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
        silent = [row for row in rows[1:] if row.rstrip().endswith("|  |")]
        assert not silent, f"{name}: rows without a description: {silent[:5]}"


def test_every_field_origin_names_a_field_of_its_body() -> None:
    for title, model in request_models():
        known = set(model.model_fields) | set(getattr(model, "handled_extras", ()))
        listed = {name for names in FIELD_ORIGINS[title].values() for name in names.split()}
        assert listed <= known, f"{title}: FIELD_ORIGINS names no such field: {listed - known}"
