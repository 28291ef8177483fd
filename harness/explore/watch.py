"""The ledger's rules judged after every step of a schedule without walking the whole log again each time.

:func:`harness.ledger.check` walks every event of a run; after every step of a schedule that is the whole log
again, O(n²) over a schedule. :class:`LedgerWatch` gives the same findings (less the end-of-run ones) over the
same events: it feeds each worker's new events to that worker's :class:`~harness.ledger.check.Walk` (the walk
``check`` itself runs), and runs :func:`~harness.ledger.check_content` again, over the events it reads only,
whenever one of those arrived. Where the events do not arrive as that walk needs them (a worker's ``seq`` not
increasing, a writer's list shortened, another number of writers), it falls back to ``check`` over everything.
"""

from __future__ import annotations

from typing import Sequence

from harness.ledger.check import Walk, check
from harness.ledger.content import check_content
from harness.ledger.events import CONTENT_KINDS, Event, Violation


def _content_reads(ev: Event) -> bool:
    """Whether :func:`check_content`'s verdict depends on ``ev``: a ``kv_*`` event of a room, or a decode
    event (decode pages' owners over time)."""
    return ev.component == "decode" or (ev.kind in CONTENT_KINDS and "room" in ev.content)


class LedgerWatch:
    """The ledger's rules over a schedule's events as they are written.

    :meth:`violations` takes the writers' event lists (growing between calls, in the order ``check`` is given
    them) and returns what ``[v for v in check(events) if v.rule not in end_rules]`` returns over their
    concatenation, in the same order.

    Args:
        end_rules: rules judged only at the end (left out here, as the caller leaves them out of ``check``).
    """

    def __init__(self, end_rules: frozenset[str] = frozenset()) -> None:
        self.end_rules = end_rules
        self._seen: list[int] = []  # events taken of each writer
        self._walks: dict[tuple[str, str], Walk] = {}
        self._last_seq: dict[tuple[str, str], int] = {}
        self._content: list[list[Event]] = []  # per writer, the events check_content reads
        self._content_out: list[Violation] = []
        self._exact = True  # False: the events came as the walks cannot take them; check runs over all
        self.walked = 0  # events fed to the walks (a test reads it)

    def violations(self, writers: Sequence[Sequence[Event]]) -> list[Violation]:
        """The findings over every event of ``writers`` (each writer's events in the order it wrote them; the
        same writers at every call, their lists only growing)."""
        if not self._seen and not self._walks:
            self._seen = [0] * len(writers)
            self._content = [[] for _ in writers]
        if len(writers) != len(self._seen) or any(len(evs) < n for evs, n in zip(writers, self._seen)):
            self._exact = False
        new: list[Sequence[Event]] = []
        if self._exact:
            new = [evs[n:] for evs, n in zip(writers, self._seen)]
            self._seen = [len(evs) for evs in writers]
            for ev in (ev for evs in new for ev in evs):
                key = (ev.worker, ev.component)
                last = self._last_seq.get(key)
                if last is not None and last >= ev.seq:  # check's walk takes a worker's events by seq
                    self._exact = False
                    break
                self._last_seq[key] = ev.seq
        if not self._exact:
            everything = [ev for evs in writers for ev in evs]
            return [v for v in check(everything) if v.rule not in self.end_rules]
        content_new = False
        for i, evs in enumerate(new):
            for ev in evs:
                key = (ev.worker, ev.component)
                walk = self._walks.get(key)
                if walk is None:
                    walk = self._walks[key] = Walk(ev.worker)
                walk.feed(ev)
                self.walked += 1
                if _content_reads(ev):
                    self._content[i].append(ev)
                    content_new = True
        if content_new:
            self._content_out = check_content([ev for evs in self._content for ev in evs])
        out = [v for key in sorted(self._walks) for v in self._walks[key].out]
        return [v for v in out + self._content_out if v.rule not in self.end_rules]
