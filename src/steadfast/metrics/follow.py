"""A growing event log read as it grows: each call returns the events written since the
last one. A line still being written (no newline yet) waits for the next call; a line
that is not an event is counted and skipped (the report names such lines; a live view
must not stop on one)."""

from __future__ import annotations

import os

from .. import events

__all__ = ["LogFollower"]

#: the most bytes one call reads (the rest on the next call): a first look at a long
#: log does not stall a scrape
CHUNK = 64 * 2**20


class LogFollower:
    """The new events of the log at ``path`` (which may not exist yet)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.offset = 0
        self.skipped = 0
        self._partial = b""

    def read(self) -> list[events.Event]:
        try:
            with open(self.path, "rb") as log:
                size = os.fstat(log.fileno()).st_size
                if size < self.offset:  # a new log under the same name: from its start
                    self.offset, self._partial = 0, b""
                log.seek(self.offset)
                data = log.read(CHUNK)
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()  # after the last newline: not whole yet
        found = []
        for line in lines:
            if not line.strip():
                continue
            try:
                found.append(events.parse_event(line.decode(errors="replace"), self.path))
            except events.EventLogError:
                self.skipped += 1
        return found
