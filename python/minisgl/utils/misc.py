"""Integer helpers for page arithmetic."""


def div_ceil(x: int, y: int) -> int:
    return -(-x // y)


def align_down(x: int, page_size: int) -> int:
    return x - x % page_size


def align_up(x: int, page_size: int) -> int:
    return div_ceil(x, page_size) * page_size
