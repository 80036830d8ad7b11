"""What speculative decoding measures to decide how many drafts pay: a decode step's seconds
against its query rows (a line fitted as it runs) and a draft catch-up's seconds per token."""

from __future__ import annotations

# The cost of one more query row relative to a one-row step, before any step was measured.
PRIOR_ROW_COST = 0.03
# A row count's (decaying) weight of measurements from which its own mean time stands for it.
SEEN_WEIGHT = 1.0


class StepCost:
    """A decode step's seconds as c0 + c1 * rows: a weighted least-squares line through the
    mean seconds of each row count seen (means and weights decay, so the line follows a
    context that grows). Until two row counts are seen, a row costs `row_cost` of the step:
    optimistic, so that drafts get tried and measured."""

    decay = 0.98

    def __init__(self, row_cost: float = PRIOR_ROW_COST) -> None:
        self.row_cost = row_cost
        self._buckets: dict[int, list[float]] = {}  # rows -> [weighted seconds, weight]

    @property
    def measured(self) -> bool:
        return bool(self._buckets)

    def observe(self, rows: int, seconds: float) -> None:
        if seconds <= 0 or rows <= 0:
            return
        self.fade()
        bucket = self._buckets.setdefault(rows, [0.0, 0.0])
        bucket[0] += seconds
        bucket[1] += 1.0

    def fade(self) -> None:
        """Older measurements weigh less; row counts not seen for long weigh nothing and are
        dropped (all of them: the prior is back, and what was measured dear is tried again)."""
        for bucket in self._buckets.values():
            bucket[0] *= self.decay
            bucket[1] *= self.decay
        for stale in [r for r, (_, w) in self._buckets.items() if w < 1e-3]:
            del self._buckets[stale]

    def seconds(self, rows: int, line: tuple[float, float]) -> float:
        """A step of `rows` rows: its row count's measured mean where it was seen lately (the
        kernels' cost is lumpy: AVX2's tiles take rows 4 at a time, and on Zen 3 a step's 5th row
        cost ~1.5x its 4th, its 6th half of that), else the line (c0, c1) of `coefficients`."""
        bucket = self._buckets.get(rows)
        if bucket is not None and bucket[1] >= SEEN_WEIGHT:
            return bucket[0] / bucket[1]
        return line[0] + line[1] * rows

    def coefficients(self) -> tuple[float, float]:
        """(c0, c1) in seconds; (1, row_cost) before any step was measured."""
        points = [(rows, total / weight, weight) for rows, (total, weight) in self._buckets.items()]
        if not points:
            return 1.0, self.row_cost
        if len(points) == 1:
            rows, seconds, _ = points[0]
            c0 = seconds / (1.0 + self.row_cost * rows)
            return c0, self.row_cost * c0
        n = sum(w for _, _, w in points)
        mean_x = sum(w * x for x, _, w in points) / n
        mean_y = sum(w * y for _, y, w in points) / n
        var = sum(w * (x - mean_x) ** 2 for x, _, w in points)
        cov = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points)
        c1 = max(cov / var, 1e-3 * mean_y / mean_x)  # a row is never free
        c0 = max(mean_y - c1 * mean_x, 1e-3 * mean_y)
        return c0, c1


class Rate:
    """Seconds per unit (a token), a decaying mean of the runs measured."""

    decay = 0.9

    def __init__(self) -> None:
        self._seconds = self._units = 0.0

    @property
    def measured(self) -> bool:
        return self._units > 0.0

    def observe(self, units: int, seconds: float) -> None:
        if units > 0 and seconds > 0:
            self._seconds = self._seconds * self.decay + seconds
            self._units = self._units * self.decay + units

    def per_unit(self) -> float:
        return self._seconds / self._units if self._units else 0.0


class MatchStats:
    """How often an n-gram draft's tokens are kept, by the match that proposed it: its length (up
    to `longest`) and whether the request's own tokens or the shared cache held it. Per depth j,
    the share of verified j-th drafts kept when the ones before them were (decaying counts over
    a prior: `prior` at depth 1, depth j - 1's share after), so drafts cut short by the cost
    model still teach what they reached."""

    decay = 0.99

    def __init__(self, depth: int, longest: int, prior: float, prior_weight: float = 1.0) -> None:
        self.depth, self.longest = depth, longest
        self.prior, self.prior_weight = prior, prior_weight
        self._counts: dict[tuple[bool, int], tuple[list[float], list[float]]] = {}

    def key(self, shared: bool, length: int) -> tuple[bool, int]:
        return shared, min(length, self.longest)

    def survival(self, key: tuple[bool, int]) -> list[float]:
        """For j = 1..depth, the chance that a draft of this match keeps its first j tokens."""
        kept, tried = self._counts.get(key, ([0.0] * self.depth, [0.0] * self.depth))
        chances, reach, prior = [], 1.0, self.prior
        for hits, trials in zip(kept, tried):
            # A depth seldom reached (the cost model cut drafts there) is judged by the one
            # before it: a fixed prior would keep drafts short once they were cut.
            prior = (hits + prior * self.prior_weight) / (trials + self.prior_weight)
            reach *= prior
            chances.append(reach)
        return chances

    def observe(self, key: tuple[bool, int], drafted: int, accepted: int) -> None:
        """A verify step kept `accepted` of a draft's `drafted` tokens."""
        kept, tried = self._counts.setdefault(key, ([0.0] * self.depth, [0.0] * self.depth))
        for j in range(self.depth):
            kept[j] *= self.decay
            tried[j] *= self.decay
        for j in range(min(accepted + 1, drafted, self.depth)):
            tried[j] += 1.0
            kept[j] += 1.0 if j < accepted else 0.0
