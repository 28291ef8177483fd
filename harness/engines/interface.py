"""What both engines share: :class:`Engine` (one PD pair that runs a batch of requests and reads its pools
against their baseline) and the types it speaks: :class:`SoakRequest`, :class:`BatchOutcome`,
:class:`Checkpoint`, and :class:`LeakError`, the verdict of a checkpoint that read a leak.

The engines: the simulated PD engine over Ray (:class:`harness.engines.sim.sim_soak.PairEngine`) and a real
sglang PD stack (:class:`harness.engines.server.server_soak.StackEngine`); :func:`harness.engines.soak_driver.drive`
runs either. It imports nothing of the harness (the ground of the engines).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

__all__ = ["BatchOutcome", "Checkpoint", "Engine", "LeakError", "SoakRequest"]


class LeakError(AssertionError):
    """A soak checkpoint found a pool not back at its baseline, or an engine's check failed."""


@dataclass(frozen=True)
class SoakRequest:
    """One request of a soak.

    Attributes:
        rid: request id (unique in the soak).
        length: prompt tokens.
        new_tokens: tokens to generate (decode steps).
        abort: the engine aborts it (the simulated engine mid-transfer; a real stack wherever it is).
        group: its prefix group (requests of a group share their prompt), or None.
    """

    rid: str
    length: int
    new_tokens: int
    abort: bool = False
    group: str | None = None


@dataclass(frozen=True)
class Checkpoint:
    """The pools after ``requests`` requests, nothing in flight.

    Attributes:
        requests: requests run so far.
        leak: per pool (an engine may name its pools by side: ``decode.swa``), the slots not back at
            baseline; ``live``, requests a side still holds (0: balanced).
        held: requests still held (prefill's, or not yet released anywhere).
        problem: what an engine's own check of the checkpoint found (a real server's ledger), or None.
    """

    requests: int
    leak: dict[str, int]
    held: int = 0
    problem: str | None = None

    @property
    def total(self) -> int:
        """All slots and requests not back at baseline."""
        return sum(abs(v) for v in self.leak.values()) + self.held


@dataclass(frozen=True)
class BatchOutcome:
    """What an engine ran of one batch.

    Attributes:
        completed: requests that finished.
        aborted: requests that ended aborted.
        prefix_hits: requests that reused a cached prefix.
        failure: what broke a rule while the batch ran (ends the soak), or None.
    """

    completed: int
    aborted: int
    prefix_hits: int = 0
    failure: BaseException | None = None


class Engine(Protocol):
    """What runs a soak's requests: one PD pair of some engine."""

    def run_batch(self, requests: Sequence[SoakRequest]) -> BatchOutcome:
        """Run the batch to its end (every request finished or aborted)."""
        ...

    def checkpoint(self, requests: int) -> Checkpoint:
        """Once nothing is in flight: every pool against its baseline, after ``requests`` requests."""
        ...
