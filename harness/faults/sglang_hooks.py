"""sglang's own test hooks as fault sources: each sets the variable sglang reads to break itself on purpose,
in every process of a run (``HARNESS_FAULTS``, ``--inject-fault``), and proves it fired by sglang's own log
line (:attr:`~harness.faults.fault.Fault.fired_log`). They break nothing a suite should catch, so they name
no suite and the fault check does not run them. Set from the start they also reach the servers' warm-up,
which polls through the same hook: a test switches the variable in the running servers instead, after the
warm-up (:mod:`harness.engines.server.env_switch`). Which hooks each release has:
:mod:`harness.targets.sglang.compat.testhooks`.
"""

from __future__ import annotations

from harness.faults.fault import Fault

FAULTS: tuple[Fault, ...] = (
    Fault(
        name="sglang-hook-transfer-failure",
        description="sglang's SGLANG_TEST_DISAGG_FAILURE_PROB: each transfer poll answers Failed with probability 0.02",
        upstream="sglang's own test hook (disaggregation/utils._poll_with_failure_injection)",
        env=(("SGLANG_TEST_DISAGG_FAILURE_PROB", "0.02"),),
        fired_log=r"(Decode|Prefill) transfer failed for request",
    ),
    Fault(
        name="sglang-hook-forced-retraction",
        description="sglang's SGLANG_TEST_RETRACT: decode retracts a request every third forward (batches of 2+)",
        upstream="sglang's own test hook (managers/scheduler.update_running_batch)",
        env=(("SGLANG_TEST_RETRACT", "1"),),
        fired_log=r"Testing retraction\. #retracted_reqs: [1-9]",
    ),
)
