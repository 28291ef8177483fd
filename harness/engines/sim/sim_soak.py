"""A soak of the simulated PD engine: many requests through one PD pair, the pools back at their baseline
exactly at every checkpoint.

The soak itself is :mod:`harness.engines.soak_driver`; this is its simulated engine (:class:`PairEngine`): each
batch runs through :func:`harness.engines.sim.driver.run`, and each checkpoint reads every decode rank's free
sizes against its baseline. Detail: docs/modules.md.
"""

from __future__ import annotations

from typing import Sequence

from harness.engines.interface import BatchOutcome, Checkpoint, SoakRequest
from harness.engines.sim.errors import PDError
from harness.engines.sim.driver import PDPair, run
from harness.engines.sim.workload import PDRequest
from harness.engines.soak_driver import SoakResult, drive

__all__ = ["PairEngine", "soak"]


class PairEngine:
    """A simulated :class:`~harness.engines.sim.driver.PDPair` as a :class:`harness.engines.interface.Engine`."""

    def __init__(self, pair: PDPair, chunk_pages: int = 4) -> None:
        self.pair = pair
        self.chunk_pages = chunk_pages

    def run_batch(self, requests: Sequence[SoakRequest]) -> BatchOutcome:
        reqs = [PDRequest(r.rid, r.length, r.new_tokens, 1 if r.abort else None) for r in requests]
        groups = {r.rid: r.group for r in requests if r.group}
        res = run(self.pair, reqs, chunk_pages=self.chunk_pages, groups=groups)
        hits = sum(
            1
            for e in res.events
            if e.component == "decode" and e.kind == "prealloc" and e.note and e.note != "prefix 0"
        )
        failure = None
        try:
            res.assert_clean()
        except PDError as e:
            failure = e
        return BatchOutcome(len(res.completed), len(res.aborted), hits, failure)

    def checkpoint(self, requests: int) -> Checkpoint:
        leak: dict[str, int] = {"live": 0}
        for state in self.pair.decode.all("idle"):
            for pool, size in state["baseline"].items():
                leak[pool] = leak.get(pool, 0) + size - state["free"].get(pool, 0)
            leak["live"] += len(state["live"])
        return Checkpoint(requests, leak, sum(len(held) for held in self.pair.prefill.all("held")))


def soak(
    pair: PDPair, n: int, *, every: int = 50, seed: int = 0, max_prompt: int | None = None, chunk_pages: int = 4
) -> SoakResult:
    """Run ``n`` requests through ``pair`` in batches of ``every``, a checkpoint after each
    (:func:`harness.engines.soak_driver.drive` over a :class:`PairEngine`).

    Args:
        pair: a configured :class:`~harness.engines.sim.driver.PDPair` (its spec decides the pools, the page size,
            whether the radix cache is on).
        n: requests in all.
        every: requests per batch (and so between checkpoints).
        seed: the mix's seed (batch ``b`` uses ``seed + b``).
        max_prompt: longest prompt (default: four windows, or 8 pages without a window).
        chunk_pages: pages per transfer chunk (1 makes aborts land mid-request).

    Returns:
        The :class:`~harness.engines.soak_driver.SoakResult`; ``failure`` is the batch's :class:`PDError`, if one
        broke a rule.

    Raises:
        ValueError: ``n`` or ``every`` below 1.
        KVCorruption / WindowLost / PreallocError / WorkerDied: as :func:`~harness.engines.sim.driver.run`.
    """
    spec = pair.spec
    longest = max_prompt or (4 * spec.window if spec.window else 8 * spec.page_size)
    return drive(PairEngine(pair, chunk_pages), n, every=every, seed=seed, page_size=spec.page_size, max_prompt=longest)
