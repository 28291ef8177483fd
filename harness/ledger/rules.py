"""The rules the ledger's checker enforces (:data:`RULES`, the sentence a report shows beside each),
and those that judge one event on its own (:func:`prealloc_violations`).

:func:`harness.ledger.check.check` is pure: given one run's events it returns the broken invariants as
:class:`Violation` objects (empty: the books balance). Every rule with its exact bound (``W_eff``, the
SWA tail, charges, windows, baselines): docs/modules.md.
"""

from __future__ import annotations

from harness.ledger.content import CONTENT_RULES
from harness.ledger.events import (
    FULL_POOL,
    HOST_POOL,
    SWA_POOL,
    Event,
    LedgerConfig,
    Violation,
    ceil_div,
)

#: Each rule :func:`check` enforces, with the sentence a report shows beside a violation of it.
RULES: dict[str, str] = {
    "page-double-alloc": "a page is allocated only while it is free (never twice without a free between)",
    "page-double-free": "a page is freed once, by the request that holds it (or from the prefix cache)",
    "page-leak": "every page allocated is freed exactly once, per worker and pool",
    "in-flight-at-end": "a request holding pages when the ledger is read, never released and not shown finished, "
    "is in flight: named with its side and last phase, never called a leak",
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
    "swa-window-lost": (
        "while decoding, every position of the window keeps its SWA slot (no floor or freed slot inside it)"
    ),
    "swa-evict-late": "while decoding, no SWA slot before the window outlives what the eviction interval allows",
    "alloc-after-admit": "a prealloc admission accepted never fails",
    "probe-unreadable": "the probe read every field it records (none is silently missing)",
    "not-baseline": "a worker holding no request and no cached page (or a server at a flush) has every pool and "
    "resource (request rows, metadata slots, tree locks, KV-manager rooms, host slots) back at its baseline",
    "free-mismatch": "a pool's free size moves by exactly the pages an event takes or returns",
    "unknown-kind": "every event's kind is one of the known kinds",
    "reset-leak": "a cache flush finds every slot free or cached and no resource held (nothing still held by a "
    "finished request)",
    **CONTENT_RULES,
}

#: What breaking a rule breaks next: rule -> the rules a violation of it makes others break later on
#: the same worker and request (or the worker's pools). :func:`harness.ledger.causes.root_causes`
#: reads it, so a report leads with the cause and groups what followed under it.
_BOOKS = ("page-leak", "not-baseline", "reset-leak", "free-mismatch")
KNOCK_ONS: dict[str, tuple[str, ...]] = {
    # a tail of the wrong length: the window's pages are not where prefill's transfer puts them
    "swa-tail-short": ("swa-window-lost", "evicted-mismatch", "swa-charge", "transfer-unowned", *_BOOKS),
    "swa-tail-long": ("swa-over-window", "evicted-mismatch", "swa-charge", "transfer-unowned", *_BOOKS),
    "evicted-unaligned": ("evicted-mismatch", "swa-charge", "swa-window-lost", "transfer-unowned", *_BOOKS),
    "evicted-negative": ("evicted-mismatch", "swa-charge", "transfer-unowned", *_BOOKS),
    "evicted-mismatch": ("swa-charge", "swa-window-lost", "transfer-unowned", *_BOOKS),
    "swa-charge": ("alloc-after-admit", "transfer-unowned", *_BOOKS),
    "full-charge": ("alloc-after-admit", *_BOOKS),
    "host-charge": ("alloc-after-admit", *_BOOKS),
    "reserve-short": ("alloc-after-admit",),
    "alloc-after-admit": _BOOKS,
    "page-double-alloc": ("page-double-free", *_BOOKS),
    "page-double-free": _BOOKS,
    "page-leak": ("not-baseline", "reset-leak"),
    "free-mismatch": ("page-leak", "not-baseline", "reset-leak"),
    "transfer-unowned": ("page-double-free", *_BOOKS),
    "swa-evict-late": ("swa-over-window",),
    "swa-window-lost": ("swa-over-window",),
    "not-baseline": ("reset-leak",),
    "probe-unreadable": ("evicted-mismatch", "swa-charge", *_BOOKS),
}


def swa_page_bound(window: int, page_size: int) -> int:
    """Most SWA pages one request may hold: ``ceil((window + page) / page)``."""
    return ceil_div(window + page_size, page_size)


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
        out.append(Violation(rule, msg, ev.seq, ev.worker, ev.rid, ev.kind))

    swa_tail = config.swa_tail and bool(config.window) and P > 1
    if swa_tail and tail is not None:
        lo, hi = config.tail_bounds(fill)
        if tail < lo:
            bad(
                "swa-tail-short",
                f"fill {fill}: tail {tail} < min(W_eff {config.w_eff}, fill) = {lo}: the window loses KV",
            )
        elif tail >= hi:
            bad("swa-tail-long", f"fill {fill}: tail {tail} >= W_eff {config.w_eff} + page {P} = {hi}")
    prefix = ev.prefix_len or 0
    floor = (
        ev.evicted_seqlen if ev.evicted_seqlen is not None else (fill - tail if swa_tail and tail is not None else 0)
    )
    if FULL_POOL in ev.pages:
        want = ceil_div(fill, P) - prefix // P
        got = _count(ev.pages[FULL_POOL])
        if got != want:
            bad("full-charge", f"fill {fill} (prefix {prefix}): {got} full page(s) charged, config says {want}")
    if SWA_POOL in ev.pages and swa_tail and tail is not None:
        want = ceil_div(fill, P) - max(floor, prefix) // P
        got = _count(ev.pages[SWA_POOL])
        if got != want:
            bad("swa-charge", f"fill {fill}, tail {tail}: {got} SWA page(s) charged, config says {want}")
    if HOST_POOL in ev.pages and config.host_page and config.compression:
        want = ceil_div(fill // config.compression, config.host_page)
        got = _count(ev.pages[HOST_POOL])
        if got != want:
            bad(
                "host-charge",
                f"fill {fill}: {got} host page(s) charged, config says ceil({fill} // "
                f"{config.compression} / {config.host_page}) = {want}",
            )
    if ev.reserved:
        # the SWA pages the prealloc charges (as swa-charge counts them): none for a prefix the tree holds
        need = {FULL_POOL: ceil_div(fill, P) * P, SWA_POOL: (ceil_div(fill, P) - max(floor, prefix) // P) * P}
        minus = {FULL_POOL: config.decode_reserve, SWA_POOL: config.swa_decode_reserve}
        for pool, reserved in ev.reserved.items():
            if pool in need and reserved - minus[pool] < need[pool]:
                bad(
                    "reserve-short",
                    f"pool {pool!r}: reservation {reserved} - decode reserve {minus[pool]} < "
                    f"{need[pool]} tokens of whole pages the prealloc charges",
                )
    return out


def check_decode_window(config: LedgerConfig, ev: Event, bad, *, floor_judged: bool = False, prefix: int = 0) -> None:
    """``swa-window-lost`` / ``swa-evict-late`` on a decode event carrying the seq length and floor,
    and ``swa-window-lost`` on the positions an eviction really freed (``freed_spans``, which the
    server probe and the PD ranks both record): one rule for both engines' evictions.

    Args:
        floor_judged: the request's (seq length, floor) was already judged on an earlier event (one
            engine records a step's eviction and its allocation at the same state): the floor is not
            judged again, the freed positions still are.
        prefix: the request's protected prefix (its prealloc's ``prefix_len``). Where
            ``config.prefix_swa_in_tree``, the radix tree keeps the SWA slots of the positions below it,
            so a floor raised up to it loses none of the window; otherwise it is not read.
    """
    if not config.window or ev.fill_len is None or ev.rid.startswith("<"):
        return
    fill, W = ev.fill_len, config.window
    if ev.freed_spans:
        inside = [(max(lo, fill - W), hi) for lo, hi in ev.freed_spans if hi > max(0, fill - W)]
        if inside:
            n = sum(hi - lo for lo, hi in inside)
            bad(
                "swa-window-lost",
                ev,
                f"seq {fill}: the eviction freed the SWA slots of {n} position(s) inside "
                f"the window [{max(0, fill - W)}, {fill}) ({_said(inside)}; recorded floor {ev.evicted_seqlen})",
            )
    if ev.evicted_seqlen is None or floor_judged:
        return
    floor = ev.evicted_seqlen
    in_tree = prefix if config.prefix_swa_in_tree else 0  # the tree's slots, below the request's own
    if floor > max(0, fill - W, in_tree):
        kept = f" and the protected prefix {in_tree} whose SWA the radix tree keeps" if in_tree else ""
        bad(
            "swa-window-lost",
            ev,
            f"seq {fill}: SWA floor {floor} > {fill} - window {W}{kept}: "
            "a position inside the window lost its SWA slot",
        )
    bound = config.decode_span_bound()
    if fill - 1 - floor > bound:
        bad(
            "swa-evict-late",
            ev,
            f"seq {fill}: {fill - 1 - floor} tokens before the new one keep SWA slots "
            f"(floor {floor}); window {config.window}, page {config.page_size}, eviction interval "
            f"{config.eviction_interval} allow {bound}",
        )


def _said(spans) -> str:
    """Spans as a reader writes them: ``[448, 512)``, a few at most."""
    text = ", ".join(f"[{lo}, {hi})" for lo, hi in spans[:3])
    return text + (f" and {len(spans) - 3} more" if len(spans) > 3 else "")


def check_eviction_floor(ev: Event, bad) -> None:
    e = ev.evicted_seqlen
    if e is None:
        return
    if e < 0:
        bad("evicted-negative", ev, f"evicted_seqlen {e} < 0")
    elif ev.page_size and e % ev.page_size:
        bad("evicted-unaligned", ev, f"evicted_seqlen {e} is not a multiple of page {ev.page_size}")
    if ev.kind == "prealloc" and ev.fill_len is not None and ev.swa_tail_len is not None:
        if e != ev.fill_len - ev.swa_tail_len:
            bad(
                "evicted-mismatch", ev, f"evicted_seqlen {e} != fill_len {ev.fill_len} - swa_tail_len {ev.swa_tail_len}"
            )


# --------------------------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------------------------
