"""Per-request sampling inside one batch: penalties, logit bias, min-tokens, temperature, top-k,
top-p, min-p, seeds."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minisgl.core import Req
from minisgl.kernel.ops import ops_for

# Probabilities top-k / top-p first look among (see Sampler._top_k_top_p_).
TOP_CANDIDATES = 1024


@dataclass
class PenaltyArgs:
    """Penalised rows; their token history is read from the token pool when the step runs."""

    rows: torch.Tensor  # [R] batch rows that have penalties
    table_rows: torch.Tensor  # [R] their token-pool rows
    prompt_lens: torch.Tensor  # [R, 1]
    seq_lens: torch.Tensor  # [R, 1] tokens known when sampling (prompt + output so far)
    presence: torch.Tensor  # [R, 1]
    frequency: torch.Tensor  # [R, 1]
    repetition: torch.Tensor  # [R, 1]


@dataclass
class LogitAdjust:
    """Sparse additions to a batch's logits, applied in one index_put_: each request's
    logit_bias, and -inf on the stop tokens (EOS, stop_token_ids) of rows short of min_tokens."""

    rows: torch.Tensor  # [K] long: batch rows
    cols: torch.Tensor  # [K] long: token ids
    values: torch.Tensor  # [K] float32: added to logits[rows, cols] (repeats add up)


@dataclass
class SampleArgs:
    """Sampling settings of a batch as tensors; `None` fields are switched off for every row."""

    all_greedy: bool
    greedy_rows: torch.Tensor | None = None  # [B] bool; None when no row is greedy
    temperatures: torch.Tensor | None = None  # [B, 1]
    top_k: torch.Tensor | None = None  # [B, 1] long; vocab size where disabled
    top_p: torch.Tensor | None = None  # [B, 1]
    min_p: torch.Tensor | None = None  # [B, 1]
    # Seeded rows and the uniform number each draws with (seeded_uniform).
    seeded: tuple[torch.Tensor, torch.Tensor] | None = None
    penalties: PenaltyArgs | None = None
    # Structured output: (rows, int32 bitmask [rows, ceil(vocab / 32)] of the allowed tokens).
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    adjust: LogitAdjust | None = None


class Sampler:
    """Turns the last-token logits of each request into its next token."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._scratch: dict[str, torch.Tensor] = {}

    def _scratch_like(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A float32 buffer shaped like `like` [rows, vocab], kept across steps: at batch 64 x
        151,936 a logits-sized temporary is over glibc's 32 MB heap limit, so each fresh one
        was an mmap and ~9,500 page faults (~10 ms)."""
        rows, cols = like.shape
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols or buf.device != like.device:
            buf = torch.empty(rows, cols, dtype=torch.float32, device=like.device)
            self._scratch[name] = buf
        return buf[:rows]

    def prepare(self, reqs: list[Req], eos_ids: frozenset[int] = frozenset()) -> SampleArgs:
        """The batch's sampling tensors; `eos_ids` are what min_tokens keeps from being drawn."""
        params = [r.sampling_params for r in reqs]
        penalties = self._prepare_penalties(reqs)
        adjust = self._prepare_adjust(reqs, eos_ids)
        if all(p.is_greedy for p in params):
            return SampleArgs(all_greedy=True, penalties=penalties, adjust=adjust)
        device = self.device

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True).unsqueeze(1)

        greedy = [p.is_greedy for p in params]
        args = SampleArgs(
            all_greedy=False,
            greedy_rows=torch.tensor(greedy, dtype=torch.bool).to(device) if any(greedy) else None,
            temperatures=column(
                [1.0 if g else p.temperature for g, p in zip(greedy, params)], torch.float32
            ),
            penalties=penalties,
            adjust=adjust,
        )
        if any(p.top_k > 1 for p in params):
            args.top_k = column(
                [min(p.top_k, self.vocab_size) if p.top_k > 0 else self.vocab_size for p in params],
                torch.int64,
            )
        if any(p.top_p < 1.0 for p in params):
            args.top_p = column([p.top_p for p in params], torch.float32)
        if any(p.min_p > 0.0 for p in params):
            args.min_p = column([p.min_p for p in params], torch.float32)
        seeded = [
            (i, seeded_uniform(p.seed, r.device_len - r.prompt_len))
            for i, (r, p) in enumerate(zip(reqs, params))
            if p.seed is not None and not p.is_greedy
        ]
        if seeded:
            rows, uniforms = zip(*seeded)
            args.seeded = (
                torch.tensor(rows, dtype=torch.int64).to(device),
                torch.tensor(uniforms, dtype=torch.float64).to(device),
            )
        return args

    def _prepare_penalties(self, reqs: list[Req]) -> PenaltyArgs | None:
        rows = [i for i, r in enumerate(reqs) if r.sampling_params.has_penalties]
        if not rows:
            return None
        device = self.device

        def column(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device).unsqueeze(1)

        penalised = [reqs[i] for i in rows]
        sps = [r.sampling_params for r in penalised]
        return PenaltyArgs(
            rows=torch.tensor(rows, dtype=torch.int64).to(device),
            table_rows=torch.tensor([r.table_idx for r in penalised], dtype=torch.int64).to(device),
            prompt_lens=column([r.prompt_len for r in penalised], torch.int64),
            seq_lens=column([r.device_len for r in penalised], torch.int64),
            presence=column([p.presence_penalty for p in sps]),
            frequency=column([p.frequency_penalty for p in sps]),
            repetition=column([p.repetition_penalty for p in sps]),
        )

    def _prepare_adjust(self, reqs: list[Req], eos_ids: frozenset[int]) -> LogitAdjust | None:
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for i, req in enumerate(reqs):
            sp = req.sampling_params
            if sp.logit_bias:
                rows += [i] * len(sp.logit_bias)
                cols += sp.logit_bias
                values += sp.logit_bias.values()
            # device_len - prompt_len: output tokens known before the one drawn now (with
            # overlap too, and for a retracted request recomputing its output).
            if sp.min_tokens and req.device_len - req.prompt_len < sp.min_tokens:
                stops = set(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else eos_ids)
                # stop_token_ids are not checked against the vocabulary: one past it never stops.
                masked = [t for t in stops if t < self.vocab_size]
                rows += [i] * len(masked)
                cols += masked
                values += [-math.inf] * len(masked)
        if not rows:
            return None
        device = self.device
        return LogitAdjust(
            rows=torch.tensor(rows, dtype=torch.int64).to(device),
            cols=torch.tensor(cols, dtype=torch.int64).to(device),
            values=torch.tensor(values, dtype=torch.float32).to(device),
        )

    def _zeros_kept(self, name: str, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """A float32 [rows, cols] buffer kept across steps, all zero between uses (whoever writes
        to it zeroes what they wrote)."""
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols or buf.device != device:
            buf = torch.zeros(rows, cols, dtype=torch.float32, device=device)
            self._scratch[name] = buf
        return buf[:rows]

    def _apply_penalties(
        self, logits: torch.Tensor, pen: PenaltyArgs, token_pool: torch.Tensor
    ) -> torch.Tensor:
        """The logits with the penalised rows' history tokens adjusted (a copy in a kept
        buffer). Only the tokens in each row's history change, so everything is computed at the
        history's [rows, length] entries: vocabulary-wide temporaries cost ~155 ms a step at 64
        x 151,936 (zeroed and page-faulted afresh each time)."""
        max_len = int(pen.seq_lens.max())
        history = token_pool[pen.table_rows, :max_len].long()
        positions = torch.arange(max_len, device=logits.device)[None, :]
        known = positions < pen.seq_lens
        generated = known & (positions >= pen.prompt_lens)
        # Per-token counts, read back at the history's entries: scatter into a zero buffer,
        # gather, and zero those entries again.
        counts = self._zeros_kept("penalty_counts", len(pen.rows), logits.shape[-1], logits.device)
        output_counts = counts.scatter_add_(1, history, generated.float()).gather(1, history)
        counts.scatter_(1, history, 0.0)
        seen = counts.scatter_add_(1, history, known.float()).gather(1, history) > 0
        counts.scatter_(1, history, 0.0)
        out = self._scratch_like("penalised", logits)
        out.copy_(logits)
        rows = pen.rows[:, None]
        values = out[rows, history]
        # Repetition penalty (as transformers): shrink the logits of every seen token.
        scaled = torch.where(values > 0, values / pen.repetition, values * pen.repetition)
        values = torch.where(seen, scaled, values)
        # Presence / frequency penalties (as OpenAI): over generated tokens only.
        values = values - pen.frequency * output_counts - pen.presence * (output_counts > 0).float()
        # A token repeated in the history gets the same value at each of its entries.
        out[rows, history] = values
        return out

    def sample(
        self, logits: torch.Tensor, args: SampleArgs, token_pool: torch.Tensor
    ) -> torch.Tensor:
        """logits: [B, vocab] (float32 or the model's dtype). Returns [B] int32 token ids."""
        if args.allowed is not None:  # before everything: a disallowed token never wins
            mask_disallowed(logits, *args.allowed)
        if args.penalties is not None:
            logits = self._apply_penalties(logits.float(), args.penalties, token_pool)
        if args.adjust is not None:
            if args.penalties is None:  # the model's logits stay as they are (non-finite check)
                logits = self._scratch_like("adjusted", logits).copy_(logits)
            a = args.adjust
            logits.index_put_((a.rows, a.cols), a.values, accumulate=True)
        if args.all_greedy:  # the argmax of the logits as they are: widening changes no order
            return _argmax(logits).to(torch.int32)
        logits = logits.float()
        assert args.temperatures is not None
        # One uniform number per row, mapped through the row's distribution function (a seeded
        # row's fixed by its seed and token, whatever the batch: seeded_uniform).
        uniforms = torch.rand(len(logits), dtype=torch.float64, device=logits.device)
        if args.seeded is not None:
            uniforms[args.seeded[0]] = args.seeded[1]
        sampled = None
        if args.top_k is None and args.top_p is None and args.min_p is None:
            # Temperature alone: where the ops fuse it, the softmax is computed as the draw reads.
            sampled = ops_for(logits).sample_tempered(logits, uniforms, args.temperatures[:, 0])
        if sampled is None:
            sampled = self._sample_filtered(logits, args, uniforms)
        if args.greedy_rows is None:
            return sampled.to(torch.int32)
        return torch.where(args.greedy_rows, _argmax(logits), sampled).to(torch.int32)

    def adjusted_logits(
        self, logits: torch.Tensor, args: SampleArgs, token_pool: torch.Tensor
    ) -> torch.Tensor:
        """A float32 copy of the logits as `sample` adjusts them before temperature: the
        grammar mask, penalties, logit_bias and min_tokens (the input is left as it is)."""
        adjusted = logits.float().clone()
        if args.allowed is not None:
            mask_disallowed(adjusted, *args.allowed)
        if args.penalties is not None:  # into a kept buffer: copied out before sampling
            adjusted = self._apply_penalties(adjusted, args.penalties, token_pool).clone()
        if args.adjust is not None:
            a = args.adjust
            adjusted.index_put_((a.rows, a.cols), a.values, accumulate=True)
        return adjusted

    def _sample_filtered(
        self, logits: torch.Tensor, args: SampleArgs, uniforms: torch.Tensor
    ) -> torch.Tensor:
        """The draw through a probability buffer the filters (top-k, top-p, min-p) edit."""
        # Softmax into a kept buffer (the logits are left as they are), unnormalised unless
        # top-p reads it: the draw scales by each row's total.
        probs = ops_for(logits).tempered_softmax(
            logits, args.temperatures, args.top_p is not None, self._scratch_like("probs", logits)
        )
        if args.top_k is None and args.top_p is None:
            return self._draw(probs, None, None, args.min_p, uniforms)
        # Rows that set neither top-k nor top-p draw from every token, the others from their
        # top candidates: together, such rows had the whole batch sorted each step.
        vocab = probs.shape[-1]
        filtered = torch.zeros(len(probs), dtype=torch.bool, device=probs.device)
        if args.top_k is not None:
            filtered |= args.top_k[:, 0] < vocab
        if args.top_p is not None:
            filtered |= args.top_p[:, 0] < 1.0
        if bool(filtered.all()):
            return self._draw(probs, args.top_k, args.top_p, args.min_p, uniforms)
        sampled = torch.empty(len(probs), dtype=torch.int64, device=probs.device)
        for part, filters in ((filtered, True), (~filtered, False)):
            rows = part.nonzero()[:, 0]
            if len(rows) == 0:
                continue
            top_k, top_p, min_p = (
                None if values is None else values[rows]
                for values in (args.top_k, args.top_p, args.min_p)
            )
            if not filters:
                top_k = top_p = None
            sampled[rows] = self._draw(probs[rows], top_k, top_p, min_p, uniforms[rows])
        return sampled

    def _draw(
        self,
        probs: torch.Tensor,
        top_k: torch.Tensor | None,
        top_p: torch.Tensor | None,
        min_p: torch.Tensor | None,
        uniforms: torch.Tensor,
    ) -> torch.Tensor:
        """A draw from each row of probs (softmax weights, normalised where top_p is given)
        after top-k, top-p and min-p: from every token's weight, or from the kept candidates'
        (largest first) and their tokens."""
        weights, tokens = probs, None
        if top_k is not None or top_p is not None:
            weights, tokens = self._top_k_top_p(probs, top_k, top_p)
        if min_p is not None:
            max_prob = weights.amax(dim=-1, keepdim=True)
            weights.masked_fill_(weights < min_p * max_prob, 0.0)
        sampled = _sample_rows(weights, uniforms)
        return sampled if tokens is None else tokens.gather(1, sampled[:, None])[:, 0]

    @staticmethod
    def _top_k_top_p(
        probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What top-k and top-p keep of probs [B, vocab]: (probabilities, largest first, with
        the dropped ones zeroed; their tokens). Every row's survivors are usually among its
        TOP_CANDIDATES largest, which a selection finds ~10x faster than sorting the whole
        vocabulary: where each row's top_k is within them or their mass reaches its top_p,
        everything past them is dropped anyway (the same result as a full sort), else four
        times as many are taken, up to the whole vocabulary (sorted). A full sort of the batch
        the moment one row's mass lay past the first candidates cost SmolLM2 at batch 16,
        temperature 1 and top-p 0.95 one step in 13 (a row in 200 needed up to 1,272), 35 ms
        each; 4,096 candidates cost 3.7 ms."""
        rows, vocab = probs.shape
        k = top_k[:, 0] if top_k is not None else torch.full((rows,), vocab, device=probs.device)
        candidates = min(TOP_CANDIDATES, vocab)
        bounded = k < vocab
        if bool(bounded.any()):
            candidates = min(vocab, max(candidates, int(k[bounded].max())))
        while True:
            sorted_probs, order = _top_candidates(probs, candidates)
            if candidates == vocab:
                break
            # A row is decided where its top_k falls among the candidates or their mass
            # reaches its top_p (what lies past them is dropped either way).
            decided = k <= candidates
            if top_p is not None:
                decided |= sorted_probs.sum(dim=-1) >= top_p[:, 0]
            if bool(decided.all()):
                break
            candidates = min(vocab, 4 * candidates)
        ranks = torch.arange(sorted_probs.shape[-1], device=probs.device)[None, :]
        drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
        if top_k is not None:
            drop |= ranks >= top_k
        if top_p is not None:
            # Drop a token once the mass before it already reaches top_p (the first always stays).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= top_p
        return sorted_probs.masked_fill_(drop, 0.0), order


_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers whose output bits each depend on
    every input bit."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def seeded_uniform(seed: int, index: int) -> float:
    """The uniform number in [0, 1) with which a request seeded `seed` draws its output token
    `index` (0: the first): a hash of the two, not the next number of a generator, so a token's
    draw does not depend on how many draws came before it. A speculative verify step samples
    positions whose drafts are then rejected, and a retracted request samples its next token
    again after its prompt is recomputed: each still draws every kept token with the number
    decoding one by one uses, so a seeded request's tokens are the same with speculation as
    without it, and on every run."""
    return (_mix64(_mix64(seed & _MASK64) ^ (index & _MASK64)) >> 11) * 2.0**-53


def _top_candidates(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of probs, largest first, and their columns."""
    return ops_for(probs).top_candidates(probs, k)


def _sample_rows(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """A draw from each row of weights [B, vocab] (float32, >= 0): the first column whose
    running sum exceeds uniforms [B] times the row's total (`TorchOps.sample_rows`)."""
    return ops_for(weights).sample_rows(weights, uniforms)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first index on ties)."""
    return ops_for(x).argmax(x)


def mask_disallowed(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit of logits[rows] whose bit in bitmask (int32 [rows,
    ceil(vocab / 32)], bit j of word w: token 32 w + j) is clear; one call for the batch."""
    ops_for(logits).mask_disallowed(logits, rows, bitmask)
