"""Rows of the page table / token pool, one per running request."""

from __future__ import annotations


class TableManager:
    """Hands out page-table rows; a row is reused only after its request is fully released."""

    def __init__(self, max_running_req: int) -> None:
        self.max_running_req = max_running_req
        self._free_rows = list(range(max_running_req - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self._free_rows)

    def allocate(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free page-table row")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        if not 0 <= row < self.max_running_req or row in self._free_rows:
            raise RuntimeError(f"freeing page-table row {row} twice or out of range")
        self._free_rows.append(row)
