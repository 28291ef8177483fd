"""The walk over one run's events that :func:`check` is: per worker and component, books of which request holds
which pages of which pool, kept event by event, with every rule of :mod:`.rules` applied where it belongs. Pure.

What is still held at the end is a ``page-leak`` when the events show its owner finished (released, refused, held
across an idle flush, or no request), else :data:`~harness.ledger.events.IN_FLIGHT` (its release may still
come): one finding per request, naming its side and last phase. The full rule: docs/modules.md.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Iterable

from harness.ledger.events import (
    ADMITTED,
    CACHE_OWNER,
    FREE_KINDS,
    IN_FLIGHT,
    KINDS,
    SWA_POOL,
    TAKE_KINDS,
    UNREADABLE,
    Event,
    LedgerConfig,
    Violation,
    ceil_div,
)
from harness.ledger import resources
from harness.ledger.resources import RESOURCES
from harness.ledger.content import check_content
from harness.ledger.rules import check_decode_window, check_eviction_floor, prealloc_violations


class _Books:
    """Live pages of one (worker, component): per pool, page id -> owner rid, and counted pages."""

    def __init__(self) -> None:
        self.owner: dict[str, dict[int, str]] = defaultdict(dict)
        self.counted: dict[tuple[str, str], int] = defaultdict(int)  # (pool, rid) -> pages
        self.live_rids: set[str] = set()
        self.baseline: dict[str, int] = {}
        self.span: dict[str, tuple[int, int]] = {}  # rid -> (seq length, SWA floor) last seen
        self.prefix: dict[str, int] = {}  # rid -> its prealloc's prefix_len (the radix match it holds)
        self.last: dict[str, Event] = {}  # rid -> its latest event (its last phase)
        self.finished: set[str] = set()  # rids known finished: holding pages at an idle server's flush, or told so

    def held(self, pool: str, rid: str) -> int:
        return sum(1 for o in self.owner[pool].values() if o == rid) + self.counted[(pool, rid)]

    def total_held(self) -> int:
        return sum(len(m) for m in self.owner.values()) + sum(self.counted.values())


def check(events: Iterable[Event], *, finished: Iterable[str] = ()) -> list[Violation]:
    """Check the accounting invariants (see the module docstring) over the events of one run.

    Events are processed per worker in ``seq`` order; workers are independent books.

    Args:
        events: events of any number of workers, in any order.
        finished: rids the caller knows finished although no event says so (their client got its
            answer): pages they still hold are a ``page-leak``, never in flight.

    Returns:
        The violations found, in event order per worker (empty when everything balances).
    """
    out: list[Violation] = []
    events = list(events)
    by_worker: dict[tuple[str, str], list[Event]] = defaultdict(list)
    for ev in events:
        by_worker[(ev.worker, ev.component)].append(ev)
    done = frozenset(finished)
    for (worker, _component), evs in sorted(by_worker.items()):
        out.extend(_check_worker(worker, sorted(evs, key=lambda e: e.seq), done))
    out.extend(check_content(events))  # across workers: a room's prefill and decode
    return out


def _check_worker(worker: str, evs: list[Event], finished: frozenset[str] = frozenset()) -> list[Violation]:
    walk = Walk(worker, finished)
    for ev in evs:
        walk.feed(ev)
    return walk.out + walk.end()


class Walk:
    """The walk over one worker's events, an event at a time: :meth:`feed` applies every per-event rule to the
    next event (in ``seq`` order) and keeps the books; :meth:`end` judges what the books still hold.

    :func:`check` is ``feed`` over every event of a (worker, component), then ``end``; a caller that sees the
    events arrive (``harness explore``, after every step) feeds only the new ones and gets the same findings.

    Args:
        worker: the worker the findings name.
        finished: rids known finished (see :func:`check`).

    Attributes:
        out: the per-event violations so far, in event order.
    """

    def __init__(self, worker: str, finished: Iterable[str] = ()) -> None:
        self.worker = worker
        self.out: list[Violation] = []
        self.books = _Books()
        self.books.finished.update(finished)
        self.config: LedgerConfig | None = None

    def _bad(self, rule: str, ev: Event | None, msg: str) -> None:
        self.out.append(
            Violation(rule, msg, ev.seq if ev else None, self.worker, ev.rid if ev else "", ev.kind if ev else "")
        )

    def feed(self, ev: Event) -> None:
        """Apply the per-event rules to ``ev``, the worker's next event, and book it."""
        books, bad = self.books, self._bad
        if not ev.rid.startswith("<"):
            books.last[ev.rid] = ev
        if ev.kind not in KINDS:
            bad("unknown-kind", ev, f"kind {ev.kind!r} is not one of {', '.join(KINDS)}")
            return
        if ev.note.startswith(UNREADABLE):
            bad("probe-unreadable", ev, f"the probe could not read {ev.note.removeprefix(UNREADABLE).strip()}")
        if ev.kind == "config":
            try:
                self.config = LedgerConfig.from_dict(ev.config)
            except TypeError as e:
                bad("no-config", ev, f"config event unreadable ({e})")
                self.config = None
            books.baseline = {**dict(ev.free_after), **dict(ev.baseline)}
            return
        config = self.config
        books.baseline.update(ev.baseline)
        # A flush's free_before counts cached slots too; what it leaves free is the real baseline.
        for pool, free in (ev.free_after if ev.kind == "reset" else ev.free_before).items():
            books.baseline.setdefault(pool, free)
        check_eviction_floor(ev, bad)
        if ev.kind == "prealloc" and ev.swa_tail_len is not None and config is None:
            bad("no-config", ev, "SWA-tail prealloc but the worker wrote no config event: no bound can be derived")
        if config is not None:
            if ev.kind == "prealloc":
                books.prefix[ev.rid] = ev.prefix_len or 0
                for v in prealloc_violations(config, ev):
                    bad(v.rule, ev, v.message)
            elif ev.kind in ("decode_alloc", "evict"):
                judged = books.span.get(ev.rid) == (ev.fill_len, ev.evicted_seqlen)
                check_decode_window(config, ev, bad, floor_judged=judged, prefix=books.prefix.get(ev.rid, 0))
        if ev.kind == "alloc_fail" and ev.note.startswith(ADMITTED):
            bad("alloc-after-admit", ev, f"prealloc failed after admission accepted the request: {ev.note}")
        if ev.kind in TAKE_KINDS:
            books.live_rids.add(ev.rid)
            _take(books, ev, bad)
        elif ev.kind in FREE_KINDS:
            _free(books, ev, bad)
            if ev.kind == "release":
                books.live_rids.discard(ev.rid)
                books.span.pop(ev.rid, None)
                books.prefix.pop(ev.rid, None)
                _hand_to_cache(books, ev.rid)
        elif ev.kind == "transfer":
            _check_transfer(books, ev, bad)
        elif ev.kind == "reset":
            _reset(books, ev, bad)
        _check_free_delta(ev, bad)
        if config is not None:
            _check_swa_held(config, books, ev, bad)
        idle = not books.live_rids and books.total_held() == 0
        if ev.free_after and (idle or ev.kind == "reset"):
            for pool, base in books.baseline.items():
                now = ev.free_after.get(pool)
                # A flush runs only on a server sglang finds idle: its resources are judged even while the
                # books still show a request live (its pages are that request's finding, not this one).
                if now is not None and now != base and (idle or pool in RESOURCES):
                    bad("not-baseline", ev, resources.not_baseline(pool, now, base))

    def end(self) -> list[Violation]:
        """What the books hold after the last event fed: a ``page-leak`` or an ``in-flight-at-end`` finding per
        request (see the module docstring). Reads the books, changes nothing."""
        books, worker = self.books, self.worker
        out: list[Violation] = []
        flying: dict[str, list[str]] = defaultdict(list)  # rid -> what it holds, pool by pool
        for pool, owners in books.owner.items():
            for owner, n in sorted(Counter(owners.values()).items()):
                example = sorted(p for p, o in owners.items() if o == owner)[:4]
                if _in_flight(books, owner):
                    flying[owner].append(f"pool {pool!r}: {n} page(s) (e.g. {example})")
                    continue
                rid = owner.removeprefix(CACHE_OWNER)
                where = " (still held after its release)" if owner != rid else ""
                out.append(
                    Violation(
                        "page-leak",
                        f"pool {pool!r}: {n} page(s) never freed{where} (e.g. {example})",
                        None,
                        worker,
                        rid,
                    )
                )
        for (pool, rid), n in sorted(books.counted.items()):
            if n and _in_flight(books, rid):
                flying[rid].append(f"pool {pool!r}: {n} counted page(s)")
            elif n:
                out.append(Violation("page-leak", f"pool {pool!r}: {n} counted page(s) never freed", None, worker, rid))
        for rid, holds in sorted(flying.items()):
            last = books.last[rid]
            out.append(
                Violation(
                    IN_FLIGHT,
                    f"{last.component} request still in flight at the end, last phase "
                    f"{last.kind} (#{last.seq}), not released yet; holds {'; '.join(holds)}",
                    None,
                    worker,
                    rid,
                    last.kind,
                )
            )
        return out


def _in_flight(books: _Books, owner: str) -> bool:
    """Whether ``owner``'s pages at the end are those of a request in flight (see the module docstring):
    a request that took them, was never released (its pages would be the cache's), did not hold them
    across an idle server's flush (nor is known finished), and whose last event is not a refused allocation."""
    last = books.last.get(owner)
    return last is not None and owner not in books.finished and last.kind != "alloc_fail"


def _take(books: _Books, ev: Event, bad) -> None:
    for pool, pages in ev.pages.items():
        if isinstance(pages, int):
            books.counted[(pool, ev.rid)] += pages
            continue
        live = books.owner[pool]
        for p in pages:
            if p in live:
                bad("page-double-alloc", ev, f"pool {pool!r} page {p} allocated while held by {live[p]}")
            live[p] = ev.rid


def _free(books: _Books, ev: Event, bad) -> None:
    for pool, pages in ev.pages.items():
        if isinstance(pages, int):
            key = (pool, ev.rid)
            if books.counted[key] < pages and books.counted[(pool, CACHE_OWNER)] + books.counted[key] < pages:
                bad("page-double-free", ev, f"pool {pool!r}: frees {pages} counted page(s), {books.counted[key]} held")
            take = min(pages, books.counted[key])
            books.counted[key] -= take
            books.counted[(pool, CACHE_OWNER)] -= min(pages - take, books.counted[(pool, CACHE_OWNER)])
            continue
        live = books.owner[pool]
        for p in pages:
            owner = live.get(p)
            if owner is None:
                bad("page-double-free", ev, f"pool {pool!r} page {p} freed but not allocated (double free?)")
            elif owner != ev.rid and not owner.startswith(CACHE_OWNER):
                bad("page-double-free", ev, f"pool {pool!r} page {p} freed by {ev.rid} but held by {owner}")
            else:
                del live[p]


def _hand_to_cache(books: _Books, rid: str) -> None:
    for live in books.owner.values():
        for p, o in live.items():
            if o == rid:
                live[p] = CACHE_OWNER + rid
    for (pool, r), n in list(books.counted.items()):
        if r == rid and n:
            books.counted[(pool, CACHE_OWNER)] += n
            books.counted[(pool, r)] = 0


def _reset(books: _Books, ev: Event, bad) -> None:
    """A flush of an idle server: whatever was neither free nor cached before it had leaked, and a
    request holding pages of its own across it had finished (it is not in flight)."""
    books.finished.update(o for live in books.owner.values() for o in live.values() if not o.startswith(CACHE_OWNER))
    books.finished.update(r for (_, r), n in books.counted.items() if n and r != CACHE_OWNER)
    for pool, before in ev.free_before.items():
        after = ev.free_after.get(pool)
        if after is not None and after != before:
            bad("reset-leak", ev, resources.reset_leak(pool, before, after))
    for live in books.owner.values():  # the flush dropped the cache's pages
        for p in [p for p, o in live.items() if o.startswith(CACHE_OWNER)]:
            del live[p]
    for key in [k for k in books.counted if k[1] == CACHE_OWNER]:
        books.counted[key] = 0


def _check_transfer(books: _Books, ev: Event, bad) -> None:
    for pool, pages in ev.pages.items():
        if isinstance(pages, int):
            continue
        live = books.owner[pool]
        stray = [p for p in pages if live.get(p) != ev.rid and not str(live.get(p)).startswith(CACHE_OWNER)]
        if stray:
            bad("transfer-unowned", ev, f"pool {pool!r}: transfer names page(s) {stray[:4]} the request does not hold")


def _check_free_delta(ev: Event, bad) -> None:
    sign = -1 if ev.kind in TAKE_KINDS else 1 if ev.kind in FREE_KINDS else 0
    if not sign:
        return
    for pool, pages in ev.pages.items():
        if pool not in ev.free_before or pool not in ev.free_after:
            continue
        n = pages if isinstance(pages, int) else len(pages)
        delta = ev.free_after[pool] - ev.free_before[pool]
        # Free sizes are in pages or tokens; accept either unit.
        if delta not in (sign * n, sign * n * ev.page_size):
            bad("free-mismatch", ev, f"pool {pool!r}: free moved by {delta} but the event names {n} page(s)")


def _check_swa_held(config: LedgerConfig, books: _Books, ev: Event, bad) -> None:
    """``swa-over-window``: a request holds no more SWA pages than its live span ``[floor, fill)`` covers."""
    if ev.rid in books.live_rids:
        fill, floor = books.span.get(ev.rid, (None, 0))
        fill = ev.fill_len if ev.fill_len is not None else fill
        floor = ev.evicted_seqlen if ev.evicted_seqlen is not None else floor
        if fill is not None:
            books.span[ev.rid] = (fill, floor)
    if ev.kind not in TAKE_KINDS or not config.swa_tail or ev.rid not in books.span:
        return
    fill, floor = books.span[ev.rid]
    P = config.page_size
    limit = ceil_div(fill, P) - floor // P
    held = books.held(SWA_POOL, ev.rid)
    if held > limit:
        bad("swa-over-window", ev, f"request holds {held} SWA pages, its live span [{floor}, {fill}) covers {limit}")
