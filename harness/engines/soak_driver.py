"""The engine-independent half of a soak: the request mix, the batches, the checkpoints and the verdict.

:func:`drive` pushes requests through one PD pair in batches (:func:`mix`: the same requests for the same seed
on every engine); after each batch the engine reads every pool against its baseline. A leak is not a
tolerance: every checkpoint must read zero, so the slope (:attr:`SoakResult.slope`) is exactly zero. It imports
only :mod:`harness.engines.interface`, which both engines implement. Detail: docs/modules.md.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from typing import Any

from harness.engines.interface import Checkpoint, Engine, LeakError, SoakRequest

#: Prefix groups per batch: every third request shares its prompt with the others of its group. One:
#: on hybrid-SWA pools a radix hit needs the prefix's window still cached, and spread over more groups
#: a batch of the simulated soak (decode's radix cache) can draw none.
GROUPS = 1
#: Fraction of requests aborted.
ABORT_RATE = 0.1


def mix(
    seed: int,
    n: int,
    *,
    page_size: int,
    max_prompt: int,
    max_new: int = 8,
    abort_rate: float = 0.0,
    prefix: str = "r",
    groups: int = 0,
) -> list[SoakRequest]:
    """A seeded request mix: prompt lengths mostly at page boundaries (±1), some uniform, a few aborts.

    Args:
        seed: the random seed (same seed, same requests).
        n: number of requests.
        page_size: the page size the boundaries are placed at.
        max_prompt: longest prompt.
        max_new: most new tokens per request (each draws 1..max_new).
        abort_rate: fraction of requests to abort.
        prefix: request-id prefix (``<prefix><i>``).
        groups: prefix groups (``<prefix>g<k>``): every third request joins one in turn; 0: none.

    Returns:
        The requests, in arrival order.

    Raises:
        ValueError: ``max_prompt`` shorter than a page.
    """
    if max_prompt < page_size:
        raise ValueError(f"max_prompt {max_prompt} must be at least one page ({page_size})")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if rng.random() < 0.7:
            pages = rng.randint(1, max_prompt // page_size)
            length = pages * page_size + rng.choice((-1, 0, 1))
        else:
            length = rng.randint(1, max_prompt)
        length = max(1, min(length, max_prompt))
        abort = rng.random() < abort_rate
        group = f"{prefix}g{(i // 3) % groups}" if groups and i % 3 == 0 else None
        out.append(SoakRequest(f"{prefix}{i}", length, rng.randint(1, max_new), abort, group))
    return out


@dataclass
class SoakResult:
    """What :func:`drive` ran and what every checkpoint read."""

    requests: int = 0
    completed: int = 0
    aborted: int = 0
    prefix_hits: int = 0
    wall_s: float = 0.0
    checkpoints: list[Checkpoint] = field(default_factory=list)
    failure: BaseException | None = None

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

    @property
    def max_leak(self) -> int:
        return max((c.total for c in self.checkpoints), default=0)

    def assert_clean(self) -> None:
        """Raise the batch's failure, or :class:`LeakError` naming the first checkpoint that read a leak
        or whose check failed."""
        if self.failure is not None:
            raise self.failure
        bad = [(i, c) for i, c in enumerate(self.checkpoints, 1) if c.total or c.problem]
        if bad:
            i, first = bad[0]
            leak = {k: v for k, v in first.leak.items() if v}
            raise LeakError(
                f"leak after {first.requests} requests (checkpoint {i} of {len(self.checkpoints)}): "
                + (f"{leak} slot(s) not back at baseline" if leak else "every pool back at baseline")
                + f", {first.held} request(s) still held"
                + (f"; {first.problem}" if first.problem else "")
                + f" (slope {self.slope:.3f} slots per 1,000 requests)"
            )

    def summary(self) -> dict[str, Any]:
        """JSON-able figures."""
        return {
            "requests": self.requests,
            "completed": self.completed,
            "aborted": self.aborted,
            "prefix_hits": self.prefix_hits,
            "wall_s": round(self.wall_s, 2),
            "requests_per_s": round(self.requests_per_s, 1),
            "checkpoints": len(self.checkpoints),
            "max_leak": self.max_leak,
            "slope": self.slope,
        }


def drive(
    engine: Engine,
    n: int,
    *,
    every: int,
    seed: int,
    page_size: int,
    max_prompt: int,
    max_new: int = 8,
    abort_rate: float = ABORT_RATE,
) -> SoakResult:
    """Run ``n`` requests through ``engine`` in batches of ``every``, a checkpoint after each.

    Batch ``b`` is :func:`mix` with seed ``seed + b`` and request ids ``s<b>-<i>`` (its last request
    aborted if the mix drew no abort).

    Returns:
        The :class:`SoakResult`; ``failure`` is what broke a rule in a batch, if one did; a checkpoint
        that read a leak ends the soak too (:meth:`SoakResult.assert_clean` names it).

    Raises:
        ValueError: ``n`` or ``every`` below 1.
    """
    if n < 1 or every < 1:
        raise ValueError(f"a soak needs n >= 1 and every >= 1 (got n={n}, every={every})")
    result = SoakResult()
    t0 = time.perf_counter()
    try:
        for batch, start in enumerate(range(0, n, every)):
            size = min(every, n - start)
            reqs = mix(
                seed + batch,
                size,
                page_size=page_size,
                max_prompt=max_prompt,
                max_new=max_new,
                abort_rate=abort_rate,
                prefix=f"s{batch}-",
                groups=GROUPS,
            )
            if abort_rate and not any(r.abort for r in reqs):
                # A few dozen requests may draw no abort (0.9**50: 0.5%): the batch's longest is marked, the
                # one most likely to be stopped mid-transfer (the simulated engine stops a transfer after its
                # first chunk, so a one-chunk prompt completes; the result counts only real aborts).
                longest = max(range(size), key=lambda i: reqs[i].length)
                reqs[longest] = replace(reqs[longest], abort=True)
            out = engine.run_batch(reqs)
            result.requests += size
            result.completed += out.completed
            result.aborted += out.aborted
            result.prefix_hits += out.prefix_hits
            if out.failure is not None:
                result.failure = out.failure
                break
            point = engine.checkpoint(result.requests)
            result.checkpoints.append(point)
            if point.total or point.problem:
                break
    finally:
        result.wall_s = time.perf_counter() - t0
    return result
