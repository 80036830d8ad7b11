"""A draft model's settings (SGLang's STANDALONE speculative algorithm): its engine config,
checked against the target's (the same vocabulary), and the draft engine built beside it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from minisgl.core import set_global_ctx
from minisgl.engine import Engine, EngineConfig
from minisgl.kvcache import MHAKVCache
from minisgl.layers.quantized import LOAD_QUANTIZATIONS
from minisgl.models import load_model_config
from minisgl.utils.hf import gguf_source, resolve_model_path

from .config import SchedulerConfig
from .draft_model import DraftModelProposer

# The files a tokenizer is read from; identical ones spare loading both tokenizers.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def check_same_vocabulary(target_dir: Path, draft_dir: Path, target_vocab: int, vocab: int) -> None:
    """ValueError naming speculative_draft_model_path where the draft's token ids would not mean
    the target's: where both folders hold a tokenizer, another vocabulary or EOS token; another
    vocab_size, unless both tokenizers are the same and both sizes hold all its tokens (a
    family's models padded differently: Qwen2.5-0.5B's 151,936 rows against 7B's 152,064)."""
    where = f"speculative_draft_model_path={str(draft_dir)!r}"
    differs = (
        f"{where}: the draft model's vocab_size {vocab} differs from the target's "
        f"{target_vocab}; a draft model must share the target's vocabulary"
    )
    if not all(any((d / f).exists() for f in TOKENIZER_FILES[:3]) for d in (target_dir, draft_dir)):
        if vocab != target_vocab:
            raise ValueError(differs)
        return
    names = [f for f in TOKENIZER_FILES if (target_dir / f).exists() or (draft_dir / f).exists()]
    same_files = all(
        (target_dir / f).exists()
        and (draft_dir / f).exists()
        and (target_dir / f).read_bytes() == (draft_dir / f).read_bytes()
        for f in names
    )
    if same_files and vocab == target_vocab:
        return
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(str(target_dir))
    theirs = ours if same_files else AutoTokenizer.from_pretrained(str(draft_dir))
    if (len(ours), ours.eos_token_id) != (len(theirs), theirs.eos_token_id) or (
        ours.get_vocab() != theirs.get_vocab()
    ):
        raise ValueError(
            f"{where}: the draft's tokenizer differs from the target's ({len(theirs)} tokens, "
            f"EOS id {theirs.eos_token_id}, against {len(ours)} and {ours.eos_token_id}, or "
            "other token strings)"
        )
    if min(vocab, target_vocab) < len(ours):
        raise ValueError(f"{differs} and does not hold all {len(ours)} of its tokenizer's tokens")


@dataclass
class DraftModelPlan:
    """The draft engine's settings, checked against the target's, and its KV bytes per token
    slot (which the target's KV budget pays: the draft gets as many pages as the target)."""

    engine_config: EngineConfig
    kv_bytes_per_slot: int

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> DraftModelPlan:
        source = config.speculative_draft_model_path
        assert source is not None
        path = resolve_model_path(source)
        gguf = gguf_source(source)
        draft, target = load_model_config(path), load_model_config(config.model_path)
        check_same_vocabulary(Path(config.model_path), path, target.vocab_size, draft.vocab_size)
        # As asked; else quantized at load like the target, a checkpoint's own format (GGUF) as
        # it comes.
        quantization = config.speculative_draft_model_quantization
        if quantization is None and config.quantization in (*LOAD_QUANTIZATIONS, "none"):
            quantization = config.quantization
        engine_config = EngineConfig(
            model_path=str(path),
            dtype=config.dtype,
            device=config.device,
            page_size=config.page_size,
            max_running_req=config.max_running_req,
            attention_backend=config.attention_backend,
            quantization=quantization,
            gguf_path=None if gguf is None else str(gguf),
        )
        kv_bytes = MHAKVCache.bytes_per_slot(
            draft.num_layers, draft.num_kv_heads, draft.head_dim, config.dtype
        )
        return cls(engine_config, kv_bytes)

    def build(self, target: Engine, max_catch_up: int) -> DraftModelProposer:
        """The draft engine beside `target` (rank 0's under tensor parallelism): as many pages
        and rows as the target's, its context length, and its CPU threads."""
        config = dataclasses.replace(
            self.engine_config,
            device=target.device,
            num_page_override=target.num_pages,
            max_seq_len_override=target.max_seq_len,
        )
        engine = Engine(config, cpu_threads=target.cpu_threads)
        set_global_ctx(target.ctx)  # the target's between steps, as without a draft
        return DraftModelProposer(engine, target.ctx, max_catch_up, target.model_config.vocab_size)
