"""Multi-LoRA: the adapters an engine serves, `max_loras` of them resident in slots at a time
(the least recently used one no request holds makes room), and each batch's row mask."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path

import torch

from minisgl.kernel.cpu import cpu_kernels
from minisgl.layers import Linear
from minisgl.layers.lora import LoraSlots
from minisgl.models.decoder import MLP, CausalLM
from minisgl.models.lora_adapter import LoraAdapter, read_adapter

# Radix-cache keys of an adapter's requests are its token ids moved below zero, each adapter
# into a range of its own (scheduler/cache.py): the largest offset must stay in int32.
_KEY_LIMIT = 2**31 - 1


class LoraManager:
    """Registered adapters by name, the resident ones' slots, and every projection's
    LoraSlots (attached to the model's Linear modules as `lora`)."""

    def __init__(
        self,
        model: CausalLM,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1: {max_loras}, {max_rank}")
        self.max_loras, self.max_rank = max_loras, max_rank
        # On a CPU the deltas are float32: a bf16 matmul there may be PyTorch's reference loop
        # (no bf16 dot products: AVX2), 3x the whole step's time at batch 16 on Zen 2.
        dtype = torch.float32 if device.type == "cpu" else dtype
        self.kernels = cpu_kernels() if device.type == "cpu" else None
        self.vocab_size = model.config.vocab_size
        self.projections: dict[tuple[int, str], LoraSlots] = {}
        head_dim, shard = model.config.head_dim, model.shard
        q, kv = shard.q_heads * head_dim, shard.kv_heads * head_dim
        for index, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            self._attach(index, "self_attn.qkv_proj", attn.qkv_proj, [q, kv, kv], dtype, device)
            self._attach(
                index, "self_attn.o_proj", attn.o_proj, [attn.o_proj.out_features], dtype, device
            )
            if isinstance(layer.mlp, MLP):  # sparse expert blocks take no adapters
                inter = layer.mlp.gate_up_proj.out_features // 2
                self._attach(
                    index, "mlp.gate_up_proj", layer.mlp.gate_up_proj, [inter, inter], dtype, device
                )
                self._attach(
                    index,
                    "mlp.down_proj",
                    layer.mlp.down_proj,
                    [layer.mlp.down_proj.out_features],
                    dtype,
                    device,
                )
        self.adapters: dict[str, LoraAdapter] = {}
        self.key_offsets: dict[str, int] = {}
        self.fingerprints: dict[str, str] = {}  # what names each adapter's KV on disk
        self._next_offset = 1
        self.slot_names: list[str | None] = [None] * max_loras
        self.holders = [0] * max_loras
        self.recent: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self.unregistering: set[str] = set()
        # Row 0: no adapter; row s + 1: ones on slot s's columns.
        rows = torch.zeros(max_loras + 1, max_loras * max_rank, dtype=dtype)
        for slot in range(max_loras):
            rows[slot + 1, slot * max_rank : (slot + 1) * max_rank] = 1
        self.mask_rows = rows.to(device)

    def _attach(
        self,
        layer: int,
        name: str,
        linear: Linear,
        parts: list[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        slots = LoraSlots(
            linear.in_features, parts, self.max_loras, self.max_rank, dtype, device, self.kernels
        )
        linear.lora = slots
        self.projections[(layer, name)] = slots

    def smoothed(self, scales: dict[str, torch.Tensor]) -> None:
        """`int8` smoothing's scales by projection name (models/smoothing.py): each smoothed
        projection's adapters multiply its input's channels back, and gate_up's adapters divide
        their up rows as its weight's are (by down's scales); resident ones reloaded."""
        for (layer, name), slots in self.projections.items():
            found = scales.get(f"model.layers.{layer}.{name}")
            slots.input_scales = None if found is None else found.float().cpu()
            down = scales.get(f"model.layers.{layer}.mlp.down_proj")
            slots.output_divisors = None
            if name == "mlp.gate_up_proj" and down is not None:
                gate = torch.ones(slots.part_features[0])
                slots.output_divisors = torch.cat([gate, down.float().cpu()])
        for slot, name in enumerate(self.slot_names):
            if name is not None:
                self._load(slot, self.adapters[name])

    # ---------------------------------------------------------------- registry
    def register(self, name: str, path: str) -> None:
        """Read and check an adapter folder; ValueError naming what is wrong."""
        if name in self.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is registered already")
        adapter = read_adapter(name, path, self.max_rank)
        for (layer, projection), parts in adapter.weights.items():
            slots = self.projections.get((layer, projection))
            if slots is None:
                raise ValueError(f"LoRA adapter {path!r}: layer {layer} has no {projection}")
            for part, (a, b) in parts.items():
                if a.shape[1] != slots.lora_a.shape[1] or b.shape[0] != slots.part_features[part]:
                    raise ValueError(
                        f"LoRA adapter {path!r}: layer {layer} {projection} part {part}: "
                        f"A {tuple(a.shape)} / B {tuple(b.shape)} do not fit this model"
                    )
        offset = self._next_offset
        if offset + self.vocab_size > _KEY_LIMIT:
            raise ValueError("too many LoRA adapters registered over this server's life")
        self._next_offset += self.vocab_size
        self.adapters[name], self.key_offsets[name] = adapter, offset
        self.fingerprints[name] = adapter_fingerprint(path)

    def unregister(self, name: str) -> None:
        """Refuse new requests for an adapter; the scheduler forgets it once none of its
        requests is left (`forget`)."""
        if name not in self.adapters:
            raise KeyError(name)
        self.unregistering.add(name)

    def forget(self, name: str) -> None:
        """Drop an adapter no request holds: its slot's weights zeroed and freed."""
        slot = self._slot_of(name)
        if slot is not None:
            assert self.holders[slot] == 0, f"LoRA adapter {name!r} is still held"
            for slots in self.projections.values():
                slots.clear(slot)
            self.slot_names[slot] = None
        self.unregistering.discard(name)
        del self.adapters[name], self.key_offsets[name], self.fingerprints[name]

    def _slot_of(self, name: str) -> int | None:
        return self.slot_names.index(name) if name in self.slot_names else None

    # ---------------------------------------------------------------- slots
    def acquire(self, name: str) -> int | None:
        """A slot holding the adapter for one more request (loaded into the least recently
        used free slot if it is not resident), or None while every slot is held."""
        if name not in self.adapters:
            raise KeyError(name)
        slot = self._slot_of(name)
        if slot is None:
            slot = next((s for s in self.recent if self.holders[s] == 0), None)
            if slot is None:
                return None
            self._load(slot, self.adapters[name])
        self.holders[slot] += 1
        self.recent.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        assert self.holders[slot] > 0, f"LoRA slot {slot} released more than taken"
        self.holders[slot] -= 1

    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        for key, slots in self.projections.items():
            parts = adapter.weights.get(key, {})
            slots.load(slot, [parts.get(i) for i in range(len(slots.part_features))])
        self.slot_names[slot] = adapter.name

    def tier_key(self, keys: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """An adapter's prefix-cache keys (Req.cache_key) as (its fingerprint, the token ids),
        or None where that adapter is gone."""
        shifted = -keys.long() - 1  # offset - 1 + token id
        index = int(shifted[0]) // self.vocab_size
        name = next(
            (n for n, o in self.key_offsets.items() if o == 1 + index * self.vocab_size), None
        )
        if name is None:
            return None
        return self.fingerprints[name], (shifted - index * self.vocab_size).to(torch.int32)

    def mask(self, row_slots: torch.Tensor) -> torch.Tensor | None:
        """The batch mask for rows of these slots (-1: no adapter), None if no row has one."""
        if bool((row_slots < 0).all()):
            return None
        return self.mask_rows[row_slots.to(self.mask_rows.device) + 1]


def adapter_fingerprint(path: str) -> str:
    """A hex digest of an adapter folder (its config's text, its weight files' names, sizes and
    mtimes): the disk KV tier keeps the adapter's KV under it."""
    folder = Path(path).resolve()
    spec = [str(folder), (folder / "adapter_config.json").read_text()]
    for file in sorted(folder.glob("adapter_model.*")):
        stat = file.stat()
        spec.append(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.blake2b("\n".join(spec).encode(), digest_size=16).hexdigest()
