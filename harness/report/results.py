"""What a run's tests did, as the reports read it: one test's outcome (:class:`CaseResult`) and one
runner group's (:class:`GroupResult`). They are read from JUnit by :mod:`harness.report.junit`; what
each test wrote (logs, ledger events) by :mod:`harness.report.records`. Pure; no Ray, no sglang.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

#: Every outcome a test can have. ``xfailed``: an expected failure (a strict ``xfail`` of a known
#: upstream bug, a canary) that failed as expected, with its reason; its unexpected pass is ``failed``.
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")
#: The longest one-line message a report keeps (a failure's headline fits whole).
MESSAGE_CHARS = 400


@dataclass(frozen=True)
class CaseResult:
    """One test's outcome.

    Attributes:
        nodeid: ``suites/x/test_a.py::TestC::test_y[p]``.
        outcome: one of :data:`OUTCOMES`.
        duration: seconds.
        message: one line (the failure's reason or skip reason), ``""`` when passed.
        reason: the JUnit element's whole ``message`` attribute (not compared).
        traceback: the JUnit element's text (not compared).
    """

    nodeid: str
    outcome: str
    duration: float = 0.0
    message: str = ""
    reason: str = field(default="", compare=False, repr=False)
    traceback: str = field(default="", compare=False, repr=False)

    @property
    def xfail(self) -> bool:
        """An expected failure that failed as expected."""
        return self.outcome == "xfailed"

    @property
    def file(self) -> str:
        """The test file of the node id (``""`` for a collection error named by module)."""
        return self.nodeid.split("::", 1)[0] if "::" in self.nodeid else ""


@dataclass(frozen=True)
class GroupResult:
    """One runner group's run.

    Attributes:
        name: the group (``cpu``, ``8-gpu-h200-1of2``).
        topology, runner: where it ran.
        cases: per-test results.
        wall_time: seconds of the whole pytest process.
        returncode: pytest's exit code (None: not run).
        note: one line when the group itself failed (crash, usage error, nothing collected).
        properties: extra key/values for reports (``simulated``, ``run_dir``, …).
    """

    name: str
    topology: str
    runner: str
    cases: tuple[CaseResult, ...] = ()
    wall_time: float = 0.0
    returncode: int | None = None
    note: str = ""
    properties: tuple[tuple[str, str], ...] = field(default=())

    def count(self, outcome: str) -> int:
        return sum(1 for c in self.cases if c.outcome == outcome)

    @property
    def failures(self) -> tuple[CaseResult, ...]:
        return tuple(c for c in self.cases if c.outcome in ("failed", "error"))

    @property
    def ok(self) -> bool:
        """Passed: pytest exited 0 (or 5 never: nothing collected is a failure), no failed/error case."""
        return self.returncode == 0 and not self.failures and not self.note

    @property
    def run_dir(self) -> Path | None:
        """The group's pytest ``--run-dir`` (its ``tests.jsonl``, ``workers/``, ``ledger/``), if known."""
        value = dict(self.properties).get("run_dir")
        return Path(value) if value else None


def one_line(text: str, limit: int = MESSAGE_CHARS) -> str:
    """First meaningful line of ``text``, trimmed to ``limit`` characters."""
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line if len(line) <= limit else line[: limit - 1] + "…"
    return ""
