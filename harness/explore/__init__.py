"""``harness explore``: Hypothesis stateful schedules over the simulated engine's real sglang objects, in process.

:mod:`.pair` is one prefill and one decode rank driven operation by operation (the invariants after each step
and at the end), :mod:`.machine` the state machine that draws the schedules, shrinks a failing one and
replays a repro file, :mod:`.inject` applies a catalog fault to this process before sglang is imported,
:mod:`.explore_report` writes the run's report. User's guide: docs/explore.md.
"""
