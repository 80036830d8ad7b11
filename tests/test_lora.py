"""Multi-LoRA (engine/lora.py, layers/lora.py): greedy output under PEFT adapters equals HF
transformers + PEFT in float32 token for token, for adapters of different ranks, targets and
scalings, in batches that mix them with the base model; prefixes cached under one adapter are
never reused under another; adapters take turns in fewer slots than there are adapters."""

from __future__ import annotations

import functools
from pathlib import Path

import peft
import pytest
import torch
from helpers import PROMPTS, hf_encode, tiny_model

from minisgl.core import SamplingParams
from minisgl.llm import LLM

MAX_NEW = 12
# (name, rank, alpha, targets, rslora)
ADAPTERS = [
    ("a", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    ("b", 4, 4, ["v_proj", "gate_proj", "up_proj", "down_proj"], True),
]


@functools.cache
def adapter_dir(model: str, name: str) -> Path:
    """A random PEFT LoRA adapter of `model`, saved as PEFT saves one (B non-zero)."""
    from transformers import AutoModelForCausalLM

    _, rank, alpha, targets, rslora = next(a for a in ADAPTERS if a[0] == name)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model(model)), dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=rslora,
        init_lora_weights=False,  # random B as well: the adapter changes the output
    )
    torch.manual_seed(1 + [a[0] for a in ADAPTERS].index(name))
    model_with = peft.get_peft_model(base, config)
    with torch.no_grad():  # large enough to change greedy tokens of a random model
        for param in model_with.parameters():
            if param.requires_grad:
                param.mul_(8.0)
    folder = tiny_model(model).parent / f"lora-{model}-{name}"
    model_with.save_pretrained(str(folder))
    return folder


@functools.cache
def hf_peft_greedy(model: str, name: str | None, prompt: str) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model(model)), dtype=torch.float32)
    if name is not None:
        hf = peft.PeftModel.from_pretrained(hf, str(adapter_dir(model, name)))
    ids = hf_encode(tiny_model(model), prompt)
    with torch.inference_mode():
        out = hf.eval().generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_NEW,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("model", ["llama3", "qwen3"])
def test_mixed_batches_equal_hf_peft(model: str) -> None:
    torch.set_num_threads(2)
    modules = {name: adapter_dir(model, name) for name, *_ in ADAPTERS}
    llm = LLM(
        tiny_model(model),
        dtype="float32",
        lora_modules=modules,
        max_loras=2,
        max_lora_rank=8,
        max_prefill_length=16,  # prefills in chunks, beside decodes
    )
    try:
        prompts = PROMPTS[:3]
        names = [None, "a", "b"]
        # Every prompt under every adapter (and none), all in one batch.
        jobs = [(p, n) for p in prompts for n in names]
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate([p for p, _ in jobs], sp, lora=[n for _, n in jobs])
        for (prompt, name), out in zip(jobs, outs):
            assert out["token_ids"] == hf_peft_greedy(model, name, prompt), (prompt, name)
        # The adapters do change the output (else the test would show nothing).
        by_name = {n: [o["token_ids"] for (p, m), o in zip(jobs, outs) if m == n] for n in names}
        assert by_name["a"] != by_name[None] and by_name["b"] != by_name[None]
        # Again, now every prompt is cached under each: hits stay within an adapter.
        again = llm.generate([p for p, _ in jobs], sp, lora=[n for _, n in jobs])
        assert [o["token_ids"] for o in again] == [o["token_ids"] for o in outs]
        assert all(o["cached_tokens"] > 0 for o in again)
    finally:
        llm.shutdown()


def test_adapters_take_turns_in_one_slot_and_never_share_prefixes() -> None:
    """Two adapters and one slot: requests of the other adapter wait for the slot, and still
    each gets its own HF output; the same prompt under another adapter hits nothing."""
    torch.set_num_threads(2)
    model = "qwen3"
    modules = {name: adapter_dir(model, name) for name, *_ in ADAPTERS}
    llm = LLM(
        tiny_model(model), dtype="float32", lora_modules=modules, max_loras=1, max_lora_rank=8
    )
    try:
        prompt = PROMPTS[0]
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        first = llm.generate([prompt], sp, lora="a")[0]
        other = llm.generate([prompt], sp, lora="b")[0]
        assert other["cached_tokens"] == 0  # "a"'s KV of the same tokens is not "b"'s
        assert first["token_ids"] == hf_peft_greedy(model, "a", prompt)
        assert other["token_ids"] == hf_peft_greedy(model, "b", prompt)
        base = llm.generate([prompt], sp)[0]
        assert base["cached_tokens"] == 0
        mixed = llm.generate([prompt] * 4, sp, lora=["a", "b", "a", "b"])
        for out, name in zip(mixed, ["a", "b", "a", "b"]):
            assert out["token_ids"] == hf_peft_greedy(model, name, prompt)
        with pytest.raises(ValueError, match="no LoRA adapter 'c'"):
            llm.generate([prompt], sp, lora="c")
    finally:
        llm.shutdown()


def test_bad_adapters_are_refused_by_name(tmp_path) -> None:
    from minisgl.models.lora_adapter import read_adapter

    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_adapter("x", str(tmp_path), 16)
    folder = adapter_dir("qwen3", "a")
    with pytest.raises(ValueError, match="rank 8 exceeds --max-lora-rank 4"):
        read_adapter("x", str(folder), 4)


def test_served_adapters_by_model_name_loaded_and_unloaded_while_streaming(
    tiny_qwen3_server,
) -> None:
    """Over HTTP (the shared tiny Qwen3 server, LoRA on, one slot): adapters loaded at run time
    are listed and picked by `model` (their output HF + PEFT's); unloading one while a request
    streams lets that request finish, then its name is free again."""
    import httpx
    import openai
    from test_server import wait_healthy

    model = "qwen3"
    folders = {name: adapter_dir(model, name) for name, *_ in ADAPTERS}
    server = wait_healthy(tiny_qwen3_server)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

    def load(name: str) -> httpx.Response:
        body = {"lora_name": name, "lora_path": str(folders[name])}
        return httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=60)

    def unload(name: str) -> httpx.Response:
        body = {"lora_name": name}
        return httpx.post(f"{server.url}/v1/unload_lora_adapter", json=body, timeout=60)

    assert load("a").status_code == 200
    try:
        cards = {m.id: m for m in client.models.list().data}
        base = client.models.list().data[0].id
        assert cards["a"].model_extra["parent"] == base
        tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(tiny_model(model))
        prompt = PROMPTS[1]

        def complete(name: str) -> str:
            return (
                client.completions.create(
                    model=name,
                    prompt=prompt,
                    max_tokens=MAX_NEW,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
                .choices[0]
                .text
            )

        for name in ("a", base):
            expected = hf_peft_greedy(model, None if name == base else name, prompt)
            assert complete(name) == tokenizer.decode(expected, skip_special_tokens=True)
        assert load("b").status_code == 200
        with client.completions.create(
            model="b",
            prompt=prompt,
            max_tokens=120,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        ) as stream:
            pieces = [next(iter(stream)).choices[0].text]
            gone = unload("b")
            assert gone.status_code == 200, gone.text
            pieces += [chunk.choices[0].text for chunk in stream if chunk.choices]
        expected_b = tokenizer.decode(hf_peft_greedy(model, "b", prompt), skip_special_tokens=True)
        assert "".join(pieces).startswith(expected_b)  # the first MAX_NEW tokens, then more
        with pytest.raises(openai.NotFoundError):
            complete("b")
        again = load("b")
        assert again.status_code == 200, again.text
        assert complete("b") == expected_b
        assert complete("a") == tokenizer.decode(
            hf_peft_greedy(model, "a", prompt), skip_special_tokens=True
        )  # "a" back in the one slot after "b"
        bad = httpx.post(f"{server.url}/generate", json={"text": "hi", "lora_path": "zzz"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        wrong = httpx.post(
            f"{server.url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "/nope"}
        )
        assert wrong.status_code == 400 and "adapter_config.json" in wrong.text
        assert "Traceback" not in server.log_text()
    finally:
        for name in ("a", "b"):
            unload(name)


def test_bf16_deltas_are_the_same_bits_in_the_fused_layer_and_module_by_module(
    monkeypatch,
) -> None:
    """bf16 and quantized (int4: the fused C decode layer takes such a model on every x86 class):
    decode steps with adapters run in the C layer, which adds the deltas as the module path's
    kernel does, so the tokens equal those of the module path; deltas match the float32
    reference's within bf16's rounding."""
    from minisgl.models.decoder import DecoderModel
    from minisgl.models.fused_decode import FusedDecode

    torch.set_num_threads(2)
    model = "qwen3"
    modules = {name: adapter_dir(model, name) for name, *_ in ADAPTERS}
    llm = LLM(
        tiny_model(model),
        dtype="bfloat16",
        quantization="int4",
        lora_modules=modules,
        max_loras=2,
        max_lora_rank=8,
    )
    try:
        fused_with_adapters = []
        run = FusedDecode.run

        def recording(self, decoder, x, positions, batch):
            out = run(self, decoder, x, positions, batch)
            fused_with_adapters.append(out is not None and batch.lora_slots is not None)
            return out

        monkeypatch.setattr(FusedDecode, "run", recording)
        jobs = [(p, n) for p in PROMPTS[:2] for n in (None, "a", "b")]
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        fused = llm.generate([p for p, _ in jobs], sp, lora=[n for _, n in jobs])
        assert any(fused_with_adapters), "the C decode layer never ran a batch with adapters"
        llm.cache_manager.flush()
        monkeypatch.setattr(DecoderModel, "_fused_decode", lambda self, x: None)
        modular = llm.generate([p for p, _ in jobs], sp, lora=[n for _, n in jobs])
        assert [o["token_ids"] for o in fused] == [o["token_ids"] for o in modular]
        # The C deltas against the float32 reference's (the same slots, torch's matmuls).
        slots = next(iter(llm.engine.lora.projections.values()))
        x = torch.randn(5, slots.lora_a.shape[1]).bfloat16()
        row_slots = torch.tensor([0, -1, 1, 0, 1])
        mask = llm.engine.lora.mask(row_slots)
        base = torch.randn(5, slots.lora_bt.shape[1]).bfloat16()
        c_sum = slots.add_to(x, base.clone(), mask, row_slots).float()
        reference = base.float() + slots(x.float(), mask)
        assert torch.equal(c_sum[1], base[1].float())  # no adapter: untouched
        assert torch.allclose(c_sum, reference, rtol=2e-2, atol=2e-2)
    finally:
        llm.shutdown()


def test_the_disk_tier_keeps_each_adapters_kv_under_its_own_fingerprint(tmp_path) -> None:
    """--kv-cache-dir with adapters: after a restart a prompt computed under adapter "a" is
    loaded back for "a" (its output still HF + PEFT's) and never for "b" or the base model."""
    from helpers import LONG_TEXT

    torch.set_num_threads(2)
    model = "qwen3"
    modules = {name: adapter_dir(model, name) for name, *_ in ADAPTERS}
    kw = dict(dtype="float32", lora_modules=modules, max_loras=2, max_lora_rank=8)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = LLM(tiny_model(model), kv_cache_dir=tmp_path, **kw)
    try:
        first.generate([LONG_TEXT], sp, lora="a")
    finally:
        first.shutdown()  # the tree's KV to the tier
    second = LLM(tiny_model(model), kv_cache_dir=tmp_path, **kw)
    try:
        under_a = second.generate([LONG_TEXT], sp, lora="a")[0]
        assert under_a["cached_tokens"] >= 64, under_a  # whole chunks from disk
        assert under_a["token_ids"] == hf_peft_greedy(model, "a", LONG_TEXT)
        assert second.generate([LONG_TEXT], sp, lora="b")[0]["cached_tokens"] == 0
        assert second.generate([LONG_TEXT], sp)[0]["cached_tokens"] == 0
    finally:
        second.shutdown()
