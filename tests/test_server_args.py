"""CLI aliases: SGLang's and mini-sglang's spellings parse to what our spelling gives."""

from __future__ import annotations

import pytest

from minisgl.server.args import ServerArgs, parse_args

# (our spelling, the alias, a value; None for a flag without a value)
ALIASES = [
    ("--model", "--model-path", "/models/some-model"),
    ("--max-seq-len", "--max-seq-len-override", "384"),
    ("--max-seq-len", "--context-length", "384"),
    ("--max-prefill-length", "--max-extend-length", "96"),
    ("--max-prefill-length", "--chunked-prefill-size", "96"),
    ("--attention-backend", "--attn", "torch"),
    ("--shell", "--shell-mode", None),
]


def _parse(flag: str, value: str | None) -> ServerArgs:
    return parse_args([flag] if value is None else [flag, value])


@pytest.mark.parametrize(("ours", "alias", "value"), ALIASES)
def test_alias_parses_like_our_spelling(ours: str, alias: str, value: str | None) -> None:
    assert _parse(alias, value) == _parse(ours, value) != parse_args([])


def test_disable_flags_are_our_off_values() -> None:
    assert parse_args(["--disable-radix-cache"]) == parse_args(["--cache-type", "naive"])
    assert parse_args(["--disable-overlap-schedule"]) == parse_args(["--overlap-schedule", "off"])
    defaults = parse_args([])
    assert (defaults.cache_type, defaults.overlap_schedule) == ("radix", None)
    assert parse_args(["--disable-overlap-schedule"]).engine_kwargs()["overlap_schedule"] is False
    assert "overlap_schedule" not in defaults.engine_kwargs()  # the device's default applies


def test_shared_spellings_keep_their_meaning() -> None:
    args = parse_args(
        ["--host", "0.0.0.0", "--port", "30000", "--api-key", "k", "--dtype", "float16"]
        + ["--page-size", "4", "--max-running-requests", "8", "--schedule-policy", "lpm"]
    )
    assert (args.host, args.port, args.api_key, args.dtype) == ("0.0.0.0", 30000, "k", "float16")
    assert (args.page_size, args.max_running_req, args.schedule_policy) == (4, 8, "lpm")


def test_prefill_budget_below_one_is_refused_naming_the_option(capsys):
    """SGLang's --chunked-prefill-size -1 (no chunking) is not ours: refused at parse time,
    naming the option, not deep in the scheduler's config."""
    for value in ("-1", "0", "abc"):
        with pytest.raises(SystemExit):
            parse_args(["--chunked-prefill-size", value])
        assert "--chunked-prefill-size" in capsys.readouterr().err


def test_radix_eviction_policy_reaches_the_engine(capsys) -> None:
    """SGLang's --radix-eviction-policy: one of the registered policies, lru by default."""
    assert parse_args([]).engine_kwargs()["radix_eviction_policy"] == "lru"
    args = parse_args(["--radix-eviction-policy", "slru", "--schedule-policy", "priority"])
    assert args.engine_kwargs()["radix_eviction_policy"] == "slru"
    assert args.engine_kwargs()["schedule_policy"] == "priority"
    with pytest.raises(SystemExit):
        parse_args(["--radix-eviction-policy", "random"])
    assert "--radix-eviction-policy" in capsys.readouterr().err


def test_request_limit_flags_parse(capsys) -> None:
    """--max-batch-prompts (sequences per request, >= 1) and --grammar-compile-timeout
    (seconds; 0 or less: no limit) with their defaults."""
    defaults = parse_args([])
    assert (defaults.max_batch_prompts, defaults.grammar_compile_timeout) == (1024, 10.0)
    args = parse_args(["--max-batch-prompts", "8", "--grammar-compile-timeout", "0"])
    assert (args.max_batch_prompts, args.grammar_compile_timeout) == (8, 0.0)
    with pytest.raises(SystemExit):
        parse_args(["--max-batch-prompts", "0"])
    assert "--max-batch-prompts" in capsys.readouterr().err


def test_help_is_grouped_and_every_option_has_its_text() -> None:
    """`--help` lists options by topic (model, server, KV cache, scheduling, parallelism,
    quantization, API behaviour, speculative decoding, LoRA): none is left in argparse's
    default group, none lacks a help text."""
    from minisgl.server.args import build_parser

    parser = build_parser()
    ungrouped, silent = [], []
    for group in parser._action_groups:
        for action in group._group_actions:
            if action.option_strings == ["-h", "--help"]:
                continue
            if group.title in ("options", "optional arguments", "positional arguments"):
                ungrouped.append(action.option_strings)
            if not action.help or not action.help.strip():
                silent.append(action.option_strings)
    assert ungrouped == [] and silent == [], (ungrouped, silent)
    titles = [group.title for group in parser._action_groups]
    for topic in ("model", "server", "KV cache", "scheduling", "parallelism", "quantization"):
        assert topic in titles
