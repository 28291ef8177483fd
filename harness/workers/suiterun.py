"""Run pytest suites inside a harness Ray worker, on the device the worker was given.

:class:`SuiteRunner` is an in-process worker payload; :meth:`SuiteRunner.run` picks the device, exports it
as ``HARNESS_DEVICE`` and runs ``pytest.main`` in the worker's process, so the unit suites run on the
worker's GPU (or CPU). Detail: docs/modules.md.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from harness.report.junit import read_junit
from harness.rundir import REPO_ROOT

logger = logging.getLogger(__name__)

#: Env var the unit suites read their device from (``suites/unit/conftest.py``).
DEVICE_ENV = "HARNESS_DEVICE"


@dataclass(frozen=True)
class SuiteResult:
    """What one in-worker pytest run did.

    Attributes:
        exit_code: pytest's exit code (0: all passed).
        device: the device the suites built their pools on.
        gpu_ids: the GPU ids Ray gave the worker (logical ones when simulated).
        cuda_visible_devices: the worker's ``CUDA_VISIBLE_DEVICES``.
        pid: the worker process that ran the tests.
        outcomes: ``"file::test" -> passed | failed | error | skipped`` from the JUnit report.
    """

    exit_code: int
    device: str
    gpu_ids: tuple[int, ...]
    cuda_visible_devices: str | None
    pid: int
    outcomes: dict[str, str] = field(default_factory=dict)


def worker_device() -> str:
    """The device this worker's suites should use: ``cuda:0`` if CUDA is usable here, else ``cpu``."""
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


class SuiteRunner:
    """In-process payload that runs pytest suites in the worker (see the module docstring)."""

    def run(self, paths: list[str], extra_args: list[str] | None = None) -> SuiteResult:
        """Run pytest on ``paths`` (relative to the repository root) in this worker process.

        Args:
            paths: test files or node ids.
            extra_args: more pytest arguments.

        Returns:
            The :class:`SuiteResult`.
        """
        import pytest

        from harness.workers.actor import current

        context = current()
        device = worker_device()
        os.environ[DEVICE_ENV] = device  # this worker process only: the suites' device fixture
        logger.warning("running %s in worker %s on %s", paths, context.name, device)
        with tempfile.TemporaryDirectory(prefix="suite-") as tmp:
            junit = Path(tmp) / "junit.xml"
            args = [
                *paths,
                "-q",
                "-p",
                "no:cacheprovider",
                f"--junitxml={junit}",
                "-o",
                "junit_family=xunit1",
                f"--rootdir={REPO_ROOT}",
                *(extra_args or []),
            ]
            cwd = os.getcwd()
            os.chdir(REPO_ROOT)
            try:
                exit_code = int(pytest.main(args))
            finally:
                os.chdir(cwd)
            outcomes = _outcomes(junit) if junit.exists() else {}
        return SuiteResult(
            exit_code=exit_code,
            device=device,
            gpu_ids=tuple(context.gpu_ids),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            pid=os.getpid(),
            outcomes=outcomes,
        )


def _outcomes(junit: Path) -> dict[str, str]:
    """``file::test -> outcome`` of a JUnit report (an expected failure is ``xfailed``, not a skip)."""
    return {case.nodeid: case.outcome for case in read_junit(junit, REPO_ROOT)}
