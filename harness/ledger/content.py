"""The KV-content rules: what decode committed is what prefill sent, each destination page is written once by
its own request's source, and no page is written after its owner released it (``write-after-free``). Pure.

Read across workers from the ``kv_*`` events: pages pair up by position (the k-th page prefill sends for a room
lands in decode's k-th destination page; ``at`` is an event's first ordinal), digests per buffer and page. A
room is not judged when no source was read (no ``kv_sent`` at all). Times compare ``ts`` across processes of
one host. Payloads and rules: docs/modules.md.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from harness.ledger.events import FREE_KINDS, FULL_POOL, TAKE_KINDS, Event, Violation

#: Each content rule, with the sentence a report shows beside a violation of it.
CONTENT_RULES: dict[str, str] = {
    "kv-content": "decode commits exactly the KV bytes prefill sent, per request, layer and page",
    "kv-write-once": "every destination page of a request is written by that request's own source, exactly once",
    "write-after-free": "no KV page is written after its owner released it (the late writer's room and the "
    "page's new owner named)",
}


def digest_rows(rows: Iterable[Any]) -> list[int]:
    """The digest the rules compare: a 64-bit blake2b per page (each row a contiguous byte buffer, e.g. a
    numpy ``uint8`` row of one buffer's page), as an int."""
    return [int.from_bytes(hashlib.blake2b(memoryview(r), digest_size=8).digest(), "little") for r in rows]


@dataclass
class _Room:
    """What the events say of one bootstrap room."""

    sent: list[Event] = field(default_factory=list)
    landed: list[Event] = field(default_factory=list)
    dest: Event | None = None
    commit: Event | None = None

    def digest_at(self) -> dict[int, tuple[Event, int, list[int]]]:
        """Ordinal -> (its first ``kv_sent``, the prefill page, the digest per buffer)."""
        out: dict[int, tuple[Event, int, list[int]]] = {}
        for ev in self.sent:
            c = ev.content
            for i, page in enumerate(c.get("src", ())):
                k = int(c.get("at", 0)) + i
                if k not in out:
                    out[k] = (ev, int(page), [int(d[i]) for d in c.get("digests", ())])
        return out


class _Owners:
    """Decode pages' owners over time: per (worker, pool, page), ``[take ts, free ts, rid]`` spans."""

    def __init__(self, events: Sequence[Event]) -> None:
        self.spans: dict[tuple[str, str, int], list[list[Any]]] = defaultdict(list)
        self.released: dict[tuple[str, str], list[float]] = defaultdict(list)  # (worker, rid) -> its releases' ts
        for ev in sorted((e for e in events if e.component == "decode"), key=lambda e: (e.worker, e.seq)):
            if ev.kind == "release":
                self.released[(ev.worker, ev.rid)].append(ev.ts)
            for pool, pages in ev.pages.items():
                for p in () if isinstance(pages, int) else pages:
                    key = (ev.worker, pool, int(p))
                    if ev.kind in TAKE_KINDS:
                        self.spans[key].append([ev.ts, None, ev.rid])
                    elif ev.kind in FREE_KINDS:
                        for span in reversed(self.spans.get(key, ())):
                            if span[2] == ev.rid and span[1] is None:
                                span[1] = ev.ts
                                break

    def owner(self, worker: str, page: int, ts: float, pool: str = FULL_POOL) -> str:
        """Who held ``page`` of ``pool`` at ``ts``: its rid, or ``free``."""
        for take, free, rid in reversed(self.spans.get((worker, pool, page), ())):
            if take <= ts and (free is None or ts < free):
                return str(rid)
        return "free"


def check_content(events: Iterable[Event]) -> list[Violation]:
    """The content rules (:data:`CONTENT_RULES`) over the ``kv_*`` events of any number of workers.

    Returns:
        The violations, room by room in commit order (empty when every byte matches).
    """
    evs = list(events)
    # A room key used again (a simulated rid run again) is a new room from its next kv_dest on: events in time order.
    rooms: dict[Any, list[_Room]] = defaultdict(list)  # a bootstrap room (an int), or a simulated rank's key
    kv = (e for e in evs if e.kind in ("kv_sent", "kv_landed", "kv_dest", "kv_commit") and "room" in e.content)
    for ev in sorted(kv, key=lambda e: (e.ts, e.seq)):
        uses = rooms[ev.content["room"]]
        if not uses or (ev.kind == "kv_dest" and uses[-1].dest is not None):
            uses.append(_Room())
        room = uses[-1]
        if ev.kind == "kv_sent":
            room.sent.append(ev)
        elif ev.kind == "kv_landed":
            room.landed.append(ev)
        elif ev.kind == "kv_dest":
            room.dest = ev
        else:
            room.commit = ev
    if not rooms:
        return []
    every = [(key, r) for key, uses in rooms.items() for r in uses]
    source_read = any(r.sent for _, r in every)
    owners = _Owners(evs)
    # Who sent which bytes: (buffer, digest) -> the rooms that sent it (a late writer is named by its bytes).
    senders: dict[tuple[int, int], set[Any]] = defaultdict(set)
    for key, r in every:
        for ev in r.sent:
            for b, ds in enumerate(ev.content.get("digests", ())):
                for d in ds:
                    senders[(b, int(d))].add(key)
    out: list[Violation] = []
    for room_id, r in sorted(every, key=lambda kv: _order(kv[1])):
        out.extend(_write_once(room_id, r, rooms, owners, source_read))
        out.extend(_late_landings(room_id, r, rooms, owners))
        out.extend(_canary(room_id, r, rooms, senders))
        if r.commit is not None and (r.sent or source_read):
            out.extend(_committed(room_id, r, rooms, senders))
    return out


def _order(r: _Room) -> tuple[float, int]:
    ev = r.commit or r.dest or (r.sent[0] if r.sent else r.landed[0])
    return ev.ts, ev.seq


def _bad(rule: str, ev: Event, msg: str) -> Violation:
    return Violation(rule, msg, ev.seq, ev.worker, ev.rid, ev.kind)


def _was_dest(uses: list[_Room], worker: str, page: int) -> bool:
    """Whether a room (any use of its key) named ``page`` of ``worker`` as one of its destination pages."""
    return any(
        r.dest is not None and r.dest.worker == worker and page in _ints(r.dest.content.get("dst")) for r in uses
    )


def _pool(r: _Room) -> str:
    """The decode pool a room's destination pages are in (a real server's: the full pool)."""
    return str(r.dest.content.get("pool", FULL_POOL)) if r.dest is not None else FULL_POOL


def _ints(values: Any) -> list[int]:
    return [int(v) for v in values or ()]


def _write_once(room_id: Any, r: _Room, rooms, owners: _Owners, source_read: bool) -> list[Violation]:
    out: list[Violation] = []
    dst = _ints(r.dest.content.get("dst")) if r.dest is not None else None
    base = int(r.dest.content.get("at", 0)) if r.dest is not None else 0  # the ordinal of dst[0]
    seen: dict[int, Event] = {}
    for ev in r.sent:
        for i in range(len(ev.content.get("src", ()))):
            k = int(ev.content.get("at", 0)) + i
            if k in seen:
                out.append(
                    _bad(
                        "kv-write-once",
                        ev,
                        f"room {room_id}: page {k} of the request sent twice "
                        f"(#{seen[k].seq} and #{ev.seq}): its destination page is written twice",
                    )
                )
            elif dst is not None and not 0 <= k - base < len(dst):
                out.append(
                    _bad(
                        "kv-write-once",
                        ev,
                        f"room {room_id}: page {k} of the request sent, but decode "
                        f"named only {len(dst)} destination page(s)",
                    )
                )
            seen.setdefault(k, ev)
    written: dict[int, Event] = {}
    for ev in r.landed:
        at, to = int(ev.content.get("at", 0)), [int(p) for p in ev.content.get("dst", ())]
        for i, page in enumerate(to):
            j = at + i - base
            if dst is not None and (not 0 <= j < len(dst) or dst[j] != page):
                holder = owners.owner(r.dest.worker, page, ev.ts, _pool(r)) if r.dest is not None else "?"
                out.append(
                    _bad(
                        "kv-write-once",
                        ev,
                        f"room {room_id}: wrote decode page {page}, not its own destination (held by {holder})",
                    )
                )
            elif page in written:
                out.append(
                    _bad(
                        "kv-write-once",
                        ev,
                        f"room {room_id}: decode page {page} written twice (#{written[page].seq} and #{ev.seq})",
                    )
                )
            written.setdefault(page, ev)
    if r.commit is not None and dst is not None and (r.sent or source_read):
        missing = [p for i, p in enumerate(dst) if base + i not in seen]
        if missing:
            out.append(
                _bad(
                    "kv-write-once",
                    r.commit,
                    f"room {room_id}: committed with {len(missing)} destination "
                    f"page(s) its source never sent (e.g. {missing[:4]})",
                )
            )
    return out


def _late_landings(room_id: Any, r: _Room, rooms, owners: _Owners) -> list[Violation]:
    """A landing of this room's bytes that ended after decode released the room's request."""
    if r.dest is None:
        return []
    # the request's first release after it named the pages (a simulated rid may run again later)
    freed = next((t for t in owners.released.get((r.dest.worker, r.dest.rid), ()) if t >= r.dest.ts), None)
    out: list[Violation] = []
    for ev in r.landed:
        if freed is None or ev.ts <= freed:
            continue
        pages = [int(p) for p in ev.content.get("dst", ())]
        now = sorted({owners.owner(r.dest.worker, p, ev.ts, _pool(r)) for p in pages})
        out.append(
            _bad(
                "write-after-free",
                ev,
                f"late writer room {room_id} ({r.dest.rid}): wrote decode page(s) "
                f"{pages[:4]} {ev.ts - freed:.3f} s after decode released them; new owner: {', '.join(now)}",
            )
        )
    return out


def _writer(senders, buffer: int, digest: int, not_room: Any) -> str:
    rooms = sorted(senders.get((buffer, digest), set()) - {not_room})
    return f"room {rooms[0]}" if rooms else "an unknown writer"


def _canary(room_id: Any, r: _Room, rooms, senders) -> list[Violation]:
    """Canary mode: a destination page freed with the canary and no longer holding it when decode named it
    was written while free."""
    dest = r.dest
    canary = dest.content.get("canary") if dest is not None else None
    if dest is None or not canary:
        return []
    out = []
    expect = [int(d) for d in canary.get("expect", ())]
    for i, page in enumerate(int(p) for p in canary.get("pages", ())):
        bad = [b for b, ds in enumerate(canary.get("digests", ())) if int(ds[i]) != expect[b]]
        if bad:
            writer = _writer(senders, bad[0], int(canary["digests"][bad[0]][i]), room_id)
            out.append(
                _bad(
                    "write-after-free",
                    dest,
                    f"decode page {page} lost its canary while free: late writer "
                    f"{writer}; new owner: {dest.rid} (room {room_id}), {len(bad)} buffer(s) written",
                )
            )
    return out


def _committed(room_id: Any, r: _Room, rooms, senders) -> list[Violation]:
    """``kv-content`` on a commit, or the rule its wrong bytes point at (another room's bytes)."""
    commit = r.commit
    assert commit is not None
    dst = _ints(commit.content.get("dst"))
    base = int(commit.content.get("at", 0))
    digests = commit.content.get("digests", ())
    canary = [int(d) for d in commit.content.get("canary", ())]
    want = r.digest_at()
    wrong: list[tuple[int, int, str]] = []  # (ordinal, page, what)
    out: list[Violation] = []
    for i, page in enumerate(dst):
        k = base + i
        if k not in want:
            continue  # never sent: kv-write-once says so
        sent_ev, src, expected = want[k]
        bad = [b for b, ds in enumerate(digests) if b < len(expected) and int(ds[i]) != expected[b]]
        if not bad:
            continue
        got = int(digests[bad[0]][i])
        other = senders.get((bad[0], got), set()) - {room_id}
        if other:
            late = min(other)
            rule = "write-after-free" if _was_dest(rooms.get(late, []), commit.worker, page) else "kv-write-once"
            say = (
                f"late writer room {late}: its bytes in decode page {page} after its release; new owner: "
                f"{commit.rid} (room {room_id})"
                if rule == "write-after-free"
                else f"room {room_id}: decode page {page} holds room {late}'s bytes, not its own source's"
            )
            out.append(_bad(rule, commit, say))
            continue
        what = "the canary (never written)" if canary and got == canary[bad[0]] else "other bytes"
        wrong.append((k, page, f"page {k} (prefill {src} -> decode {page}): {len(bad)} buffer(s) hold {what}"))
    if wrong:
        out.append(
            _bad(
                "kv-content",
                commit,
                f"room {room_id}: {len(wrong)} of {len(dst)} page(s) differ from what prefill "
                f"sent; first {wrong[0][2]}",
            )
        )
    return out
