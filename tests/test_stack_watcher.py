"""The watcher beside each real-server test (``harness.plugins.stackwatch.StackWatcher``): when the watchdog
reports a stack's worker dead, every request on the stack's surviving servers is aborted at once, so a
client blocked on the dead one returns now. Stand-in servers record what reaches their ``/abort_request``
(a real stack's death costs a restart; the fault check's runs show it on real servers: a decode killed by
sglang's own memory check while prefill waited out its 300 s bootstrap timeout)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.clock import wait_for
from harness.engines import phases
from harness.engines.server.pd_stack import PdStack
from harness.plugins.stackwatch import StackWatcher
from harness.workers import WorkerDied
from standin_http import StandInHTTP


class StandIn(StandInHTTP):
    """One server's HTTP face: records the body of each ``/abort_request``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.aborts: list[dict] = []
        super().__init__(self._posted)

    def _posted(self, path: str, body: bytes) -> None:
        if path == "/abort_request":
            self.aborts.append(json.loads(body))


class Pool:
    """What the watcher reads of a :class:`~harness.engines.server.stack_pool.StackPool`."""

    run_dir: SimpleNamespace | None = None

    def __init__(self, *stacks: PdStack) -> None:
        self._stacks = list(stacks)

    def pd_stacks(self) -> list[PdStack]:
        return list(self._stacks)


@pytest.fixture
def stack():
    servers = [StandIn(n) for n in ("prefill-3", "decode-3", "router-3")]
    yield PdStack(*servers, model="m")  # type: ignore[arg-type]
    for s in servers:
        s.close()


def test_a_dead_decode_aborts_every_request_on_prefill_and_no_other_death_does(stack):
    deaths: list[WorkerDied] = []
    watcher = StackWatcher(Pool(stack), deaths)  # type: ignore[arg-type]
    try:
        deaths.append(WorkerDied("decode-9", "exit code 1", "", None))  # another stack's worker
        deaths.append(WorkerDied("decode-3", "exit code 1", "", None))
        wait_for(lambda: stack.prefill.aborts, 30, "prefill's abort_all")
    finally:
        watcher.stop()
    assert stack.prefill.aborts == [{"rid": "", "abort_all": True}]
    assert stack.decode.aborts == []  # dead: nothing to ask it


def test_deaths_before_the_test_are_not_its_business(stack):
    deaths = [WorkerDied("decode-3", "exit code 1", "", None)]
    watcher = StackWatcher(Pool(stack), deaths)  # type: ignore[arg-type]
    try:
        deaths.append(WorkerDied("prefill-3", "exit code 1", "", None))
        wait_for(lambda: stack.decode.aborts, 30, "decode's abort_all")
    finally:
        watcher.stop()
    assert stack.prefill.aborts == []
    assert stack.decode.aborts == [{"rid": "", "abort_all": True}]


class Trace:
    """A server's phase trace file under a run's ledger directory (what the probe's points write)."""

    def __init__(self, ledger: Path) -> None:
        self.path = phases.trace_dir(ledger) / "x-1.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, *marks: phases.Mark) -> None:
        with open(self.path, "a") as f:
            f.writelines(m.to_json() + "\n" for m in marks)


def _lost_message(rid: str, room: int, t: float) -> list[phases.Mark]:
    """Decode preallocated and sent its page list; prefill wrote Bootstrapping and nothing more."""
    return [  # prefill's status write first in the file: its request is named only by decode's later marks
        phases.Mark(t + 0.01, "prefill-3", "transfer.status", "", room, "Bootstrapping", "wrote, now Bootstrapping"),
        phases.Mark(t, "decode-3", "decode.prealloc", rid, room),
        phases.Mark(t + 0.02, "decode-3", "decode.metadata", rid, room),
    ]


@pytest.fixture
def traced(stack, tmp_path):
    """The stand-in stack's pool with a run directory, and the trace its servers would write there."""
    pool = Pool(stack)
    pool.run_dir = SimpleNamespace(ledger=tmp_path / "ledger")  # type: ignore[assignment]
    return pool, Trace(pool.run_dir.ledger)


def test_a_request_without_progress_is_aborted_and_says_where_each_side_was(stack, traced):
    # Old marks (100 s ago) are past the default 60 s bound at once: the stuck request is aborted on both
    # servers and its stall names the lost message; one that reached decode's commit, and one on sglang's
    # fake bootstrap room, are left alone.
    pool, trace = traced
    watcher = StackWatcher(pool, [])  # type: ignore[arg-type]
    try:
        t = time.time() - 100
        trace.write(*_lost_message("stuck", 7, t), *_lost_message("done", 8, t))
        trace.write(phases.Mark(t + 0.5, "decode-3", "decode.commit", "done", 8))
        # sglang's warm-up and health requests share the fake bootstrap room 0 and never transfer
        trace.write(*_lost_message("HEALTH_CHECK_1", 0, t))
        wait_for(lambda: stack.decode.aborts and stack.prefill.aborts, 30, "the stuck request's aborts")
    finally:
        watcher.stop()
    assert stack.decode.aborts == stack.prefill.aborts == [{"rid": "stuck"}]
    [stall] = watcher.stalls
    assert stall.rid == "stuck" and stall.idle_s >= 60
    assert "a lost message: decode sent its page list at +0.02 s" in stall.line()
    assert stall.line().startswith("stall: request stuck: prefill never reached it; decode decode.metadata")


def test_no_request_is_a_stall_while_a_hold_is_set(stack, traced):
    pool, trace = traced
    hold = phases.Hold(pool.run_dir.ledger, "prefill.send", "other")
    watcher = StackWatcher(pool, [])  # type: ignore[arg-type]
    try:
        trace.write(*_lost_message("stuck", 7, time.time() - 100))
        after = watcher.rounds + 3  # whole rounds that read the marks, in which an abort would have gone
        wait_for(lambda: watcher.rounds >= after, 30, "three watcher rounds")
        assert stack.decode.aborts == [] and watcher.stalls == []
        hold.release()
        wait_for(lambda: stack.decode.aborts, 30, "the abort once the hold is gone")
    finally:
        watcher.stop()


def test_an_earlier_tests_request_whose_last_marks_come_late_is_not_a_stall(stack, traced):
    # A loaded run: the previous test's deferred release ended by timeout, and prefill's drain ack reached
    # decode only after this test began. Its request was never preallocated here: not this test's stall.
    pool, trace = traced
    watcher = StackWatcher(pool, [])  # type: ignore[arg-type]
    try:
        t = time.time() - 100
        trace.write(phases.Mark(t, "decode-3", "transfer.ack", "earlier", 5, note="prefill rank 0"))
        trace.write(*_lost_message("stuck", 7, t))
        wait_for(lambda: stack.decode.aborts, 30, "the stuck request's abort")
    finally:
        watcher.stop()
    assert [s.rid for s in watcher.stalls] == ["stuck"]
    assert stack.decode.aborts == [{"rid": "stuck"}]
