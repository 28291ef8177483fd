"""The key proof: the unit suites catch the bugs they exist for.

Each unit suite runs in a subprocess (``python -m pytest``) clean, where it must pass, and with each
catalog fault injected through ``--inject-fault``, where it must fail. Results are read per test
from the run's JUnit XML, so a fault that only breaks collection or start-up does not count as
caught, and the failing tests are named in the assertion message.

The runs the selected tests need start together when the module's first test asks for one (each is
one process importing sglang on one core; the machine has more), and each test waits for its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from harness.faults import ENV_VAR
from harness.engines import fork_preload

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
        return [
            test for test, outcome in self.outcomes.items() if test.startswith(suite) and outcome in ("failed", "error")
        ]

    def ran_in(self, suite: str) -> list[str]:
        return [test for test in self.outcomes if test.startswith(suite)]


class _Started:
    """One ``python -m pytest SUITES`` subprocess, started; :meth:`result` waits and reads its JUnit XML."""

    def __init__(self, tmp_path: Path, *extra: str):
        self.junit = tmp_path / "junit.xml"
        env = {k: v for k, v in os.environ.items() if k != ENV_VAR}  # only what this test injects
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *SUITES,
            "-q",
            "-p",
            "no:warnings",
            f"--junitxml={self.junit}",
            f"--run-dir={tmp_path / 'run'}",
            *extra,
        ]
        # As the fault check runs them: one thread each, forked from the preloaded interpreter.
        cmd, env = fork_preload.python_command(cmd, env)
        # Output to a file, not a pipe: a run nobody reads yet must not block on a full pipe.
        self.log = tmp_path / "pytest.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        self._run: SuiteRun | None = None

    def result(self) -> SuiteRun:
        if self._run is None:
            try:
                self.proc.wait(timeout=900)
            finally:
                self.stop()
            output = self.log.read_text(errors="replace")
            outcomes: dict[str, str] = {}
            if self.junit.exists():
                for case in ET.parse(self.junit).iter("testcase"):
                    path = case.get("classname", "").replace(".", "/") + ".py"
                    outcome = "passed"
                    for tag in ("failure", "error", "skipped"):
                        if case.find(tag) is not None:
                            outcome = {"failure": "failed"}.get(tag, tag)
                    outcomes[f"{path}::{case.get('name')}"] = outcome
            self._run = SuiteRun(self.proc.returncode, outcomes, output[-3000:])
        return self._run

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


CLEAN = "clean"


@pytest.fixture(scope="module")
def suite_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, _Started]]:
    """The clean run and one run per fault, each started once for the module: only those a selected
    test of this module needs, all at the same time."""
    wanted = []
    for item in request.session.items:
        if item.module is request.module and "suite_runs" in getattr(item, "fixturenames", ()):
            label = item.callspec.params.get("fault", CLEAN) if hasattr(item, "callspec") else CLEAN
            if label not in wanted:
                wanted.append(label)
    runs = {
        label: _Started(tmp_path_factory.mktemp(label), *([] if label == CLEAN else [f"--inject-fault={label}"]))
        for label in wanted
    }
    try:
        yield runs
    finally:
        for run in runs.values():
            run.stop()


def test_unit_suites_pass_clean(suite_runs):
    run = suite_runs[CLEAN].result()
    assert run.returncode == 0, run.tail
    for suite in SUITES:
        assert run.ran_in(suite) and not run.failed_in(suite), run.tail


@pytest.mark.parametrize("fault", FAULTS)
def test_each_unit_suite_fails_with_fault_injected(suite_runs, fault):
    run = suite_runs[fault].result()
    assert run.returncode == 1, f"expected test failures (exit 1) with {fault}, got {run.returncode}:\n{run.tail}"
    for suite in SUITES:
        assert run.ran_in(suite), f"{suite} did not run with {fault}:\n{run.tail}"
        assert run.failed_in(suite), f"{suite} passed with fault {fault} injected: it does not catch it"
    sweep = f"{SUITES[1]}::test_swa_prealloc_accounting_sweep"
    assert run.outcomes.get(sweep) == "failed", f"the Hypothesis sweep did not catch {fault}"
