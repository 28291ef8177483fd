"""Schedules of ``harness explore --engine sglang-server`` (harness.explore.server_schedules): a seed is
the same schedule on any machine, and every held phase is one the real servers pass."""

from __future__ import annotations

from harness.engines import phases
from harness.explore.server_schedules import HOLDABLE, draw


def test_a_seed_is_one_schedule():
    assert draw(7) == draw(7) and draw(7) != draw(8)
    assert [e.line() for e in draw(3, episodes=2)] == [e.line() for e in draw(3, episodes=2)]


def test_every_drawn_hold_is_a_named_phase_and_both_actions_are_drawn():
    eps = [e for seed in range(40) for e in draw(seed)]
    assert {e.phase for e in eps} == {p for p, _ in HOLDABLE} <= set(phases.PHASES)
    assert {e.abort for e in eps} == {True, False}
    assert all(70 <= e.held_len < 300 and len(e.free) <= 2 for e in eps)
