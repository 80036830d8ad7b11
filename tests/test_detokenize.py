"""IncrementalDetokenizer: streamed deltas add up to the full decode; stop strings are cut."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.tokenizer import IncrementalDetokenizer, load_tokenizer
from minisgl.utils.hf import default_model_path

_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# Text with multi-byte characters that byte-level BPE splits across tokens.
_PIECES = list("ab c.\n,!") + ["é", "中", "文", "🙂", "👍🏽", "∑", "\u200d", " the", "ing"]
_TEXT = st.lists(st.sampled_from(_PIECES), min_size=1, max_size=30).map("".join)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


def stream(tok, ids: list[int], stop=(), skip_special_tokens=True) -> tuple[list[str], object]:
    detok = IncrementalDetokenizer(tok, stop, skip_special_tokens)
    chunks = [detok.add_token(t) for t in ids]
    chunks.append(detok.finish())
    return chunks, detok


@_SETTINGS
@given(text=_TEXT)
def test_stream_equals_full_decode_without_broken_characters(tok, text):
    ids = tok(text, add_special_tokens=False).input_ids
    chunks, detok = stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in c for c in chunks)
    assert detok.output_text == text


@_SETTINGS
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=30))
def test_arbitrary_token_ids_add_up_to_the_full_decode(tok, ids):
    chunks, _ = stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True)


@_SETTINGS
@given(text=_TEXT, data=st.data())
def test_stop_string_cuts_before_first_occurrence(tok, text, data):
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : start + data.draw(st.integers(1, 4))]
    ids = tok(text, add_special_tokens=False).input_ids
    chunks, detok = stream(tok, ids, stop=[stop])
    assert "".join(chunks) == text[: text.find(stop)]
    assert detok.stopped and detok.matched_stop == stop
    # Tokens after the stop string's completion are not consumed.
    assert len(detok.token_ids) <= len(ids)


def test_stop_prefix_is_held_back_then_released(tok):
    ids = tok("one two three", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, stop=["three!"])
    streamed = [detok.add_token(t) for t in ids]
    assert "".join(streamed) == "one two "  # " three" might still become "three!"
    assert detok.finish() == "three"
    assert not detok.stopped


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok("alpha beta gamma delta", add_special_tokens=False).input_ids
    chunks, detok = stream(tok, ids, stop=["delta", "beta", "gam"])
    assert "".join(chunks) == "alpha "
    assert detok.matched_stop == "beta"
    assert detok.add_token(ids[0]) == ""  # finished: later tokens are ignored


def test_special_tokens_skipped_or_kept(tok):
    ids = tok("<|im_start|>hi<|im_end|>", add_special_tokens=False).input_ids
    assert "".join(stream(tok, ids)[0]) == "hi"
    kept = "".join(stream(tok, ids, skip_special_tokens=False)[0])
    assert kept == "<|im_start|>hi<|im_end|>"


def test_empty_stop_string_is_rejected(tok):
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tok, stop=[""])


@_SETTINGS
@given(text=_TEXT, data=st.data())
def test_stop_string_kept_with_include_stop_str(tok, text, data):
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : start + data.draw(st.integers(1, 4))]
    ids = tok(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, [stop], include_stop_str=True)
    chunks = [detok.add_token(t) for t in ids] + [detok.finish()]
    assert "".join(chunks) == text[: text.find(stop) + len(stop)]
    assert detok.stopped and "".join(chunks).endswith(stop)


_ASCII_TEXT = st.lists(st.sampled_from([*"ab c.,", " the", "ing"]), min_size=1, max_size=30)


@_SETTINGS
@given(pieces=_ASCII_TEXT, data=st.data())
def test_min_tokens_holds_off_stop_strings_that_end_before_it(tok, pieces, data):
    """A stop string ends the text only where it ends in token min_tokens's text or later (vLLM,
    SGLang); one straddling that token's start counts."""
    text = "".join(pieces)
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : start + data.draw(st.integers(1, 4))]
    ids = tok(text, add_special_tokens=False).input_ids
    min_tokens = data.draw(st.integers(0, len(ids) + 1))
    before = len(tok.decode(ids[: max(min_tokens - 1, 0)]))  # (ASCII: whole characters)
    at = text.find(stop, max(before - len(stop) + 1, 0))
    detok = IncrementalDetokenizer(tok, [stop], min_tokens=min_tokens)
    chunks = [detok.add_token(t) for t in ids] + [detok.finish()]
    assert "".join(chunks) == (text if at == -1 else text[:at])
    assert detok.stopped == (at != -1)


class _RecordingTokenizer:
    """Passes decode through, recording the options it was given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.options = tokenizer, set()

    def decode(self, ids, **kw):
        self.options.add(tuple(sorted(kw.items())))
        return self.tokenizer.decode(ids, **kw)


@pytest.mark.parametrize("spaces", [True, False])
def test_decode_options_reach_the_tokenizer(tok, spaces):
    """skip_special_tokens and spaces_between_special_tokens are the tokenizer's decode
    options (transformers' Python tokenizers join added tokens with spaces; the Rust-backed
    ones, as SmolLM2's, never do, as in vLLM)."""
    recording = _RecordingTokenizer(tok)
    ids = tok("<|im_start|>hi<|im_end|>", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(recording, (), False, spaces)
    text = "".join([detok.add_token(t) for t in ids] + [detok.finish()])
    assert text == "<|im_start|>hi<|im_end|>"
    options = (("skip_special_tokens", False), ("spaces_between_special_tokens", spaces))
    assert recording.options == {options}
