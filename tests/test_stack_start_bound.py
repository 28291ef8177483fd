"""A PD stack start that stalls (harness.engines.server.stack_pool): bounded by a few times the session's
normal start, replaced once, and a replacement that stalls too fails, saying where its request was."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness import topology
from harness.engines import phases
from harness.engines.server import stack as stack_mod
from harness.engines.server.stack_pool import START_FACTOR, START_FLOOR_S, StackPool
from harness.rundir import RunDir


@pytest.fixture
def pool(tmp_path):
    run = RunDir(tmp_path)
    Path(run.ledger).mkdir(parents=True, exist_ok=True)
    return StackPool(None, topology.get("cpu"), run)


def test_the_bound_is_the_deadline_first_then_a_few_normal_starts(pool):
    assert pool._start_bound() == pool.ready_timeout
    pool._starts += [40.0, 60.0, 50.0]
    assert pool._start_bound() == max(START_FLOOR_S, START_FACTOR * 50.0)
    pool._starts[:] = [500.0]
    assert pool._start_bound() == pool.ready_timeout


def test_a_stalled_start_is_replaced_once_then_fails_naming_where_its_request_was(pool, monkeypatch, tmp_path):
    starts = []

    def stalls(*args, names, ready_timeout, **kwargs):
        starts.append((names, ready_timeout))
        points_dir = phases.trace_dir(pool.run_dir.ledger)
        points_dir.mkdir(parents=True, exist_ok=True)
        mark = phases.Mark(time.time(), "decode-9", "decode.metadata", f"warmup-{len(starts)}", 3)
        (points_dir / "decode-9.jsonl").open("a").write(mark.to_json() + "\n")
        raise TimeoutError("router r: 0/2 workers registered healthy\nlog tail ...")

    monkeypatch.setattr(stack_mod, "start_pd_stack", stalls)
    pool._starts.append(45.0)
    with pytest.raises(TimeoutError) as e:
        pool._start_pd(tmp_path, None, ("p1", "d1", "r1"), lambda w: None)
    said = str(e.value)
    assert len(starts) == 2 and starts[0][0] != starts[1][0], "not replaced once under new names"
    assert starts[0][1] == starts[1][1] == START_FLOOR_S
    assert said.startswith(f"PD stack of {tmp_path.name} not ready within 180 s (normal start 45 s): router r: 0/2")
    assert "its last request warmup-2: prefill never reached it; decode decode.metadata" in said
    assert "replacement, the first start stalled too" in said
