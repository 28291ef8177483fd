"""Per-request totals of a ledger: what each request took and returned, per pool."""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Mapping

from harness.ledger.check import check
from harness.ledger.events import CACHE_OWNER, FREE_KINDS, TAKE_KINDS, Event


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
        w = workers.setdefault(
            ev.worker,
            {
                "component": ev.component,
                "kinds": Counter(),
                "rids": set(),
                "pages_taken": Counter(),
                "pages_freed": Counter(),
            },
        )
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
            name: {
                "component": w["component"],
                "kinds": dict(w["kinds"]),
                "requests": len(w["rids"]),
                "pages_taken": dict(w["pages_taken"]),
                "pages_freed": dict(w["pages_freed"]),
            }
            for name, w in sorted(workers.items())
        },
    }


def format_summary(summary: Mapping[str, Any]) -> str:
    """Render :func:`summarise` output as a few markdown lines for a test report."""
    lines = [
        f"ledger: {summary['events']} events, {summary['requests']} requests, {len(summary['violations'])} violation(s)"
    ]
    for name, w in summary["workers"].items():
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(w["kinds"].items()))
        taken = ", ".join(f"{p} {n}" for p, n in sorted(w["pages_taken"].items()))
        freed = ", ".join(f"{p} {n}" for p, n in sorted(w["pages_freed"].items()))
        lines.append(f"- {name} ({w['component']}): {kinds}; pages taken [{taken}] freed [{freed}]")
    lines.extend(f"  ! {v}" for v in summary["violations"][:20])
    return "\n".join(lines)
