"""sglang's known PD race that leaves state behind, proved by the phase points, and what a reset reads apart.

Rooms no sender holds: prefill's KV manager keeps a room for each request its scheduler opened a sender for
(``CommonKVSender``), until that sender clears it. sglang 0.5.23's ``CommonKVManager.update_status`` reads a
room's status and writes it with no lock, and lets decode's ``WaitingForInput`` (an opening status) create a
missing room, so other writers put rooms there that no sender holds, and nothing ever clears them:

* decode's page list lands after prefill's sender cleared the room (an abort beat it): the bootstrap thread
  creates the room again, with its ``transfer_infos`` entry;
* decode's page list for a request prefill refused at its door (no sender was ever opened);
* a transfer worker's ``Failed`` write read the room before the scheduler's clear and writes it after.

The phase points (:mod:`harness.engines.server.hold`) tell this module each sender's opening and clear. At a
reset the server is idle, so every room in prefill's KV manager is left over; the resource reading
(:mod:`harness.engines.server.resources`) counts the rooms a sender still holds (a sender never cleared: a
leak) and reads the rest apart, naming them in the reset event's note, which :func:`kept` reads back.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from harness.ledger import Event

#: Rooms a sender opened and has not cleared, and rooms senders cleared -> when (each bounded, oldest out).
_owned: dict[int, float] = {}
_cleared: dict[int, float] = {}
_MAX = 100_000
#: Whether this process sees its senders open and clear (the phase points wrapped them): without that,
#: no room is read apart.
_watching = False

#: How a reset event's note names the rooms the race left (read back by :func:`kept`).
RESURRECTED_NOTE = "; known race, rooms no sender holds: "


def _put(table: dict[int, float], room: int) -> None:
    table.pop(room, None)
    if len(table) >= _MAX:
        del table[next(iter(table))]
    table[room] = time.time()


def watch() -> None:
    """The phase points now see this process's senders open and clear their rooms."""
    global _watching
    _watching = True


def note_opened(room: int) -> None:
    """A sender opened ``room`` (a request prefill's scheduler admitted)."""
    _put(_owned, room)


def note_cleared(room: int) -> None:
    """A sender cleared ``room`` from this process's KV manager."""
    _owned.pop(room, None)
    _put(_cleared, room)


def owned(room: int) -> bool:
    """Whether a sender holds ``room`` (opened, not cleared)."""
    return room in _owned


def cleared_at(room: int) -> float | None:
    """When a sender last cleared ``room`` (None: never)."""
    return _cleared.get(room)


def unowned(rooms: set[int]) -> frozenset[int]:
    """Of ``rooms`` (those in prefill's KV manager at a reset), the ones no sender holds (none where this
    process's senders are not watched)."""
    return frozenset(r for r in rooms if r not in _owned) if _watching else frozenset()


def note(rooms: list[int]) -> str:
    """A reset event's note part naming the rooms the race left (empty for none)."""
    return RESURRECTED_NOTE + ",".join(map(str, rooms[:50])) if rooms else ""


def kept(event_note: str) -> list[int]:
    """The rooms a reset event's note says the race left (see :func:`note`)."""
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
                if RESURRECTED_NOTE not in line:  # only a reset's note names such rooms: parse no other line
                    continue
                try:
                    event = Event.from_dict(json.loads(line))
                except json.JSONDecodeError:  # a line torn by a server killed mid-write
                    continue
                if event.kind == "reset":
                    (now if event.ts >= since else before).update(kept(event.note))
        out += [f"{path.stem} room {room}" for room in sorted(now - before)]
    return out
