"""Where a tensor-parallel rank's shard of each weight is cut: q heads, KV heads (replicated
when fewer than ranks), MLP rows (each expert's too: its intermediate rows, the router whole),
and vocabulary rows of the embedding and output head."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.utils import vocab_range

from .config import ModelConfig

# Checkpoint projections cut by input columns (row-parallel); q/k/v, gate and up by rows.
_ROW_PARALLEL = ("o_proj", "down_proj")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`: its heads, MLP rows and vocabulary rows (size 1: everything)."""

    config: ModelConfig
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        c, n = self.config, self.size
        if n == 1:
            return
        if c.num_experts > 0 and c.moe_intermediate_size % n:
            raise ValueError(
                f"expert intermediate size {c.moe_intermediate_size} does not split over {n}"
            )
        if c.num_qo_heads % n:
            raise ValueError(f"{c.num_qo_heads} attention heads do not split over {n} ranks")
        if c.num_kv_heads % n and n % c.num_kv_heads:
            raise ValueError(f"{c.num_kv_heads} KV heads neither split over nor divide {n} ranks")
        if c.intermediate_size % n and not all(c.moe_layers):
            raise ValueError(f"intermediate size {c.intermediate_size} does not split over {n}")
        if c.vocab_size < n:
            raise ValueError(f"a vocabulary of {c.vocab_size} does not split over {n} ranks")

    @property
    def q_heads(self) -> int:
        return self.config.num_qo_heads // self.size

    @property
    def kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        # Replicated KV heads: each serves the ranks whose q heads form its group.
        return self.rank * self.config.num_kv_heads // self.size

    @property
    def intermediate(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def moe_intermediate(self) -> int:
        return self.config.moe_intermediate_size // self.size

    @property
    def vocab(self) -> tuple[int, int]:
        return vocab_range(self.config.vocab_size, self.rank, self.size)

    def cut(self, target: str, part: str) -> tuple[int, int, int] | None:
        """(dim, start, length) of checkpoint tensor `part` that this rank's `target`
        parameter takes; None: all of it (replicated, or size 1)."""
        if self.size == 1:
            return None
        head_dim = self.config.head_dim
        if target in _VOCAB:
            start, end = self.vocab
            return 0, start, end - start
        proj = part.rsplit(".", 2)[-2]
        if ".experts." in part:  # an expert's MLP: its intermediate rows, as a dense MLP's
            width = self.moe_intermediate
            if proj == "down_proj":
                return 1, self.rank * width, width
            return 0, self.rank * width, width
        if proj == "q_proj":
            return 0, self.rank * self.q_heads * head_dim, self.q_heads * head_dim
        if proj in ("k_proj", "v_proj"):
            return 0, self.kv_head_start * head_dim, self.kv_heads * head_dim
        if proj in ("gate_proj", "up_proj"):
            return 0, self.rank * self.intermediate, self.intermediate
        if proj in _ROW_PARALLEL and part.endswith(".weight"):
            width = self.q_heads * head_dim if proj == "o_proj" else self.intermediate
            return 1, self.rank * width, width
        return None  # norms, row-parallel biases (added once, after the sum)
