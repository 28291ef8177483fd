"""The key proof: the unit suites catch the bugs they exist for.

Each unit suite runs in a subprocess (``python -m pytest``) clean, where it must pass, and with each
catalog fault injected through ``--inject-fault``, where it must fail. Results are read per test
from the run's JUnit XML, so a fault that only breaks collection or start-up does not count as
caught, and the failing tests are named in the assertion message.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.faults import ENV_VAR

REPO = Path(__file__).resolve().parent.parent
SUITES = (
    "suites/unit/mem_cache/test_hisparse_allocator.py",
    "suites/unit/disaggregation/test_swa_prealloc_accounting.py",
)
FAULTS = ("swa-tail-unaligned", "release-leaks-swa")

pytestmark = pytest.mark.est_time(300)


@dataclass(frozen=True)
class SuiteRun:
    """One subprocess run of the suites: exit code, per-test outcome and the output tail."""

    returncode: int
    outcomes: dict[str, str]  # "file::test" -> passed | failed | error | skipped
    tail: str

    def failed_in(self, suite: str) -> list[str]:
        return [test for test, outcome in self.outcomes.items()
                if test.startswith(suite) and outcome in ("failed", "error")]

    def ran_in(self, suite: str) -> list[str]:
        return [test for test in self.outcomes if test.startswith(suite)]


def _run_suites(tmp_path: Path, *extra: str) -> SuiteRun:
    junit = tmp_path / "junit.xml"
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}  # only what this test injects
    cmd = [sys.executable, "-m", "pytest", *SUITES, "-q", "-p", "no:warnings", f"--junitxml={junit}",
           f"--run-dir={tmp_path / 'run'}", *extra]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    outcomes: dict[str, str] = {}
    if junit.exists():
        for case in ET.parse(junit).iter("testcase"):
            path = case.get("classname", "").replace(".", "/") + ".py"
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                if case.find(tag) is not None:
                    outcome = {"failure": "failed"}.get(tag, tag)
            outcomes[f"{path}::{case.get('name')}"] = outcome
    return SuiteRun(done.returncode, outcomes, (done.stdout + done.stderr)[-3000:])


def test_unit_suites_pass_clean(tmp_path):
    run = _run_suites(tmp_path)
    assert run.returncode == 0, run.tail
    for suite in SUITES:
        assert run.ran_in(suite) and not run.failed_in(suite), run.tail


@pytest.mark.parametrize("fault", FAULTS)
def test_each_unit_suite_fails_with_fault_injected(tmp_path, fault):
    run = _run_suites(tmp_path, f"--inject-fault={fault}")
    assert run.returncode == 1, f"expected test failures (exit 1) with {fault}, got {run.returncode}:\n{run.tail}"
    for suite in SUITES:
        assert run.ran_in(suite), f"{suite} did not run with {fault}:\n{run.tail}"
        assert run.failed_in(suite), f"{suite} passed with fault {fault} injected: it does not catch it"
    sweep = f"{SUITES[1]}::test_swa_prealloc_accounting_sweep"
    assert run.outcomes.get(sweep) == "failed", f"the Hypothesis sweep did not catch {fault}"
