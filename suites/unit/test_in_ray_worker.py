"""The unit suites again, inside a Ray decode worker of the 2-GPU topology (simulated on a CPU
machine): the same builders, on the device the worker was given (``cuda:0`` on a real GPU worker,
``cpu`` behind a Ray logical GPU)."""

from __future__ import annotations

import pytest
import torch

from harness.api import InProcess, SuiteRunner

pytestmark = [pytest.mark.topology("2-gpu-h100"), pytest.mark.est_time(150), pytest.mark.timeout(900)]

SUITES = [
    "suites/unit/mem_cache/test_hisparse_allocator.py",
    "suites/unit/disaggregation/test_swa_prealloc_accounting.py",
]


def test_unit_suites_pass_inside_a_decode_worker(pd_workers):
    worker = pd_workers("decode", InProcess(SuiteRunner))

    result = worker.call("run", SUITES, timeout=800)

    assert len(result.gpu_ids) == 1 and result.gpu_ids == worker.gpu_ids
    assert result.cuda_visible_devices == str(result.gpu_ids[0])
    assert result.pid == worker.info.pid, "the suites must run in the worker's own process"
    # Local Ray: the worker is on this machine, so it sees CUDA exactly when this process does
    # (real GPUs), and a simulated topology's logical GPUs leave it on the CPU.
    assert result.device == ("cuda:0" if torch.cuda.is_available() else "cpu")
    ran = {test.split("::")[0] for test in result.outcomes}
    assert ran == set(SUITES), f"expected both suites to run in the worker, ran {sorted(ran)}"
    # strict xfails (known upstream bugs, their symptom asserted) fail the run when they XPASS
    failed = {test: outcome for test, outcome in result.outcomes.items() if outcome not in ("passed", "xfailed")}
    assert result.exit_code == 0 and not failed, f"in-worker failures (see {worker.log_path}): {failed}"
