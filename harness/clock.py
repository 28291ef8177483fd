"""The harness's only clock: every bounded wait goes through it, so tests can drive waits without sleeping.

``Clock`` reads ``time.monotonic`` and sleeps for real; ``FakeClock`` (for tests) advances only when
``sleep`` is called, like pytest's ``MockTiming``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")


class Clock:
    """Real time: ``now()`` is ``time.monotonic()``, ``sleep`` sleeps."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


@dataclass
class FakeClock(Clock):
    """Time that moves only when someone sleeps (tests)."""

    t: float = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)


DEFAULT = Clock()


class Deadline:
    """A point ``timeout`` seconds from now: for bounded loops that do more than poll one condition."""

    def __init__(self, timeout: float, clock: Clock = DEFAULT) -> None:
        self.clock = clock
        self.at = clock.now() + timeout

    def left(self) -> float:
        """Seconds until the deadline, never below 0."""
        return max(0.0, self.at - self.clock.now())

    def expired(self) -> bool:
        return self.clock.now() >= self.at

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, but not past the deadline."""
        self.clock.sleep(min(seconds, self.left()))


def wait_for(
    condition: Callable[[], T], timeout: float, what: str, *, interval: float = 0.1, clock: Clock = DEFAULT
) -> T:
    """Call ``condition`` until it returns something truthy; return that.

    ``condition`` may raise to abort the wait (a liveness check fails fast that way).

    Args:
        condition: polled at least once, then every ``interval`` seconds.
        timeout: the budget in seconds.
        what: what is awaited, for the error message.
        interval: seconds between polls.
        clock: the clock (a :class:`FakeClock` in tests).

    Returns:
        The first truthy value of ``condition()``.

    Raises:
        TimeoutError: ``condition`` stayed falsy for ``timeout`` seconds.
    """
    deadline = clock.now() + timeout
    while True:
        value = condition()
        if value:
            return value
        left = deadline - clock.now()
        if left <= 0:
            raise TimeoutError(f"{what}: not ready after {timeout:g} s")
        clock.sleep(min(interval, left))
