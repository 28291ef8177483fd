"""Bounded waits through the clock seam, without sleeping."""

from __future__ import annotations

import pytest

from harness.clock import Deadline, FakeClock, wait_for


def test_wait_for_returns_the_first_truthy_value():
    clock = FakeClock()
    values = iter([None, 0, "ready"])
    assert wait_for(lambda: next(values), 10, "x", interval=1, clock=clock) == "ready"
    assert clock.now() == 2


def test_wait_for_times_out_at_the_deadline():
    clock = FakeClock()
    with pytest.raises(TimeoutError, match="^server: not ready after 5 s$"):
        wait_for(lambda: False, 5, "server", interval=2, clock=clock)
    assert clock.now() == 5


def test_a_condition_that_raises_aborts_the_wait():
    clock = FakeClock()

    def dead():
        raise RuntimeError("worker died")

    with pytest.raises(RuntimeError, match="worker died"):
        wait_for(dead, 100, "x", clock=clock)
    assert clock.now() == 0


def test_a_deadline_counts_down_and_sleeps_no_further():
    clock = FakeClock(t=10)
    deadline = Deadline(3, clock=clock)
    assert deadline.left() == 3 and not deadline.expired()
    deadline.sleep(2)
    assert deadline.left() == 1 and not deadline.expired()
    deadline.sleep(2)
    assert clock.now() == 13 and deadline.left() == 0 and deadline.expired()
