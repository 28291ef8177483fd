"""sglang's known PD races that leave state behind, proved by the phase points, and what a reset reads apart.

The resurrected room: prefill's sender clears its room (``CommonKVSender.clear`` pops it from the KV
manager), and a status write that races or follows the clear puts it back. sglang 0.5.23's
``CommonKVManager.update_status`` reads a room's status and writes it with no lock, and lets an opening
status create a missing room, so two writes do it:

* decode's page list lands on prefill's bootstrap thread after an abort cleared the room: its
  ``WaitingForInput`` creates the room again (and the thread's ``transfer_infos`` entry with it);
* a transfer worker's ``Failed`` write read the room before the scheduler's clear and writes after it.

No sender is left to clear the room again: the KV manager keeps it for the server's life. The phase points
(:mod:`harness.engines.server.hold`) tell this module every clear and every opening (a sender's
``Bootstrapping``); a room that is present in prefill's KV manager at a reset, was cleared by its sender
and was not opened since, was put back after its clear. The resource reading
(:mod:`harness.engines.server.resources`) counts only such rooms apart from a leak and names them in the
reset event's note, which :func:`kept` reads back.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

#: This process's rooms its senders cleared and no sender opened since -> when (bounded: a long soak
#: cannot grow it; a room dropped by the bound is counted as a leak again, never excused).
_cleared: dict[int, float] = {}
_MAX = 100_000

#: How a reset event's note names the rooms the race left (read back by :func:`kept`).
RESURRECTED_NOTE = "; known race, rooms sglang re-created after their clear: "


def note_cleared(room: int) -> None:
    """A sender cleared ``room`` from this process's KV manager."""
    if len(_cleared) >= _MAX:
        _cleared.clear()
    _cleared[room] = time.time()


def note_opened(room: int) -> None:
    """A sender opened ``room`` (a new request's ``Bootstrapping``): whatever holds it now is live."""
    _cleared.pop(room, None)


def cleared_at(room: int) -> float | None:
    """When a sender cleared ``room`` (None: never, or opened again since)."""
    return _cleared.get(room)


def cleared_rooms() -> frozenset[int]:
    """The rooms senders cleared and none opened since: any of them still in the KV manager was put back."""
    return frozenset(_cleared)


def note(rooms: list[int]) -> str:
    """A reset event's note part naming the rooms the race left (empty for none)."""
    return RESURRECTED_NOTE + ",".join(map(str, rooms[:50])) if rooms else ""


def kept(event_note: str) -> list[int]:
    """The rooms a reset event's note says the resurrected-room race left (see :func:`note`)."""
    if RESURRECTED_NOTE not in event_note:
        return []
    tail = event_note.split(RESURRECTED_NOTE, 1)[1].split(";", 1)[0]
    return [int(r) for r in tail.split(",") if r.strip().isdigit()]


def kept_since(ledger_dir: Path, since: float) -> list[str]:
    """``<worker> room R`` for each room a reset since ``since`` named kept by the race and no reset before
    named (the servers' probe ledgers in ``ledger_dir``; only their ``reset`` lines are parsed)."""
    out: list[str] = []
    for path in sorted(Path(ledger_dir).glob("*.jsonl")):
        before: set[int] = set()
        now: set[int] = set()
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if RESURRECTED_NOTE not in line or '"kind":"reset"' not in line.replace(" ", ""):
                    continue
                event = json.loads(line)
                (now if event.get("ts", 0.0) >= since else before).update(kept(event.get("note", "")))
        out += [f"{path.stem} room {room}" for room in sorted(now - before)]
    return out
