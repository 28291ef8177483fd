"""A decode worker killed in the middle of a PD run fails the run within 2 s with its log tail."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from harness import topology
from harness.engines.sim import deploy
from harness.engines.sim.driver import run
from harness.engines.sim.workload import KVSpec, PDRequest
from harness.workers import WorkerDied

pytestmark = [pytest.mark.est_time(120), pytest.mark.timeout(600)]

SPEC = KVSpec(kind="swa", page_size=64, window=100, full_tokens=32 * 64, swa_tokens=12 * 64, req_slots=8)


def test_decode_worker_killed_mid_run_fails_within_2s_with_log_tail(ray_cluster, run_dir):
    dep = deploy.start(
        ray_cluster, topology.get("cpu"), run_dir.root, SPEC, name_prefix="kill-test-", call_timeout=60.0
    )
    try:
        decode = dep.pair.decode.members[0]
        killed: dict[str, float] = {}
        started = threading.Event()

        def kill_when_running() -> None:
            started.wait(60)
            time.sleep(0.5)  # well inside the run: requests are decoding and transferring
            os.kill(decode.info.pid, signal.SIGKILL)
            killed["at"] = time.monotonic()

        reqs = [PDRequest(f"k{i}", 200 + i, decode_steps=400) for i in range(40)]
        killer = threading.Thread(target=kill_when_running, daemon=True)
        killer.start()
        started.set()
        with pytest.raises(WorkerDied) as info:
            run(dep.pair, reqs)
        noticed = time.monotonic() - killed["at"]
        killer.join(5)
        err = info.value
        assert err.name == decode.name
        assert f"[harness] worker {decode.name}" in err.tail, err.tail
        assert noticed <= 2.0, f"the run noticed the dead decode worker only after {noticed:.1f} s"
    finally:
        dep.stop()
