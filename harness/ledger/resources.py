"""The resources besides KV pages that the PD path takes per request, as the ledger names them: each is read
from sglang's objects into an event's ``free_before`` / ``free_after`` beside the pools, with its idle value
in ``baseline``. The rules ``not-baseline`` and ``reset-leak`` word their finding with :func:`describe`, and
the report shows each worker's baselines (:func:`baselines`). Pure: nothing of sglang is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from harness.ledger.events import Event


@dataclass(frozen=True)
class Resource:
    """One resource: its ledger name, the sglang state it is read from, and whether the number read counts
    what is ``free`` (a slot pool: its baseline is the capacity) or what is ``held`` (baseline 0)."""

    name: str
    source: str
    counts: str  # "free" or "held"


#: Every resource, by ledger name.
RESOURCES: dict[str, Resource] = {
    r.name: r
    for r in (
        Resource("req_slots", "request rows (ReqToTokenPool.free_slots)", "free"),
        Resource("metadata_slots", "metadata-buffer slots (ReqToMetadataIdxAllocator.free_slots)", "free"),
        Resource("tree_locked", "tokens the radix tree holds under a lock reference (protected_size)", "held"),
        Resource("kv_request_status", "rooms with a transfer status in the KV manager (request_status)", "held"),
        Resource("kv_transfer_infos", "rooms prefill's KV manager keeps decode's transfer info for", "held"),
        Resource(
            "kv_bootstrap_rooms", "rooms decode's KV manager tracks per prefill (addr_to_rooms_tracker …)", "held"
        ),
        Resource("host", "hisparse host-pool slots (mem_pool_host)", "free"),
    )
}


def describe(name: str) -> str:
    """How a finding names a pool or resource: ``resource 'metadata_slots' (metadata-buffer slots …)``.

    >>> describe("full")
    "pool 'full'"
    """
    r = RESOURCES.get(name)
    return f"resource {name!r} ({r.source})" if r else f"pool {name!r}"


def not_baseline(name: str, now: int, base: int) -> str:
    """The ``not-baseline`` sentence for ``name`` read as ``now`` on an idle worker, ``base`` its baseline.

    >>> not_baseline("tree_locked", 3, 0)[:60]
    "worker idle but resource 'tree_locked' (tokens the radix tre"
    """
    r = RESOURCES.get(name)
    counts = r.counts if r else "free"
    return f"worker idle but {describe(name)} has {now} {counts}, baseline {base}"


def reset_leak(name: str, before: int, after: int) -> str:
    """The ``reset-leak`` sentence: the flush moved ``name`` from ``before`` to ``after`` (a slot pool's
    free-or-cached count before it, free after; a held count before and after)."""
    r = RESOURCES.get(name)
    if r is not None and r.counts == "held":
        return (
            f"{describe(name)}: {before} held on an idle server before the flush, {after} after it "
            "(held by no live request)"
        )
    return (
        f"{describe(name)}: {after - before} slot(s) neither free nor cached before the "
        f"flush ({before} free or cached, {after} free after it)"
    )


@dataclass(frozen=True)
class BaselineRow:
    """One resource of one worker: its baseline, and the value the worker's last event carrying it read."""

    worker: str
    resource: str
    counts: str
    baseline: int | None
    last: int
    last_seq: int
    last_kind: str

    @property
    def at_baseline(self) -> bool:
        return self.baseline is None or self.last == self.baseline


def baselines(events: Iterable[Event]) -> list[BaselineRow]:
    """Per worker and resource of :data:`RESOURCES`: the baseline its events state (a ``baseline`` field,
    else a config's ``free_after``) and what its last event carrying it read (``free_after``).

    >>> ev = Event(1, 0.0, "reset", "<flush>", "decode", "d0", 1, free_after={"metadata_slots": 3},
    ...            baseline={"metadata_slots": 4})
    >>> [(r.resource, r.baseline, r.last, r.at_baseline) for r in baselines([ev])]
    [('metadata_slots', 4, 3, False)]
    """
    base: dict[tuple[str, str], int] = {}
    last: dict[tuple[str, str], Event] = {}
    for ev in sorted(events, key=lambda e: (e.worker, e.seq)):
        stated = {**(ev.free_after if ev.kind == "config" else {}), **ev.baseline}
        for name, value in stated.items():
            if name in RESOURCES:
                base[(ev.worker, name)] = int(value)
        for name in ev.free_after:
            if name in RESOURCES and ev.kind != "config":
                last[(ev.worker, name)] = ev
    return [
        BaselineRow(
            worker,
            name,
            RESOURCES[name].counts,
            base.get((worker, name)),
            int(ev.free_after[name]),
            ev.seq,
            ev.kind,
        )
        for (worker, name), ev in sorted(last.items())
    ]
