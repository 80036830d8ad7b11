"""Integer helpers for page arithmetic and tensor-parallel slices."""


def div_ceil(x: int, y: int) -> int:
    return -(-x // y)


def align_down(x: int, page_size: int) -> int:
    return x - x % page_size


def align_up(x: int, page_size: int) -> int:
    return div_ceil(x, page_size) * page_size


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the vocabulary rows tensor-parallel rank `rank` of `size` holds."""
    per = div_ceil(vocab_size, size)
    start = min(vocab_size, rank * per)
    return start, min(vocab_size, start + per)
