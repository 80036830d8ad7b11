"""Tensor-parallel communication: the process groups, the collectives the sharded layers run,
and the step broadcast by which rank 0 hands every other rank the forward input it built."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from minisgl.core import Batch, Req, SamplingParams
from minisgl.utils import div_ceil, vocab_range

# Header of a step on the control group: [command, phase, requests, tokens, logits rows (-1:
# every token), prompt-logprob rows (-1: none), page-table entries].
_HEADER_LEN = 7
_STOP, _STEP = 0, 1
# The control group carries only the headers, for which a worker waits while rank 0 is idle
# (as long as the user likes): its timeout is the idle limit, the main group's a step's.
CONTROL_TIMEOUT = timedelta(days=30)


@dataclass
class StepMessage:
    """A step as rank 0 broadcasts it: the header, and the payload but the input ids."""

    header: list[int]
    payload: torch.Tensor


@dataclass
class ReplicaStep:
    """One step as a worker rank replays it: the batch (requests rebuilt with what attention
    metadata reads) and the hidden-state rows whose prompt log-probabilities rank 0 computes."""

    batch: Batch
    prompt_rows: torch.Tensor | None


@dataclass
class TPGroup:
    """This process's place among the tensor-parallel ranks; size 1 runs no collective."""

    rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _control: dist.ProcessGroup | None = None

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of the vocabulary this rank's embedding and head rows hold."""
        return vocab_range(vocab_size, self.rank, self.size)

    def connect(self, init_method: str, timeout_s: float) -> None:
        """Join the process group (gloo on CPU, NCCL on CUDA) and the gloo control group."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":  # NCCL binds each rank's communicator to its GPU
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=self.rank,
            world_size=self.size,
            timeout=timedelta(seconds=timeout_s),
        )
        self._control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._control = None

    # ------------------------------------------------------------ collectives of the layers
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel partial result (in place where contiguous)."""
        if not self.sharded:
            return x
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rank 0: the logits [rows, vocab] from every rank's vocabulary slice, in vocabulary
        order; other ranks get their own slice back (their logits are not used)."""
        if not self.sharded or local.shape[0] == 0:
            return local.new_empty(0, vocab_size) if self.sharded else local
        per = div_ceil(vocab_size, self.size)
        padded = local
        if local.shape[-1] < per:  # the last slice may be short: gathered tensors match
            padded = torch.nn.functional.pad(local, (0, per - local.shape[-1]))
        padded = padded.contiguous()
        if self.rank != 0:
            dist.gather(padded, None, dst=0)
            return local
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.gather(padded, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    # ------------------------------------------------------------ the step broadcast
    def _header(self, values: list[int]) -> torch.Tensor:
        header = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._control)
        return header

    def send_stop(self) -> None:
        """Rank 0: tell every worker to leave its loop."""
        self._header([_STOP] + [0] * (_HEADER_LEN - 1))

    def describe_step(
        self, batch: Batch, page_table: torch.Tensor, prompt_rows: torch.Tensor | None
    ) -> StepMessage:
        """Rank 0, as the step is prepared (with overlap scheduling the requests move on before
        it runs): what `Engine.forward` reads of it but the input ids, and each request's
        page-table row up to its length (the workers' tables mirror rank 0's for the batch)."""
        assert batch.positions is not None and batch.out_loc is not None
        reqs, device = batch.reqs, self.device
        lens = [r.device_len for r in reqs]
        rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64, device=device)
        lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
        cols = torch.arange(max(lens), device=device)
        entries = page_table[rows, : max(lens)][cols[None, :] < lens_t[:, None]]
        cached = torch.tensor([r.cached_len for r in reqs], dtype=torch.int64, device=device)
        logits_rows = batch.logits_indices
        parts = [batch.positions, batch.out_loc, rows, cached, lens_t]
        parts += [t for t in (logits_rows, prompt_rows) if t is not None] + [entries]
        header = [
            _STEP,
            int(batch.is_decode),
            len(reqs),
            len(batch.positions),
            -1 if logits_rows is None else len(logits_rows),
            -1 if prompt_rows is None else len(prompt_rows),
            len(entries),
        ]
        payload = torch.cat([p.to(device, torch.int64).flatten() for p in parts])
        return StepMessage(header, payload)

    def send_step(self, message: StepMessage, input_ids: torch.Tensor) -> None:
        """Rank 0, as the step runs: the described step with its input ids (read from the
        token pool only now: the previous step may just have sampled them)."""
        self._header(message.header)
        dist.broadcast(torch.cat([message.payload, input_ids.to(self.device, torch.int64)]), 0)

    def receive_step(self, page_table: torch.Tensor) -> ReplicaStep | None:
        """A worker: the next step (its page-table rows written into `page_table`), or None
        when rank 0 stops."""
        header = torch.empty(_HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._control)
        command, decode, num_reqs, tokens, num_logits, num_prompt, num_entries = header.tolist()
        if command == _STOP:
            return None
        sizes = [tokens] * 2 + [num_reqs] * 3 + [max(num_logits, 0), max(num_prompt, 0)]
        sizes += [num_entries, tokens]
        payload = torch.empty(sum(sizes), dtype=torch.int64, device=self.device)
        dist.broadcast(payload, src=0)
        positions, out_loc, rows, cached, lens, logits_rows, prompt_rows, entries, ids = (
            payload.split(sizes)
        )
        # The rows as rank 0 has them: (row, column) of every entry, columns 0..len-1 per row.
        starts = lens.cumsum(0) - lens
        entry_rows = rows.repeat_interleave(lens)
        entry_cols = torch.arange(num_entries, device=self.device) - starts.repeat_interleave(lens)
        page_table[entry_rows, entry_cols] = entries.to(page_table.dtype)
        params = SamplingParams()
        reqs = [
            Req(-1, _NO_IDS, params, 0, device_len, row, cached_len, device_len)
            for row, cached_len, device_len in zip(rows.tolist(), cached.tolist(), lens.tolist())
        ]
        batch = Batch(reqs, "decode" if decode else "prefill")
        batch.input_ids, batch.positions, batch.out_loc = ids.int(), positions, out_loc
        batch.logits_indices = None if num_logits < 0 else logits_rows
        return ReplicaStep(batch, None if num_prompt < 0 else prompt_rows)


# A replayed request's token ids are not needed: the step carries its input ids.
_NO_IDS = torch.empty(0, dtype=torch.int64)
