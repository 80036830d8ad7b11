"""Stored Responses (`store: true`): what `previous_response_id` continues and `GET
/v1/responses/{id}` returns. In memory, bounded by count and bytes (the oldest dropped);
written to a directory as well where one is given, so they outlive a restart."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

from minisgl.utils import init_logger

logger = init_logger(__name__)

_ID = re.compile(r"^resp_[0-9a-zA-Z]+$")  # what this server issues; nothing else names a file


class ResponseStore:
    """Stored responses by id, each a JSON-able record, the oldest dropped past `max_count`
    records or `max_bytes` of their JSON; `directory`: also kept there, one file a record."""

    def __init__(
        self, max_count: int = 1024, max_bytes: int = 256 << 20, directory: str | None = None
    ) -> None:
        if max_count < 1:
            raise ValueError(f"max_count must be >= 1, got {max_count}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_count, self.max_bytes = max_count, max_bytes
        self.records: OrderedDict[str, tuple[dict[str, Any], int]] = OrderedDict()
        self.total_bytes = 0
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._load()

    def _load(self) -> None:
        assert self.directory is not None
        files = sorted(self.directory.glob("resp_*.json"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                logger.warning("skipping unreadable stored response %s: %s", path, exc)
                continue
            self._remember(path.stem, record, path.stat().st_size)

    def _remember(self, response_id: str, record: dict[str, Any], size: int) -> None:
        self.records[response_id] = (record, size)
        self.total_bytes += size
        while len(self.records) > self.max_count or (
            self.total_bytes > self.max_bytes and len(self.records) > 1
        ):
            oldest = next(iter(self.records))
            self.delete(oldest)

    def put(self, response_id: str, record: dict[str, Any]) -> None:
        """Store `record` under `response_id` (an id this server made)."""
        if not _ID.match(response_id):
            raise ValueError(f"not a response id: {response_id!r}")
        text = json.dumps(record, ensure_ascii=False)
        self.delete(response_id)
        if self.directory is not None:
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.directory / f"{response_id}.json")
        self._remember(response_id, record, len(text.encode()))

    def get(self, response_id: str) -> dict[str, Any] | None:
        entry = self.records.get(response_id)
        return None if entry is None else entry[0]

    def delete(self, response_id: str) -> bool:
        """Drop a record; whether there was one."""
        entry = self.records.pop(response_id, None)
        if entry is None:
            return False
        self.total_bytes -= entry[1]
        if self.directory is not None:
            (self.directory / f"{response_id}.json").unlink(missing_ok=True)
        return True

    def __len__(self) -> int:
        return len(self.records)
