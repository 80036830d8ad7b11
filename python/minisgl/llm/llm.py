"""LLM: the scheduler run in-process over a batch of prompts."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from minisgl.core import SamplingParams
from minisgl.models.pooling import finish_embedding, pooling_config
from minisgl.scheduler import Scheduler, SchedulerConfig
from minisgl.tokenizer.detokenize import IncrementalDetokenizer
from minisgl.utils.hf import gguf_source, resolve_model_path

Prompt = str | list[int]
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """`None`/"auto" picks bfloat16, the fast type on both CPUs (avx512_bf16) and GPUs."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


class LLM(Scheduler):
    """Offline generation: tokenizes, runs the scheduler until every prompt is done."""

    def __init__(
        self,
        model_path: str | os.PathLike | None = None,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        page_size: int = 1,
        max_running_req: int = 256,
        num_page_override: int | None = None,
        max_seq_len_override: int | None = None,
        cache_type: str = "radix",
        radix_eviction_policy: str = "lru",
        max_prefill_length: int | None = None,
        attention_backend: str = "auto",
        schedule_policy: str = "fcfs",
        overlap_schedule: bool | None = None,
        logprobs_mode: str = "raw_logprobs",
        quantization: str | None = None,
        tp_size: int = 1,
        kv_cache_dir: str | os.PathLike | None = None,
        kv_cache_disk_gb: float = 16.0,
        speculative_algorithm: str | None = None,
        speculative_num_draft_tokens: int | None = None,
        speculative_draft_model_path: str | os.PathLike | None = None,
        speculative_draft_model_quantization: str | None = None,
        speculative_num_steps: int | None = None,
        enable_lora: bool = False,
        lora_modules: dict[str, str | os.PathLike] | None = None,
        max_loras: int = 4,
        max_lora_rank: int = 16,
        **speculative: int,
    ) -> None:
        """tp_size: tensor-parallel ranks (this process is rank 0 and starts the others).
        kv_cache_dir: a disk KV tier there (bounded by kv_cache_disk_gb), reused across runs;
        `shutdown()` writes the cache's KV to it. speculative_algorithm "NGRAM" or "STANDALONE"
        (with speculative_draft_model_path, and its speculative_draft_model_quantization):
        speculative decoding (SGLang's names;
        `speculative_ngram_*` settings as SchedulerConfig's). lora_modules: LoRA adapters by
        name (PEFT folders; vLLM's `--lora-modules`), `max_loras` resident at once, ranks up to
        `max_lora_rank`; `generate(..., lora=name)` runs prompts under one."""
        unknown = [k for k in speculative if not k.startswith("speculative_ngram_")]
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {unknown}")
        from transformers import AutoTokenizer, GenerationConfig

        path = resolve_model_path(model_path)
        gguf = gguf_source(model_path)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model_path = path
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        extra_eos: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            extra_eos.add(self.tokenizer.eos_token_id)
        if (path / "generation_config.json").exists():
            eos = GenerationConfig.from_pretrained(str(path)).eos_token_id
            extra_eos.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        config = SchedulerConfig(
            model_path=str(path),
            dtype=parse_dtype(dtype),
            device=torch.device(device),
            page_size=page_size,
            max_running_req=max_running_req,
            num_page_override=num_page_override,
            max_seq_len_override=max_seq_len_override,
            cache_type=cache_type,
            radix_eviction_policy=radix_eviction_policy,
            max_prefill_length=max_prefill_length,
            attention_backend=attention_backend,
            schedule_policy=schedule_policy,
            overlap_schedule=overlap_schedule,
            logprobs_mode=logprobs_mode,
            quantization=quantization,
            gguf_path=None if gguf is None else str(gguf),
            tp_size=tp_size,
            kv_cache_dir=None if kv_cache_dir is None else os.fspath(kv_cache_dir),
            kv_cache_disk_gb=kv_cache_disk_gb,
            speculative_algorithm=speculative_algorithm,
            speculative_num_draft_tokens=speculative_num_draft_tokens,
            speculative_draft_model_path=None
            if speculative_draft_model_path is None
            else os.fspath(speculative_draft_model_path),
            speculative_draft_model_quantization=speculative_draft_model_quantization,
            speculative_num_steps=speculative_num_steps,
            enable_lora=enable_lora,
            lora_modules={k: os.fspath(v) for k, v in (lora_modules or {}).items()},
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            **speculative,
        )
        super().__init__(config, extra_eos_ids=tuple(sorted(extra_eos)), tokenizer=self.tokenizer)

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise TypeError(f"each prompt must be a string or a list of token ids, got {prompt!r}")

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[dict[str, Any]]:
        """Generate for every prompt; returns one dict per prompt, in order. lora: the LoRA
        adapter every prompt runs under, or one per prompt (None: the base model).

        Each dict has `text`, `token_ids` (generated tokens), `finish_reason`,
        `prompt_tokens`, `cached_tokens` (prompt tokens served from the prefix cache) and
        `error` (None, or why the request failed alone: finish_reason "error"); where asked
        (`SamplingParams.logprobs` / `prompt_logprobs`), `logprobs` ([token id, logprob,
        [[id, logprob], ...] of the top alternatives] per generated token) and
        `prompt_logprobs` (the same per prompt token, the first's logprob None).
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts"
                )
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"lora has {len(loras)} entries for {len(prompts)} prompts")
        encoded = [self._encode(p) for p in prompts]
        uids = [
            self.add_request(ids, sp, lora=name)
            for ids, sp, name in zip(encoded, params_list, loras)
        ]
        index = {uid: i for i, uid in enumerate(uids)}
        tokens: list[list[int]] = [[] for _ in prompts]
        reasons: list[str | None] = [None] * len(prompts)
        cached = [0] * len(prompts)
        errors: list[str | None] = [None] * len(prompts)
        logprobs: list[list[Any]] = [[] for _ in prompts]
        prompt_logprobs: list[list[Any] | None] = [None] * len(prompts)
        # Stop strings are matched on the text as it is produced; a match ends the request.
        detoks = [
            IncrementalDetokenizer(
                self.tokenizer,
                sp.stop,
                include_stop_str=sp.include_stop_str_in_output,
                min_tokens=sp.min_tokens,
            )
            if sp.stop
            else None
            for sp in params_list
        ]
        # An EOS / stop token id that ends a request is a token of its output, but its text is
        # left out unless stop strings are included (as vLLM, and the server's detokenizer).
        cut_stop_token = [not sp.include_stop_str_in_output for sp in params_list]
        show = use_tqdm if use_tqdm is not None else len(prompts) >= 16
        with tqdm(total=len(prompts), desc="generate", disable=not show) as bar:
            while self.has_work:
                for out in self.step():
                    i, detok = index[out.uid], detoks[index[out.uid]]
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[i] = out.prompt_logprobs
                    if out.token is not None and not (detok is not None and detok.stopped):
                        tokens[i].append(out.token)
                        if out.logprobs is not None:
                            logprobs[i].append([out.token, *out.logprobs])
                        stop_token = out.finish_reason == "stop" and cut_stop_token[i]
                        if detok is not None and not stop_token:
                            detok.add_token(out.token)
                            if detok.stopped and out.finish_reason is None:
                                self.abort_request(out.uid)  # its abort output closes it
                    if out.finish_reason is not None:
                        reasons[i] = out.finish_reason
                        cached[i] = out.cached_tokens
                        errors[i] = out.error
                        bar.update(1)
        self.cache_manager.check_integrity()
        texts = [
            detok.output_text + detok.finish()
            if detok is not None
            else self.tokenizer.decode(
                toks[:-1] if reason == "stop" and cut else toks, skip_special_tokens=True
            )
            for detok, toks, reason, cut in zip(detoks, tokens, reasons, cut_stop_token)
        ]
        results = [
            {
                "text": text,
                "token_ids": toks,
                "finish_reason": "stop" if detok is not None and detok.stopped else reason,
                "prompt_tokens": len(ids),
                "cached_tokens": hit,
                "error": error,
            }
            for ids, toks, reason, hit, text, detok, error in zip(
                encoded, tokens, reasons, cached, texts, detoks, errors
            )
        ]
        for result, sp, lps, prompt_lps in zip(results, params_list, logprobs, prompt_logprobs):
            if sp.logprobs is not None:
                result["logprobs"] = lps
            if sp.prompt_logprobs is not None:
                result["prompt_logprobs"] = prompt_lps
        return results

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
    ) -> list[list[float]]:
        """One embedding per prompt: its final hidden states pooled (by default as the model
        folder's sentence-transformers config says, else the last token's, normalized);
        `dimensions`: the first that many kept (Matryoshka), normalized after the cut."""
        config = pooling_config(self.model_path)
        mode = pooling or config.mode
        unit = config.normalize if normalize is None else normalize
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        encoded = [self._encode(p) for p in prompts]  # type: ignore[union-attr]
        params = SamplingParams(max_tokens=1)
        uids = [self.add_request(ids, params, pooling=mode) for ids in encoded]
        index = {uid: i for i, uid in enumerate(uids)}
        vectors: list[list[float] | None] = [None] * len(uids)
        errors: list[str | None] = [None] * len(uids)
        while self.has_work:
            for out in self.step():
                if out.uid in index and out.finish_reason is not None:
                    vectors[index[out.uid]], errors[index[out.uid]] = out.embedding, out.error
        self.cache_manager.check_integrity()
        failed = [(i, e) for i, e in enumerate(errors) if e is not None or vectors[i] is None]
        if failed:
            raise RuntimeError(f"embedding prompt {failed[0][0]} failed: {failed[0][1]}")
        return [finish_embedding(v, dimensions, unit) for v in vectors if v is not None]

    def shutdown(self) -> None:
        """Release the engine's memory; the object is unusable afterwards."""
        from minisgl.core import get_global_ctx, reset_global_ctx

        super().shutdown()
        self.waiting.clear()
        self.running.clear()
        try:
            if get_global_ctx() is self.engine.ctx:
                reset_global_ctx()
        except RuntimeError:
            pass  # no context set: nothing to reset
        del self.engine
