"""KV-pool timelines of one test: pages in use per pool on every rank, the events that moved them,
and the ledger violations placed at the event that broke each rule.

:func:`build` is pure (ledger events → one :class:`Rank` per worker); :func:`plot` draws one PNG with
matplotlib, series reduced to :data:`MAX_POINTS` steps per pool. Detail: docs/modules.md.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from harness import ledger

log = logging.getLogger(__name__)

POOLS = ("full", "swa", "host")
POOL_COLORS = {"full": "#1f77b4", "swa": "#ff7f0e", "host": "#2ca02c"}
#: Event kinds drawn in the strip under each rank, top to bottom, with their labels and markers.
LANES = (
    ("prealloc", "prealloc", "^", "#1f77b4"),
    ("alloc_fail", "alloc fail", "x", "#9467bd"),
    ("transfer", "transfer", ">", "#17becf"),
    ("evict", "decode-evict", "v", "#ff7f0e"),
    ("release", "release", "o", "#2ca02c"),
)
MAX_POINTS = 1500
#: PNG text-chunk key holding the violations (read back by tests and tools).
PNG_VIOLATIONS_KEY = "Violations"


@dataclass(frozen=True)
class Mark:
    """One violation, tied to the event that broke the rule.

    Attributes:
        label: ``V1``, ``V2``… in the order shown: each root cause, then the knock-ons that followed it.
        rule: the rule's name; ``rule_text``: what it demands (:data:`harness.ledger.RULES`).
        message: what the checker said was wrong.
        worker: the rank; ``seq``: the event's sequence number on it (None: no event found).
        kind, rid: the event's kind and request (the violation's request for a leak).
        pages: the pages the event named, ``"swa [12, 13]; full [4]"`` (``""`` when none).
        held: the pages the request held on that rank after the event, in the same form.
        t: seconds since the test's first event.
        repeats: further events of the same rule, rank and request after this first one.
        last_seq: the last of those events (None when there are none).
        follows: for a knock-on, the label of the root cause it followed from
            (:func:`harness.ledger.root_causes`); ``""`` for a root cause.
    """

    label: str
    rule: str
    rule_text: str
    message: str
    worker: str
    seq: int | None
    kind: str
    rid: str
    pages: str
    t: float
    held: str = ""
    repeats: int = 0
    last_seq: int | None = None
    follows: str = ""

    def line(self) -> str:
        """One line, such as
        ``V1 swa-over-window at decode-r0#17 decode_alloc rid=c3 pages swa [40] held swa [3, 7, 40]: …``."""
        at = f"{self.worker}#{self.seq}" if self.seq is not None else self.worker
        pages = f" pages {self.pages}" if self.pages else ""
        held = f" held {self.held}" if self.held else ""
        more = f" (+{self.repeats} more events to #{self.last_seq})" if self.repeats else ""
        more += f" (follows {self.follows})" if self.follows else ""
        return f"{self.label} {self.rule} at {at} {self.kind} rid={self.rid or '-'}{pages}{held}: {self.message}{more}"


@dataclass(frozen=True)
class RequestRow:
    """One request on one rank: first/last event, peak pages per pool, pages still held at the end."""

    rid: str
    first: float
    last: float
    events: int
    peak: Mapping[str, int]
    held: Mapping[str, int]


@dataclass(frozen=True)
class Rank:
    """The timeline of one worker (rank) during one test.

    Attributes:
        worker, component: the worker and its side (``prefill`` / ``decode``).
        t: seconds since the test's first event, one per event.
        used: pool → pages in use after each event (only pools the events name).
        events: (t, kind) of every marked event.
        marks: the violations on this rank, one per (rule, request) at the first event that broke it.
        violation_t: the time of every violating event (repeats included).
        requests: the per-request breakdown, in order of first appearance.
    """

    worker: str
    component: str
    t: tuple[float, ...]
    used: Mapping[str, tuple[int, ...]]
    events: tuple[tuple[float, str], ...]
    marks: tuple[Mark, ...] = ()
    requests: tuple[RequestRow, ...] = field(default=())
    violation_t: tuple[float, ...] = ()

    @property
    def peak(self) -> dict[str, int]:
        return {pool: max(v, default=0) for pool, v in self.used.items()}


def _count(pages: object) -> int:
    return pages if isinstance(pages, int) else len(pages)  # type: ignore[arg-type]


def _pages_text(pages_by_pool: Mapping[str, "Sequence[int] | int"], limit: int = 8) -> str:
    parts = []
    for pool, pages in sorted(pages_by_pool.items()):
        if isinstance(pages, int):
            parts.append(f"{pool} {pages} page(s)")
        elif pages:
            ids = ", ".join(str(p) for p in pages[:limit]) + (", …" if len(pages) > limit else "")
            parts.append(f"{pool} [{ids}]")
    return "; ".join(parts)


def build(events_by_worker: Mapping[str, Sequence[ledger.Event]]) -> list[Rank]:
    """The ranks' timelines of one test (pure).

    Args:
        events_by_worker: worker → the events it wrote during the test (any order; sorted by seq).

    Returns:
        One :class:`Rank` per worker with events, prefill ranks first, then by name. Violations of
        one rule by one request on one rank are one mark, at the first event that broke the rule
        (later ones are counted); marks are labelled ``V1``… across all ranks: the root causes in time
        order, each followed by its knock-ons (:func:`harness.ledger.root_causes`).
    """
    streams = {w: sorted(evs, key=lambda e: e.seq) for w, evs in events_by_worker.items() if evs}
    if not streams:
        return []
    t0 = min(e.ts for evs in streams.values() for e in evs)
    firsts: dict[tuple[str, str, str], dict] = {}
    ranks = []
    for worker in sorted(streams, key=lambda w: (streams[w][0].component != "prefill", w)):
        evs = streams[worker]
        used: dict[str, int] = defaultdict(int)
        series: dict[str, list[int]] = {}
        per_req: dict[str, dict] = {}
        held_ids: dict[str, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))  # rid → pool → ids
        held_after: dict[int, str] = {}  # seq → the request's pages after it
        ts: list[float] = []
        marked: list[tuple[float, str]] = []
        violations = ledger.check(evs)
        violating = {v.seq for v in violations}
        for ev in evs:
            if ev.kind == "config":  # the bounds the checker derives rules from: no pages, no point
                continue
            t = ev.ts - t0
            sign = 1 if ev.kind in ledger.TAKE_KINDS else -1 if ev.kind in ledger.FREE_KINDS else 0
            req = per_req.setdefault(
                ev.rid, {"first": t, "last": t, "events": 0, "held": defaultdict(int), "peak": defaultdict(int)}
            )
            req["last"], req["events"] = t, req["events"] + 1
            for pool, pages in ev.pages.items():
                n = sign * _count(pages)
                used[pool] += n
                req["held"][pool] += n
                req["peak"][pool] = max(req["peak"][pool], req["held"][pool])
                if not isinstance(pages, int) and sign:
                    ids = held_ids[ev.rid][pool]
                    (ids.update if sign > 0 else ids.difference_update)(pages)
            if ev.seq in violating:
                held_after[ev.seq] = _pages_text(
                    {p: tuple(sorted(i)) for p, i in held_ids[ev.rid].items() if i}, limit=12
                )
            for pool in set(used) | set(series):
                series.setdefault(pool, [0] * len(ts)).append(used[pool])
            ts.append(t)
            if any(ev.kind == lane[0] for lane in LANES):
                marked.append((t, ev.kind))
        by_seq = {e.seq: e for e in evs}
        last_of = {e.rid: e for e in evs}
        vts = []
        for v in violations:
            hit: ledger.Event | None = by_seq.get(v.seq) if v.seq is not None else last_of.get(v.rid, evs[-1])
            t = hit.ts - t0 if hit else ts[-1]
            vts.append(t)
            rid = v.rid or (hit.rid if hit else "")
            key = (worker, v.rule, rid)
            if key in firsts:
                firsts[key]["repeats"] += 1
                firsts[key]["last_seq"] = hit.seq if hit else v.seq
                continue
            firsts[key] = {
                "t": t,
                "worker": worker,
                "rule": v.rule,
                "rule_text": ledger.RULES.get(v.rule, ""),
                "message": v.message,
                "seq": hit.seq if hit else v.seq,
                "kind": hit.kind if hit else "-",
                "rid": rid,
                "pages": _pages_text(hit.pages) if hit else "",
                "held": held_after.get(hit.seq, "") if hit else "",
                "repeats": 0,
                "last_seq": None,
            }
        rows = tuple(
            RequestRow(rid, r["first"], r["last"], r["events"], dict(r["peak"]), dict(r["held"]))
            for rid, r in per_req.items()
        )
        order = [p for p in POOLS if p in series] + sorted(p for p in series if p not in POOLS)
        ranks.append(
            Rank(
                worker,
                evs[0].component,
                tuple(ts),
                {p: tuple(series[p]) for p in order},
                tuple(marked),
                requests=rows,
                violation_t=tuple(vts),
            )
        )
    marks: dict[str, list[Mark]] = defaultdict(list)
    for i, (f, root) in enumerate(_root_first(list(firsts.values())), 1):
        marks[f["worker"]].append(Mark(label=f"V{i}", follows=f"V{root}" if root else "", **f))
    return [replace(r, marks=tuple(marks.get(r.worker, ()))) for r in ranks]


def _root_first(firsts: list[dict]) -> list[tuple[dict, int]]:
    """The first violations of each (rank, rule, request), root causes first: ``(first, n)`` where ``n``
    is the 1-based position of the root a knock-on follows from (0 for a root)."""
    in_time = sorted(firsts, key=lambda f: (f["t"], f["worker"], f["rule"], f["rid"]))
    as_violation = {id(f): ledger.Violation(f["rule"], f["message"], f["seq"], f["worker"], f["rid"]) for f in in_time}
    back = {id(v): f for f in in_time for v in [as_violation[id(f)]]}
    causes = ledger.root_causes(as_violation.values())
    causes.sort(key=lambda c: in_time.index(back[id(c.root)]))
    out: list[tuple[dict, int]] = []
    for cause in causes:
        out.append((back[id(cause.root)], 0))
        root_at = len(out)
        out += [(back[id(k)], root_at) for k in cause.knock_ons]
    return out


def downsample(t: Sequence[float], y: Sequence[int], max_points: int = MAX_POINTS) -> tuple[list[float], list[int]]:
    """At most ``max_points`` steps of a step series, keeping the peak of each time bin (pure).

    A leak or an over-window peak is what a reader looks for, so a bin shows its highest value,
    never an average that would hide it. The last point is kept, so the end level is exact.
    """
    if len(t) <= max_points:
        return list(t), list(y)
    span = (t[-1] - t[0]) or 1.0
    bins: dict[int, tuple[float, int]] = {}
    for ti, yi in zip(t, y):
        b = min(int((ti - t[0]) / span * (max_points - 1)), max_points - 2)
        if b not in bins or yi > bins[b][1]:
            bins[b] = (ti, yi)
    pts = sorted(bins.values()) + [(t[-1], y[-1])]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot(ranks: Sequence[Rank], path: Path, title: str = "", dpi: int = 80) -> Path:
    """Draw one test's ranks into one PNG (see the module docstring).

    Args:
        ranks: from :func:`build` (not empty).
        path: where the PNG goes (its directory is created).
        title: the PNG's ``Title`` (the test's node id; the page shows it above the image).
        dpi: resolution; the width is 12 inches.

    Returns:
        ``path``.

    Raises:
        ValueError: no ranks.
    """
    if not ranks:
        raise ValueError("no ranks to plot: the test wrote no ledger events")
    import matplotlib

    matplotlib.use("Agg")  # no display, no GUI toolkit: the report is written headless
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = len(ranks)
    heights = [r for _ in ranks for r in (3, 1.5)]
    fig, axes = plt.subplots(
        2 * rows, 1, figsize=(12, 3.6 * rows + 0.6), sharex=True, gridspec_kw={"height_ratios": heights, "hspace": 0.1}
    )
    end = max((r.t[-1] for r in ranks if r.t), default=1.0) or 1.0
    for i, rank in enumerate(ranks):
        ax, strip = axes[2 * i], axes[2 * i + 1]
        for k, (pool, ys) in enumerate(rank.used.items()):
            xs, ys2 = downsample(rank.t, ys)
            # earlier pools drawn wider underneath, so equal series (full == swa) both stay visible
            ax.step(
                [0.0, *xs, end],
                [0, *ys2, ys2[-1] if ys2 else 0],
                where="post",
                lw=max(1.0, 2.4 - 0.9 * k),
                alpha=0.85,
                color=POOL_COLORS.get(pool, "#7f7f7f"),
                label=f"{pool} (peak {max(ys, default=0)})",
            )
        ax.set_ylabel("pages in use")
        ax.text(
            0.005,
            0.96,
            f"{rank.worker} ({rank.component})",
            transform=ax.transAxes,
            va="top",
            fontsize=10,
            fontweight="bold",
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1.5},
        )
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0, top=max(max(rank.peak.values(), default=0) * 1.25, 1))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        for m in rank.marks:
            ax.axvline(m.t, color="#d62728", lw=1.2, ls="--")
            ax.annotate(
                m.label,
                (m.t, 0.0),
                xycoords=("data", "axes fraction"),
                xytext=(2, 3),
                textcoords="offset points",
                color="#d62728",
                fontsize=8,
                fontweight="bold",
            )
        if rank.used:
            ax.legend(loc="upper right", fontsize=7, ncol=len(rank.used) + (1 if rank.marks else 0), framealpha=0.8)
        for lane, (kind, label, marker, color) in enumerate(LANES):
            xs = [t for t, k in rank.events if k == kind]
            if xs:
                strip.scatter(xs, [len(LANES) - lane] * len(xs), marker=marker, s=12, color=color, lw=0.8)
        if rank.violation_t:
            strip.scatter(rank.violation_t, [0] * len(rank.violation_t), marker="x", s=10, color="#d62728", lw=0.8)
        if rank.marks:
            strip.scatter([m.t for m in rank.marks], [0] * len(rank.marks), marker="X", s=50, color="#d62728")
        strip.set_yticks(range(len(LANES) + 1), ["violation", *[lane[1] for lane in reversed(LANES)]], fontsize=7)
        strip.set_ylim(-0.7, len(LANES) + 0.7)
        strip.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("seconds since the test's first ledger event")
    axes[-1].set_xlim(0, end * 1.01)
    violations = "\n".join(m.line() for r in ranks for m in r.marks)
    path.parent.mkdir(parents=True, exist_ok=True)
    # fixed margins rather than bbox_inches="tight", which draws the whole figure twice
    fig.subplots_adjust(left=0.09, right=0.99, top=1 - 0.12 / fig.get_figheight(), bottom=0.55 / fig.get_figheight())
    fig.savefig(
        path,
        format="png",
        dpi=dpi,
        metadata={"Title": title or "KV-pool timeline", PNG_VIOLATIONS_KEY: violations or "none"},
    )
    plt.close(fig)
    return path


def events_by_worker(events: Iterable[ledger.Event]) -> dict[str, list[ledger.Event]]:
    """Group events by worker (pure)."""
    out: dict[str, list[ledger.Event]] = defaultdict(list)
    for ev in events:
        out[ev.worker].append(ev)
    return dict(out)
