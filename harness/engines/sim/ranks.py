"""A role's TP ranks as one callable group: the same method on every rank, in parallel.

Members are either payload objects in this process (tests without Ray) or started harness workers
(:class:`harness.workers.Worker`, one Ray actor per rank). Calls on workers run concurrently on all
ranks and always wait with a timeout; a dead worker surfaces as :class:`harness.workers.WorkerDied`
with its log tail.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

logger = logging.getLogger(__name__)


class Ranks:
    """The ranks of one role.

    Args:
        members: payload objects (local) or :class:`harness.workers.Worker` handles (Ray), rank order.
        timeout: seconds any one call may take.
    """

    def __init__(self, members: Sequence[Any], timeout: float = 120.0):
        from harness.workers import Worker

        if not members:
            raise ValueError("a role needs at least one rank")
        self.members = list(members)
        self.remote = isinstance(self.members[0], Worker)
        self.timeout = timeout

    def __len__(self) -> int:
        return len(self.members)

    def submit(self, rank: int, method: str, *args: Any) -> Any:
        """Start ``method(*args)`` on one rank: a Ray ObjectRef (remote) or the result itself (local)."""
        m = self.members[rank]
        if self.remote:
            return m.actor.call.remote(method, args, {})
        return getattr(m, method)(*args)

    def get(self, handles: list[Any], ranks: list[int] | None = None) -> list[Any]:
        """Results of :meth:`submit` handles, in order (local results pass through).

        Raises:
            WorkerDied: a rank's worker died.
            TimeoutError: no answer within the timeout (and no worker dead).
        """
        if not self.remote:
            return list(handles)
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        from harness.workers import payload_error

        try:
            return ray.get(list(handles), timeout=self.timeout)
        except RayTaskError as exc:
            raise payload_error(exc) from None
        except (RayActorError, GetTimeoutError) as exc:
            for r in ranks if ranks is not None else range(len(self.members)):
                self.members[r].check()  # raises WorkerDied with the log tail
            if isinstance(exc, GetTimeoutError):
                raise TimeoutError(f"no answer within {self.timeout:g} s from {self.names()}") from None
            raise

    def all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every rank and return the results in rank order."""
        return self.get([self.submit(r, method, *args) for r in range(len(self.members))])

    def check(self) -> None:
        """Raise :class:`WorkerDied` if any rank's worker is dead (no-op for local members)."""
        if self.remote:
            for m in self.members:
                m.check()

    def names(self) -> list[str]:
        return [getattr(m, "name", type(m).__name__) for m in self.members]
