"""Tokenization and incremental detokenization (the workers and the reusable pieces)."""

from .detokenize import IncrementalDetokenizer
from .tokenize import encode_chat, encode_text, extra_eos_ids, load_tokenizer

__all__ = [
    "IncrementalDetokenizer",
    "encode_chat",
    "encode_text",
    "extra_eos_ids",
    "load_tokenizer",
]
