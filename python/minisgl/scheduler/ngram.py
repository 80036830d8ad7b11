"""N-gram drafting (SGLang's NGRAM speculative algorithm): a request's next tokens guessed from
what followed the same recent tokens before, in its own prompt and output (prompt lookup) or in
recent requests (a bounded cache). Guesses cost nothing to make; verification decides."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of one token sequence last occurred: the position
    of the token that followed it. Appending a token updates it in O(max_n); keys are the
    n-grams' hashes (a collision only makes a bad guess, which verification rejects)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._follower: dict[int, int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        seq, follower = self.tokens, self._follower
        for token in tokens:
            end = len(seq)  # the n-grams ending just before `token` are followed by it
            for n in range(self.min_n, min(self.max_n, end) + 1):
                follower[hash(tuple(seq[end - n : end]))] = end
            seq.append(token)

    def propose(self, max_tokens: int) -> tuple[list[int], int]:
        """Up to `max_tokens` tokens that followed the longest suffix seen before, and that
        suffix's length (0: none was seen)."""
        seq = self.tokens
        for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
            start = self._follower.get(hash(tuple(seq[len(seq) - n :])))
            if start is not None:
                return seq[start : start + max_tokens], n
        return [], 0


class NgramCache:
    """What followed each n-gram in recently finished requests (prompt and output): n-gram hash
    -> the next `branch_length` tokens, the least recently written dropped past `capacity`
    entries (SGLang's --speculative-ngram-capacity)."""

    def __init__(self, min_n: int, max_n: int, branch_length: int, capacity: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.branch_length, self.capacity = branch_length, capacity
        self._next: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def clear(self) -> None:
        """Forget every n-gram."""
        self._next.clear()

    def insert(self, tokens: Sequence[int]) -> None:
        if self.capacity <= 0:
            return
        seq, table = list(tokens), self._next
        for end in range(self.min_n, len(seq)):
            follow = tuple(seq[end : end + self.branch_length])
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = hash(tuple(seq[end - n : end]))
                table[key] = follow
                table.move_to_end(key)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def propose(self, suffix: Sequence[int], max_tokens: int) -> tuple[list[int], int]:
        """As NgramIndex.propose, for a sequence ending in `suffix`."""
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            follow = self._next.get(hash(tuple(suffix[len(suffix) - n :])))
            if follow is not None:
                return list(follow[:max_tokens]), n
        return [], 0
