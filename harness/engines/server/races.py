"""sglang's known PD races that the phase points prove as they happen, and what a reset reads apart.

One race leaves state behind for good: the resurrected room. Prefill's sender clears a room (an abort beat
decode's page list); the page list then lands on prefill's bootstrap thread, and sglang 0.5.23's
``CommonKVManager.update_status`` lets its ``WaitingForInput`` (an opening status) create the room again.
No sender is left to clear it: ``request_status`` and ``transfer_infos`` keep it. The phase points
(:mod:`harness.engines.server.hold`) record each such room in this process the moment the write makes it;
the resource reading (:mod:`harness.engines.server.resources`) then counts those rooms apart from a leak
and names them in the reset event's note, which :func:`kept` reads back. Only proven rooms are read apart.
"""

from __future__ import annotations

import time

#: This process's rooms re-created after their clear -> when (bounded: a long soak cannot grow it).
_resurrected: dict[int, float] = {}
_MAX = 100_000

#: How a reset event's note names the rooms the race left (read back by :func:`kept`).
RESURRECTED_NOTE = "; known race, rooms sglang re-created after their clear: "


def note_resurrected(room: int) -> None:
    """Record that this process's KV manager re-created ``room`` after its sender cleared it."""
    if len(_resurrected) >= _MAX:
        _resurrected.clear()
    _resurrected[room] = time.time()


def resurrected_rooms() -> frozenset[int]:
    """The rooms this process re-created after their clear (empty where the points are not installed)."""
    return frozenset(_resurrected)


def note(rooms: list[int]) -> str:
    """A reset event's note part naming the rooms the race left (empty for none)."""
    return RESURRECTED_NOTE + ",".join(map(str, rooms[:50])) if rooms else ""


def kept(event_note: str) -> list[int]:
    """The rooms a reset event's note says the resurrected-room race left (see :func:`note`)."""
    if RESURRECTED_NOTE not in event_note:
        return []
    tail = event_note.split(RESURRECTED_NOTE, 1)[1].split(";", 1)[0]
    return [int(r) for r in tail.split(",") if r.strip().isdigit()]
