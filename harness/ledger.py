"""Accounting ledger: typed KV-page events from prefill and decode workers, and a pure checker.

Every worker appends one JSON line per event to ``<run_dir>/ledger/<worker>.jsonl`` through a
:class:`LedgerWriter` (one writer per file, flushed per line, so a killed worker leaves every event
it wrote readable). :func:`read` and :func:`read_dir` load them back as :class:`Event` objects.

A worker first writes a ``config`` event (:func:`config_event`): the configuration it runs with —
page size P, sliding window W, radix cache on/off, whether decode preallocates only the SWA tail,
the SWA eviction interval, the decode reserve, the hisparse host page and compression ratio — and
its pools' free sizes at start (the baseline). The checker derives every bound from that
configuration (:class:`LedgerConfig`); it never takes a bound from sglang's own numbers.

:func:`check` is pure (no I/O): given the events of one run it returns the broken invariants as
:class:`Violation` objects (empty list = the books balance). Invariants (``W_eff`` is W, or
``max(W, P) + 1`` with the decode radix cache, as sglang keeps a whole window before the cached key):

``page-double-alloc`` / ``page-double-free`` / ``page-leak``
    every page allocated is freed exactly once, per (worker, component, pool). Pages are tracked by
    id when an event lists ids, by count when it gives a number.
``transfer-unowned``
    a transfer names only pages the request holds on that worker.
``no-config``
    an SWA-tail prealloc on a worker that wrote no ``config`` event: nothing to derive bounds from.
``swa-tail-short`` / ``swa-tail-long``
    a preallocated SWA tail keeps the window and at most one page more: ``min(W_eff, fill) <= tail < W_eff + P``.
``evicted-negative`` / ``evicted-unaligned`` / ``evicted-mismatch``
    an SWA eviction floor is >= 0, a multiple of P, and on a prealloc equals ``fill - tail``.
``swa-charge`` / ``full-charge`` / ``host-charge``
    a prealloc takes ``ceil(tail / P)`` SWA pages, ``ceil(fill / P) - prefix / P`` full pages, and
    (hisparse) ``ceil((fill // compression) / host_page)`` host pages.
``reserve-short``
    the admission reservation sglang reports for a prealloc (decode reserve excluded) covers the
    whole pages it charges: ``ceil(fill / P) * P`` full and ``ceil(tail / P) * P`` SWA tokens.
``swa-window-lost``
    at decode, every position of the window ``[fill - W, fill)`` keeps its SWA slot: floor <= fill - W.
``swa-evict-late``
    at decode, nothing before the window survives longer than the eviction interval I allows:
    ``fill - 1 - floor <= max(W_eff + P, W + I, ceil(max(W, P) / P) * P + P) - 1``.
``swa-over-window``
    a request never holds more SWA pages than its live span ``[floor, fill)`` covers.
``alloc-after-admit``
    a prealloc failed for a request admission had accepted (its pages were promised).
``probe-unreadable``
    the writer could not read a field of the event (never a silent None): the note names it.
``not-baseline``
    whenever a worker holds no live request and no cached page, every pool's free size equals the
    baseline of its ``config`` event (else the free size the worker started with).
``free-mismatch``
    on an event that lists page ids and both free sizes, the pool's free size moved by exactly the
    pages taken or returned.
``reset-leak``
    on a ``reset`` (sglang's own cache flush, recorded by the server probe), every pool's free size
    before the flush plus what its cache held equals its free size after: a slot neither free nor
    cached while the server was idle is a leak the flush would otherwise hide.
``unknown-kind``
    an event's kind is not one of :data:`KINDS`.

Pages still held by a request when it is released (a radix cache keeping them) move to the
worker's cache; a later ``evict`` under any rid frees them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

#: Event kinds. ``config`` states the worker's configuration (:class:`LedgerConfig`) and baseline;
#: ``prealloc`` and ``decode_alloc`` take pages, ``evict`` and ``release`` return them, ``transfer``
#: moves content only, ``alloc_fail`` records a failed allocation (pages it names were taken anyway
#: and must still be returned), ``reset`` is a cache flush of an idle server: its ``free_before`` is
#: each pool's free size plus what the cache held just before the flush, its ``free_after`` the free
#: size after it (they must be equal), and it drops every cached page.
KINDS = ("config", "prealloc", "transfer", "decode_alloc", "evict", "release", "alloc_fail", "reset")
TAKE_KINDS = ("prealloc", "decode_alloc", "alloc_fail")
FREE_KINDS = ("evict", "release")
COMPONENTS = ("prefill", "decode")
#: The pool whose per-request size is bounded by the window.
SWA_POOL = "swa"
FULL_POOL = "full"
HOST_POOL = "host"
#: Owner prefix of pages a released request left behind in a prefix cache (``<cache>rid``).
CACHE_OWNER = "<cache>"
#: rid of ``config`` events.
CONFIG_RID = "<config>"

#: Each rule :func:`check` enforces, with the sentence a report shows beside a violation of it.
RULES: dict[str, str] = {
    "page-double-alloc": "a page is allocated only while it is free (never twice without a free between)",
    "page-double-free": "a page is freed once, by the request that holds it (or from the prefix cache)",
    "page-leak": "every page allocated is freed exactly once, per worker and pool",
    "transfer-unowned": "a transfer names only pages the request holds on that worker",
    "evicted-negative": "an SWA eviction floor (evicted_seqlen) is never negative",
    "evicted-unaligned": "an SWA eviction floor is a multiple of the page size",
    "evicted-mismatch": "on a prealloc the SWA eviction floor equals fill_len - swa_tail_len",
    "swa-over-window": "one request never holds more SWA pages than its live span [floor, seq) covers",
    "no-config": "a worker with SWA-tail preallocs states its configuration first (the bounds come from it)",
    "swa-tail-short": "a preallocated SWA tail keeps the window: tail >= min(W_eff, fill)",
    "swa-tail-long": "a preallocated SWA tail keeps at most a page more than the window: tail < W_eff + page",
    "swa-charge": "a prealloc takes ceil(tail / page) SWA pages (past any cached prefix)",
    "full-charge": "a prealloc takes ceil(fill / page) - prefix / page full pages",
    "host-charge": "a hisparse prealloc takes ceil((fill // compression) / host_page) host pages",
    "reserve-short": "admission's reservation, less the decode reserve, covers the whole pages a prealloc charges",
    "swa-window-lost": "while decoding, every position of the window keeps its SWA slot (floor <= seq - window)",
    "swa-evict-late": "while decoding, no SWA slot before the window outlives what the eviction interval allows",
    "alloc-after-admit": "a prealloc admission accepted never fails",
    "probe-unreadable": "the probe read every field it records (none is silently missing)",
    "not-baseline": "a worker holding no request and no cached page has every pool back at its starting free size",
    "free-mismatch": "a pool's free size moves by exactly the pages an event takes or returns",
    "unknown-kind": "every event's kind is one of the known kinds",
    "reset-leak": "a cache flush finds every slot free or cached (nothing still held by a finished request)",
}

Pages = Mapping[str, "tuple[int, ...] | int"]


@dataclass(frozen=True)
class LedgerConfig:
    """The configuration a worker's bounds are derived from (the payload of a ``config`` event).

    Attributes:
        page_size: tokens per page (P).
        window: the scheduler's sliding window (W); None: no sliding-window layers.
        radix_cache: the decode radix cache is on (sglang then keeps ``max(W, P) + 1`` tokens).
        swa_tail: decode preallocates SWA slots for the window tail only (hybrid-SWA pools, P > 1).
        eviction_interval: ``SGLANG_SWA_EVICTION_INTERVAL`` of the decode worker.
        decode_reserve: tokens the admission reservation adds per request on the full pool.
        swa_decode_reserve: the same on the SWA pool (sglang drops it without a radix cache).
        host_page: hisparse host-pool page size (None: no hisparse).
        compression: hisparse KV compression ratio (host tokens = fill // compression).
    """

    page_size: int
    window: int | None = None
    radix_cache: bool = False
    swa_tail: bool = False
    eviction_interval: int = 1
    decode_reserve: int = 0
    swa_decode_reserve: int = 0
    host_page: int | None = None
    compression: int | None = None

    @property
    def w_eff(self) -> int | None:
        """The tokens a preallocated SWA tail keeps before its page floor (None without a window)."""
        if not self.window:
            return None
        return max(self.window, self.page_size) + 1 if self.radix_cache else self.window

    def tail_bounds(self, fill: int) -> tuple[int, int]:
        """``(lo, hi)``: a prealloc of ``fill`` tokens keeps ``lo <= tail < hi`` (``hi`` exclusive)."""
        w = self.w_eff
        if not self.swa_tail or w is None or fill <= 0:
            return max(fill, 0), max(fill, 0) + 1
        return min(w, fill), w + self.page_size

    def decode_span_bound(self) -> int:
        """Most tokens ``pre_len - floor`` an SWA request keeps while decoding (before its new token)."""
        P, W = self.page_size, self.window or 0
        keep = _ceil_div(max(W, P), P) * P  # a prefix-sharing cache keeps whole pages of max(W, P)
        return max((self.w_eff or 0) + P, W + self.eviction_interval, keep + P) - 1

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LedgerConfig":
        """Build from a ``config`` event's payload.

        Raises:
            TypeError: an unknown key, or ``page_size`` missing.
        """
        return cls(**dict(d))


@dataclass(frozen=True)
class Event:
    """One accounting event. ``pages`` maps a pool name to page ids (or a page count)."""

    seq: int
    ts: float
    kind: str
    rid: str
    component: str
    worker: str
    page_size: int
    window: int | None = None
    fill_len: int | None = None
    swa_tail_len: int | None = None
    evicted_seqlen: int | None = None
    prefix_len: int | None = None
    pages: Pages = field(default_factory=dict)
    free_before: Mapping[str, int] = field(default_factory=dict)
    free_after: Mapping[str, int] = field(default_factory=dict)
    reserved: Mapping[str, int] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The event as a JSON-able object (page ids as lists).

        Built field by field rather than with ``dataclasses.asdict`` (which deep-copies every
        value): workers write one event per page move, so this is on their hot path.
        """
        d = {name: getattr(self, name) for name in _FIELDS}
        d["pages"] = {k: (v if isinstance(v, int) else list(v)) for k, v in self.pages.items()}
        d["free_before"] = dict(self.free_before)
        d["free_after"] = dict(self.free_after)
        d["reserved"] = dict(self.reserved)
        d["config"] = dict(self.config)
        return d

    def to_json(self) -> str:
        """One JSON line (no newline)."""
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Event":
        """Build an event from a parsed JSON object (page lists become tuples).

        Raises:
            TypeError: a required field is missing or an unknown one is present.
        """
        d = dict(d)
        d["pages"] = {k: (v if isinstance(v, int) else tuple(int(x) for x in v)) for k, v in d.get("pages", {}).items()}
        return cls(**d)


_FIELDS = tuple(f.name for f in fields(Event))


def config_event(config: LedgerConfig, baseline: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The fields of a ``config`` event, for ``LedgerWriter.record("config", CONFIG_RID, P, **fields)``.

    Args:
        config: the worker's configuration.
        baseline: each pool's free size with nothing live (the idle state it must return to).

    Returns:
        ``config`` and ``free_after`` fields.
    """
    return {"config": config.to_dict(), "free_after": dict(baseline or {})}


@dataclass(frozen=True)
class Violation:
    """One broken invariant: which rule, where, and a sentence saying what is wrong."""

    rule: str
    message: str
    seq: int | None = None
    worker: str = ""
    rid: str = ""

    def __str__(self) -> str:
        where = f"{self.worker}#{self.seq}" if self.seq is not None else self.worker
        return f"[{self.rule}] {where} rid={self.rid or '-'}: {self.message}"


# --------------------------------------------------------------------------------------------
# writing and reading
# --------------------------------------------------------------------------------------------


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
            ev = Event(seq=self._seq, ts=time.time(), kind=kind, rid=rid, component=self.component,
                       worker=self.worker, page_size=page_size, **fields)
            self._seq += 1
            self._fh.write(ev.to_json() + "\n")
            self._fh.flush()
            self.events.append(ev)
            return ev

    def close(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.flush()
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


# --------------------------------------------------------------------------------------------
# checking (pure)
# --------------------------------------------------------------------------------------------


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def swa_page_bound(window: int, page_size: int) -> int:
    """Most SWA pages one request may hold: ``ceil((window + page) / page)``."""
    return _ceil_div(window + page_size, page_size)


class _Books:
    """Live pages of one (worker, component): per pool, page id -> owner rid, and counted pages."""

    def __init__(self) -> None:
        self.owner: dict[str, dict[int, str]] = defaultdict(dict)
        self.counted: dict[tuple[str, str], int] = defaultdict(int)  # (pool, rid) -> pages
        self.live_rids: set[str] = set()
        self.baseline: dict[str, int] = {}
        self.span: dict[str, tuple[int, int]] = {}  # rid -> (seq length, SWA floor) last seen

    def held(self, pool: str, rid: str) -> int:
        return sum(1 for o in self.owner[pool].values() if o == rid) + self.counted[(pool, rid)]

    def total_held(self) -> int:
        return sum(len(m) for m in self.owner.values()) + sum(self.counted.values())


def check(events: Iterable[Event]) -> list[Violation]:
    """Check the accounting invariants (see the module docstring) over the events of one run.

    Events are processed per worker in ``seq`` order; workers are independent books.

    Args:
        events: events of any number of workers, in any order.

    Returns:
        The violations found, in event order per worker (empty when everything balances).
    """
    out: list[Violation] = []
    by_worker: dict[tuple[str, str], list[Event]] = defaultdict(list)
    for ev in events:
        by_worker[(ev.worker, ev.component)].append(ev)
    for (worker, _component), evs in sorted(by_worker.items()):
        out.extend(_check_worker(worker, sorted(evs, key=lambda e: e.seq)))
    return out


def _check_worker(worker: str, evs: list[Event]) -> list[Violation]:
    out: list[Violation] = []
    books = _Books()
    config: LedgerConfig | None = None

    def bad(rule: str, ev: Event | None, msg: str) -> None:
        out.append(Violation(rule, msg, ev.seq if ev else None, worker, ev.rid if ev else ""))

    for ev in evs:
        if ev.kind not in KINDS:
            bad("unknown-kind", ev, f"kind {ev.kind!r} is not one of {', '.join(KINDS)}")
            continue
        if ev.note.startswith(UNREADABLE):
            bad("probe-unreadable", ev, f"the probe could not read {ev.note.removeprefix(UNREADABLE).strip()}")
        if ev.kind == "config":
            try:
                config = LedgerConfig.from_dict(ev.config)
            except TypeError as e:
                bad("no-config", ev, f"config event unreadable ({e})")
                config = None
            books.baseline = dict(ev.free_after)
            continue
        # A flush's free_before counts cached slots too; what it leaves free is the real baseline.
        for pool, free in (ev.free_after if ev.kind == "reset" else ev.free_before).items():
            books.baseline.setdefault(pool, free)
        _check_eviction_floor(ev, bad)
        if ev.kind == "prealloc" and ev.swa_tail_len is not None and config is None:
            bad("no-config", ev, "SWA-tail prealloc but the worker wrote no config event: no bound can be derived")
        if config is not None:
            if ev.kind == "prealloc":
                for v in prealloc_violations(config, ev):
                    bad(v.rule, ev, v.message)
            elif ev.kind in ("decode_alloc", "evict"):
                _check_decode_window(config, ev, bad)
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
                _hand_to_cache(books, ev.rid)
        elif ev.kind == "transfer":
            _check_transfer(books, ev, bad)
        elif ev.kind == "reset":
            _reset(books, ev, bad)
        _check_free_delta(ev, bad)
        if config is not None:
            _check_swa_held(config, books, ev, bad)
        if not books.live_rids and books.total_held() == 0 and ev.free_after:
            for pool, base in books.baseline.items():
                now = ev.free_after.get(pool)
                if now is not None and now != base:
                    bad("not-baseline", ev, f"worker idle but pool {pool!r} has {now} free, started with {base}")
    for pool, owners in books.owner.items():
        for owner, n in sorted(Counter(owners.values()).items()):
            example = sorted(p for p, o in owners.items() if o == owner)[:4]
            rid = owner.removeprefix(CACHE_OWNER)
            where = " (still held after its release)" if owner != rid else ""
            out.append(Violation("page-leak", f"pool {pool!r}: {n} page(s) never freed{where} (e.g. {example})",
                                 None, worker, rid))
    for (pool, rid), n in sorted(books.counted.items()):
        if n:
            out.append(Violation("page-leak", f"pool {pool!r}: {n} counted page(s) never freed", None, worker, rid))
    return out


#: ``note`` prefix of an ``alloc_fail`` event for a request admission had accepted.
ADMITTED = "admitted:"
#: ``note`` prefix of an event a field of which the writer (a probe) could not read.
UNREADABLE = "unreadable:"


def _count(pages: "tuple[int, ...] | int") -> int:
    return pages if isinstance(pages, int) else len(pages)


def prealloc_violations(config: LedgerConfig, ev: Event) -> list[Violation]:
    """The configuration-derived rules of one prealloc (pure; see the module docstring).

    Usable on its own by a suite that checks one allocation: build the event with
    ``Event(..., kind="prealloc", fill_len=, swa_tail_len=, evicted_seqlen=, prefix_len=, pages=, reserved=)``.

    Args:
        config: the worker's configuration.
        ev: the prealloc event (pages may be ids or counts; pools it does not name are not checked).

    Returns:
        The violations (``swa-tail-short``, ``swa-tail-long``, ``swa-charge``, ``full-charge``,
        ``host-charge``, ``reserve-short``), empty when the prealloc obeys every rule.
    """
    out: list[Violation] = []
    fill, tail = ev.fill_len, ev.swa_tail_len
    if fill is None:
        return out
    P = config.page_size

    def bad(rule: str, msg: str) -> None:
        out.append(Violation(rule, msg, ev.seq, ev.worker, ev.rid))

    swa_tail = config.swa_tail and bool(config.window) and P > 1
    if swa_tail and tail is not None:
        lo, hi = config.tail_bounds(fill)
        if tail < lo:
            bad("swa-tail-short", f"fill {fill}: tail {tail} < min(W_eff {config.w_eff}, fill) = {lo}: the window loses KV")
        elif tail >= hi:
            bad("swa-tail-long", f"fill {fill}: tail {tail} >= W_eff {config.w_eff} + page {P} = {hi}")
    prefix = ev.prefix_len or 0
    floor = ev.evicted_seqlen if ev.evicted_seqlen is not None else (fill - tail if swa_tail and tail is not None else 0)
    if FULL_POOL in ev.pages:
        want = _ceil_div(fill, P) - prefix // P
        got = _count(ev.pages[FULL_POOL])
        if got != want:
            bad("full-charge", f"fill {fill} (prefix {prefix}): {got} full page(s) charged, config says {want}")
    if SWA_POOL in ev.pages and swa_tail and tail is not None:
        want = _ceil_div(fill, P) - max(floor, prefix) // P
        got = _count(ev.pages[SWA_POOL])
        if got != want:
            bad("swa-charge", f"fill {fill}, tail {tail}: {got} SWA page(s) charged, config says {want}")
    if HOST_POOL in ev.pages and config.host_page and config.compression:
        want = _ceil_div(fill // config.compression, config.host_page)
        got = _count(ev.pages[HOST_POOL])
        if got != want:
            bad("host-charge", f"fill {fill}: {got} host page(s) charged, config says ceil({fill} // "
                f"{config.compression} / {config.host_page}) = {want}")
    if ev.reserved:
        need = {FULL_POOL: _ceil_div(fill, P) * P,
                SWA_POOL: _ceil_div(tail if swa_tail and tail is not None else fill, P) * P}
        minus = {FULL_POOL: config.decode_reserve, SWA_POOL: config.swa_decode_reserve}
        for pool, reserved in ev.reserved.items():
            if pool in need and reserved - minus[pool] < need[pool]:
                bad("reserve-short", f"pool {pool!r}: reservation {reserved} - decode reserve {minus[pool]} < "
                    f"{need[pool]} tokens of whole pages the prealloc charges")
    return out


def _check_decode_window(config: LedgerConfig, ev: Event, bad) -> None:
    """``swa-window-lost`` / ``swa-evict-late`` on a decode event carrying the seq length and floor."""
    if not config.window or ev.fill_len is None or ev.evicted_seqlen is None or ev.rid.startswith("<"):
        return
    fill, floor = ev.fill_len, ev.evicted_seqlen
    if floor > max(0, fill - config.window):
        bad("swa-window-lost", ev, f"seq {fill}: SWA floor {floor} > {fill} - window {config.window}: "
            "a position inside the window lost its SWA slot")
    bound = config.decode_span_bound()
    if fill - 1 - floor > bound:
        bad("swa-evict-late", ev, f"seq {fill}: {fill - 1 - floor} tokens before the new one keep SWA slots "
            f"(floor {floor}); window {config.window}, page {config.page_size}, eviction interval "
            f"{config.eviction_interval} allow {bound}")


def _check_eviction_floor(ev: Event, bad) -> None:
    e = ev.evicted_seqlen
    if e is None:
        return
    if e < 0:
        bad("evicted-negative", ev, f"evicted_seqlen {e} < 0")
    elif ev.page_size and e % ev.page_size:
        bad("evicted-unaligned", ev, f"evicted_seqlen {e} is not a multiple of page {ev.page_size}")
    if ev.kind == "prealloc" and ev.fill_len is not None and ev.swa_tail_len is not None:
        if e != ev.fill_len - ev.swa_tail_len:
            bad("evicted-mismatch", ev, f"evicted_seqlen {e} != fill_len {ev.fill_len} - swa_tail_len {ev.swa_tail_len}")


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
    """A flush of an idle server: whatever was neither free nor cached before it had leaked."""
    for pool, before in ev.free_before.items():
        after = ev.free_after.get(pool)
        if after is not None and after != before:
            bad("reset-leak", ev, f"pool {pool!r}: {after - before} slot(s) neither free nor cached before the "
                                  f"flush ({before} free or cached, {after} free after it)")
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
    limit = _ceil_div(fill, P) - floor // P
    held = books.held(SWA_POOL, ev.rid)
    if held > limit:
        bad("swa-over-window", ev, f"request holds {held} SWA pages, its live span [{floor}, {fill}) covers {limit}")


# --------------------------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------------------------


def summarise(events: Iterable[Event]) -> dict[str, Any]:
    """A JSON-able summary per worker: event counts, requests, pages taken per pool, violations.

    Args:
        events: the events of one run.

    Returns:
        ``{"workers": {name: {...}}, "events": n, "requests": n, "violations": [str, ...]}``.
    """
    evs = list(events)
    workers: dict[str, dict[str, Any]] = {}
    for ev in evs:
        w = workers.setdefault(ev.worker, {"component": ev.component, "kinds": Counter(), "rids": set(),
                                           "pages_taken": Counter(), "pages_freed": Counter()})
        w["kinds"][ev.kind] += 1
        w["rids"].add(ev.rid)
        for pool, pages in ev.pages.items():
            n = pages if isinstance(pages, int) else len(pages)
            if ev.kind in TAKE_KINDS:
                w["pages_taken"][pool] += n
            elif ev.kind in FREE_KINDS:
                w["pages_freed"][pool] += n
    violations = [str(v) for v in check(evs)]
    return {
        "events": len(evs),
        "requests": len({ev.rid for ev in evs if ev.kind in TAKE_KINDS and ev.rid != CACHE_OWNER}),
        "violations": violations,
        "workers": {
            name: {"component": w["component"], "kinds": dict(w["kinds"]), "requests": len(w["rids"]),
                   "pages_taken": dict(w["pages_taken"]), "pages_freed": dict(w["pages_freed"])}
            for name, w in sorted(workers.items())
        },
    }


def format_summary(summary: Mapping[str, Any]) -> str:
    """Render :func:`summarise` output as a few markdown lines for a test report."""
    lines = [f"ledger: {summary['events']} events, {summary['requests']} requests, "
             f"{len(summary['violations'])} violation(s)"]
    for name, w in summary["workers"].items():
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(w["kinds"].items()))
        taken = ", ".join(f"{p} {n}" for p, n in sorted(w["pages_taken"].items()))
        freed = ", ".join(f"{p} {n}" for p, n in sorted(w["pages_freed"].items()))
        lines.append(f"- {name} ({w['component']}): {kinds}; pages taken [{taken}] freed [{freed}]")
    lines.extend(f"  ! {v}" for v in summary["violations"][:20])
    return "\n".join(lines)
