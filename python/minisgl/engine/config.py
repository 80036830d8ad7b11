"""Engine settings: what model to run, where, and how big the KV pool is."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.layers.quantized import QUANTIZATIONS

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass
class EngineConfig:
    model_path: str
    dtype: torch.dtype = torch.bfloat16
    device: torch.device = torch.device("cpu")
    page_size: int = 1
    max_running_req: int = 256
    num_page_override: int | None = None
    max_seq_len_override: int | None = None
    attention_backend: str = "auto"  # "auto": "cpu" on a CPU with the C kernels, else "torch"
    # What log-probabilities report (vLLM's names): the model's distribution, or the one the
    # sampler draws from (after masks, penalties, logit_bias, temperature and top-k/p, min-p).
    logprobs_mode: str = "raw_logprobs"
    # layers.quantized.QUANTIZATIONS: quantized at load ("int8", "int4[-gN]"), a GGUF file's
    # own quantized tensors ("gguf"), every weight dense ("none"); None: "gguf" where gguf_path
    # is set and the device is a CPU, else as the checkpoint holds them.
    quantization: str | None = None
    # The GGUF file model_path (its converted folder: config, tokenizer) was made from.
    gguf_path: str | None = None
    # Tensor parallelism: ranks, and this process's (rank 0 schedules, see distributed/).
    tp_size: int = 1
    tp_rank: int = 0
    # Multi-node (SGLang's flags): the ranks split evenly over nnodes machines, this one's index,
    # and the HOST:PORT every rank meets at (node 0's; None: a free local port).
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # Multi-LoRA (vLLM's flags): adapters by name -> PEFT folder, registered at start; slots
    # resident at once; the largest rank. enable_lora with no modules: adapters come later.
    enable_lora: bool = False
    lora_modules: dict[str, str] | None = None
    max_loras: int = 4
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_running_req < 1:
            raise ValueError(f"max_running_req must be >= 1, got {self.max_running_req}")
        if self.num_page_override is not None and self.num_page_override < 1:
            raise ValueError(f"num_page_override must be >= 1, got {self.num_page_override}")
        if self.max_seq_len_override is not None and self.max_seq_len_override < 2:
            raise ValueError(f"max_seq_len_override must be >= 2, got {self.max_seq_len_override}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {list(QUANTIZATIONS)} or None, "
                f"got {self.quantization!r}"
            )
        if self.quantization is None and self.gguf_path is not None and self.device.type == "cpu":
            self.quantization = "gguf"
        if self.quantization == "gguf" and self.gguf_path is None:
            raise ValueError("quantization='gguf' needs a .gguf file as the model path")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {self.logprobs_mode!r}"
            )
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must lie in [0, tp_size={self.tp_size}), got {self.tp_rank}")
        if self.nnodes < 1 or self.tp_size % self.nnodes or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"nnodes {self.nnodes} must divide tp_size {self.tp_size}, node_rank "
                f"{self.node_rank} lie in [0, nnodes)"
            )
        if self.nnodes > 1 and (self.dist_init_addr is None or self.num_page_override is None):
            # Every rank's KV pool must have rank 0's slots; another node cannot ask it.
            raise ValueError("nnodes > 1 needs dist_init_addr (HOST:PORT) and num_page_override")
        if self.lora_modules:
            self.enable_lora = True
        if self.enable_lora and (self.max_loras < 1 or self.max_lora_rank < 1):
            raise ValueError(
                f"max_loras and max_lora_rank must be >= 1, got {self.max_loras}, "
                f"{self.max_lora_rank}"
            )
        if self.enable_lora and self.tp_size > 1:
            raise ValueError("LoRA adapters are served without tensor parallelism for now")
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype}")
