"""A soak: many requests through one PD pair, the pools back at their baseline exactly at every checkpoint.

The requests go in batches of ``every`` (:func:`soak`): each batch is a seeded
:func:`~harness.pd.spec.workload` (prompt lengths at page boundaries ±1 and uniform, aborts mid-transfer)
whose requests share their prompt in a few prefix groups (radix hits when the pair's spec has the radix
cache on), run by :func:`harness.pd.run.run` — every KV byte verified, the ledger of the batch checked, the
radix cache drained at its end. After each batch, once nothing is in flight, the checkpoint reads every
decode rank's free size per pool against its baseline and what prefill still holds: the leak. A leak
is not a tolerance: every checkpoint must read zero, so the slope of the leak over the requests is
exactly zero (:attr:`SoakResult.slope`, slots per 1,000 requests, for the benchmark's report).

The first batch that breaks a rule ends the soak (its failure carries the ledger's violations); the
result says how far it got.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from harness.pd.errors import PDError
from harness.pd.run import PDPair, RunResult, run
from harness.pd.spec import workload

#: Prefix groups per batch: about a third of a batch's requests share one of them.
GROUPS = 3
#: Fraction of requests aborted mid-transfer.
ABORT_RATE = 0.1


@dataclass(frozen=True)
class Checkpoint:
    """The pools after ``requests`` requests, nothing in flight.

    Attributes:
        requests: requests run so far.
        leak: per pool, the slots not back at baseline summed over the decode ranks, and ``live``, the
            requests a decode rank still holds (0: balanced).
        held: requests prefill still holds.
    """

    requests: int
    leak: dict[str, int]
    held: int

    @property
    def total(self) -> int:
        """All slots and requests not back at baseline."""
        return sum(self.leak.values()) + self.held


@dataclass
class SoakResult:
    """What :func:`soak` ran and what every checkpoint read."""

    requests: int = 0
    completed: int = 0
    aborted: int = 0
    prefix_hits: int = 0
    wall_s: float = 0.0
    checkpoints: list[Checkpoint] = field(default_factory=list)
    failed: RunResult | None = None

    @property
    def requests_per_s(self) -> float:
        """Requests (completed and aborted) per second of wall time."""
        return (self.completed + self.aborted) / self.wall_s if self.wall_s else 0.0

    @property
    def slope(self) -> float:
        """Least-squares slope of the leak over the requests, in slots per 1,000 requests."""
        points = [(c.requests, c.total) for c in self.checkpoints]
        if len(points) < 2:
            return 0.0
        n = len(points)
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        var = sum((x - mx) ** 2 for x, _ in points)
        return 1000.0 * sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0

    def assert_clean(self) -> None:
        """Raise :class:`PDError` if a batch broke a rule or a checkpoint read a leak."""
        if self.failed is not None:
            self.failed.assert_clean()
        leaks = [c for c in self.checkpoints if c.total]
        if leaks:
            first = leaks[0]
            raise PDError(f"leak after {first.requests} requests: {first.leak} slot(s) not back at baseline, prefill "
                          f"holds {first.held} (slope {self.slope:.3f} slots per 1,000 requests over "
                          f"{len(self.checkpoints)} checkpoints)")

    def summary(self) -> dict[str, Any]:
        """JSON-able figures."""
        return {"requests": self.requests, "completed": self.completed, "aborted": self.aborted,
                "prefix_hits": self.prefix_hits, "wall_s": round(self.wall_s, 2),
                "requests_per_s": round(self.requests_per_s, 1), "checkpoints": len(self.checkpoints),
                "max_leak": max((c.total for c in self.checkpoints), default=0), "slope": self.slope}


def _leak(pair: PDPair) -> tuple[dict[str, int], int]:
    leak: dict[str, int] = {"live": 0}
    for state in pair.decode.all("idle"):
        for pool, size in state["baseline"].items():
            leak[pool] = leak.get(pool, 0) + size - state["free"].get(pool, 0)
        leak["live"] += len(state["live"])
    return leak, sum(len(held) for held in pair.prefill.all("held"))


def soak(pair: PDPair, n: int, *, every: int = 50, seed: int = 0, max_prompt: int | None = None,
         chunk_pages: int = 4) -> SoakResult:
    """Run ``n`` requests through ``pair`` in batches of ``every``, a checkpoint after each.

    Args:
        pair: a configured :class:`~harness.pd.run.PDPair` (its spec decides the pools, the page size,
            whether the radix cache is on).
        n: requests in all.
        every: requests per batch (and so between checkpoints).
        seed: the workload's seed (batch ``b`` uses ``seed + b``).
        max_prompt: longest prompt (default: four windows, or 8 pages without a window).
        chunk_pages: pages per transfer chunk (1 makes aborts land mid-request).

    Returns:
        The :class:`SoakResult`; ``failed`` is the batch that broke a rule, if one did.

    Raises:
        ValueError: ``n`` or ``every`` below 1.
        PDError / KVCorruption / WindowLost / PreallocError / WorkerDied: as :func:`~harness.pd.run.run`.
    """
    if n < 1 or every < 1:
        raise ValueError(f"a soak needs n >= 1 and every >= 1 (got n={n}, every={every})")
    spec = pair.spec
    page = spec.page_size
    longest = max_prompt or (4 * spec.window if spec.window else 8 * page)
    result = SoakResult()
    t0 = time.perf_counter()
    for batch, start in enumerate(range(0, n, every)):
        size = min(every, n - start)
        reqs = workload(seed + batch, size, page_size=page, max_prompt=longest, abort_rate=ABORT_RATE,
                        prefix=f"s{batch}-")
        groups = {r.rid: f"s{batch}-g{i % GROUPS}" for i, r in enumerate(reqs) if i % 3 == 0}
        res = run(pair, reqs, chunk_pages=chunk_pages, groups=groups)
        result.requests += size
        result.completed += len(res.completed)
        result.aborted += len(res.aborted)
        result.prefix_hits += sum(1 for e in res.events
                                  if e.component == "decode" and e.kind == "prealloc" and e.note and e.note != "prefix 0")
        if res.problems or res.violations:
            result.failed = res
            break
        leak, held = _leak(pair)
        result.checkpoints.append(Checkpoint(result.requests, leak, held))
    result.wall_s = time.perf_counter() - t0
    return result
