"""Building blocks of the decoder: linear, embedding, norm, rotary, activation, attention,
mixture of experts."""

from .activation import silu_and_mul
from .attention import AttentionLayer
from .embedding import LMHead, VocabEmbedding
from .linear import Linear
from .moe import SparseMoE
from .norm import RMSNorm
from .rotary import RotaryEmbedding, RotaryInputs

__all__ = [
    "AttentionLayer",
    "LMHead",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "RotaryInputs",
    "SparseMoE",
    "VocabEmbedding",
    "silu_and_mul",
]
