"""Writing and reading a ledger: one JSON line per event in ``<run_dir>/ledger/<worker>.jsonl``, one
writer per file, flushed per line, so a killed worker leaves every event it wrote readable."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from harness.ledger.events import Event


class LedgerWriter:
    """Appends events of one worker to one JSONL file, one flushed line per event.

    ``record`` assigns ``seq`` (per writer, from 0) and ``ts``; it is thread-safe, and the file is
    opened in append mode so a restarted worker continues its own file.
    """

    def __init__(self, path: str | Path, worker: str, component: str) -> None:
        self.path = Path(path)
        self.worker = worker
        self.component = component
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self._seq = 0
        self.events: list[Event] = []  # kept in memory too, so a worker can check itself

    def record(self, kind: str, rid: str, page_size: int, **fields: Any) -> Event:
        """Build, write and return one event of this worker.

        Args:
            kind: one of :data:`KINDS`.
            rid: the request id.
            page_size: tokens per page of the pools named in ``pages``.
            **fields: any other :class:`Event` field (window, fill_len, pages, free_before, ...).

        Returns:
            The event as written.
        """
        with self._lock:
            ev = Event(
                seq=self._seq,
                ts=time.time(),
                kind=kind,
                rid=rid,
                component=self.component,
                worker=self.worker,
                page_size=page_size,
                **fields,
            )
            self._seq += 1
            self._fh.write(ev.to_json() + "\n")
            self._fh.flush()
            self.events.append(ev)
            return ev

    def close(self, *, sync: bool = True) -> None:
        """Flush and close the file (again: nothing). ``sync``: fsync it first, so the events outlive the
        machine's crash too; a scratch ledger (``harness explore`` rewrites its files every schedule) skips it."""
        with self._lock:
            if not self._fh.closed:
                self._fh.flush()
                if sync:
                    os.fsync(self._fh.fileno())
                self._fh.close()

    def __enter__(self) -> "LedgerWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read(path: str | Path) -> list[Event]:
    """Read one ledger file. A truncated last line (a worker killed mid-write) is skipped.

    Raises:
        ValueError: a line other than the last is not a valid event (naming file and line).
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    events = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            events.append(Event.from_dict(json.loads(line)))
        except (json.JSONDecodeError, TypeError) as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a ledger event ({e})") from None
    return events


def read_dir(directory: str | Path) -> list[Event]:
    """Read every ``*.jsonl`` ledger in ``directory`` (sorted by file name, then seq)."""
    events: list[Event] = []
    for p in sorted(Path(directory).glob("*.jsonl")):
        events.extend(read(p))
    return events
