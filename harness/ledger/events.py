"""The ledger's vocabulary: event kinds, pools and owners, the configuration every bound is derived
from (:class:`LedgerConfig`), one event (:class:`Event`) and one broken rule (:class:`Violation`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping

#: Event kinds. ``config`` states the worker's configuration (:class:`LedgerConfig`) and baseline;
#: ``prealloc`` and ``decode_alloc`` take pages, ``evict`` and ``release`` return them, ``transfer``
#: moves content only, ``alloc_fail`` records a failed allocation (pages it names were taken anyway
#: and must still be returned), ``reset`` is a cache flush of an idle server: its ``free_before`` is
#: each pool's free size plus what the cache held just before the flush, its ``free_after`` the free
#: size after it (they must be equal), and it drops every cached page. The ``kv_*`` kinds carry KV
#: bytes in ``content`` (:data:`CONTENT_KINDS`; judged by :mod:`harness.ledger.content`).
#: ``kv_sent``: prefill issued a send of a room's pages (their digests); ``kv_landed``: its transfer
#: engine wrote them into decode pages; ``kv_dest``: decode named a room's destination pages;
#: ``kv_commit``: decode committed the room's transfer (the digests of what landed).
CONTENT_KINDS = ("kv_sent", "kv_landed", "kv_dest", "kv_commit")
KINDS = ("config", "prealloc", "transfer", "decode_alloc", "evict", "release", "alloc_fail", "reset", *CONTENT_KINDS)


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


Pages = Mapping[str, "tuple[int, ...] | int"]


#: Token positions as ``(lo, hi)`` spans, ``hi`` exclusive, ascending and disjoint.
Spans = tuple[tuple[int, int], ...]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


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
        prefix_swa_in_tree: with the radix cache, a request's protected prefix (its radix match) keeps
            its SWA slots in the tree while the request decodes, and the request's SWA floor is raised to
            the prefix end: positions below it are the tree's, not lost (sglang before 0.5.19; from
            0.5.19 the prefix is capped at the window start and keeps only its full-attention lock).
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
    prefix_swa_in_tree: bool = False

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
        keep = ceil_div(max(W, P), P) * P  # a prefix-sharing cache keeps whole pages of max(W, P)
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
    """One accounting event. ``pages`` maps a pool name to page ids (or a page count); on an ``evict``,
    ``freed_spans`` are the request's token positions whose SWA slots the eviction really freed (read
    from the engine's state, not from the floor it recorded: :func:`spans`)."""

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
    freed_spans: Spans = ()
    content: Mapping[str, Any] = field(default_factory=dict)
    #: On any event (a server's ``reset``): each resource's idle value as sglang sizes it
    #: (:data:`harness.ledger.resources.RESOURCES`), which ``not-baseline`` holds it to.
    baseline: Mapping[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The event as a JSON-able object (page ids as lists).

        Built field by field rather than with ``dataclasses.asdict`` (which deep-copies every
        value): workers write one event per page move, so this is on their hot path.
        """
        d = {name: getattr(self, name) for name in _FIELDS}
        d["pages"] = {k: (v if isinstance(v, int) else list(v)) for k, v in self.pages.items()}
        d["freed_spans"] = [list(s) for s in self.freed_spans]
        d["free_before"] = dict(self.free_before)
        d["free_after"] = dict(self.free_after)
        d["reserved"] = dict(self.reserved)
        d["config"] = dict(self.config)
        d["content"] = dict(self.content)
        d["baseline"] = dict(self.baseline)
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
        d["freed_spans"] = tuple((int(lo), int(hi)) for lo, hi in d.get("freed_spans", ()))
        return cls(**d)


_FIELDS = tuple(f.name for f in fields(Event))


def spans(positions: Iterable[int]) -> Spans:
    """Positions as ascending, disjoint ``(lo, hi)`` spans (``hi`` exclusive).

    >>> spans([7, 3, 4, 5, 9, 8, 4])
    ((3, 6), (7, 10))
    """
    out: list[list[int]] = []
    for p in sorted(set(positions)):
        if out and out[-1][1] == p:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return tuple((lo, hi) for lo, hi in out)


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
    """One broken invariant: which rule, where (the worker, its event and the event's kind, the request),
    and a sentence saying what is wrong."""

    rule: str
    message: str
    seq: int | None = None
    worker: str = ""
    rid: str = ""
    kind: str = ""

    def __str__(self) -> str:
        where = f"{self.worker}#{self.seq}" if self.seq is not None else self.worker
        return f"[{self.rule}] {where} rid={self.rid or '-'}: {self.message}"

    def headline(self) -> str:
        """One line that names the rule, the worker and request and what broke it, e.g.
        ``[swa-tail-short] decode-0 prealloc of r0-300: fill 300: tail 44 < min(W_eff 100, fill) = 100``.

        >>> Violation("page-leak", "pool 'swa': 1 page(s) never freed", None, "d0", "r1").headline()
        "[page-leak] d0 r1: pool 'swa': 1 page(s) never freed"
        """
        what = f"{self.kind} of {self.rid}" if self.kind and self.rid else (self.rid or self.kind)
        where = " ".join(p for p in (self.worker, what) if p)
        return f"[{self.rule}] {where}: {self.message}" if where else f"[{self.rule}] {self.message}"


#: ``note`` prefix of an ``alloc_fail`` event for a request admission had accepted.
ADMITTED = "admitted:"


#: ``note`` prefix of an event a field of which the writer (a probe) could not read.
UNREADABLE = "unreadable:"


#: The finding of a request still in flight when the ledger is read: it holds pages, was never
#: released, and nothing shows it finished (no later flush of an idle server, no refused allocation).
#: Not a broken invariant yet (its release may still come), so never a ``page-leak``.
IN_FLIGHT = "in-flight-at-end"


def split_in_flight(violations: Iterable["Violation"]) -> tuple[list["Violation"], list["Violation"]]:
    """``(broken, in_flight)``: the violations that break a rule, and the requests still in flight.

    >>> split_in_flight([Violation(IN_FLIGHT, "m", None, "d0", "r1"), Violation("page-leak", "m", None, "d0", "r2")])
    ([Violation(rule='page-leak', message='m', seq=None, worker='d0', rid='r2', kind='')], \
[Violation(rule='in-flight-at-end', message='m', seq=None, worker='d0', rid='r1', kind='')])
    """
    found = list(violations)
    return [v for v in found if v.rule != IN_FLIGHT], [v for v in found if v.rule == IN_FLIGHT]
