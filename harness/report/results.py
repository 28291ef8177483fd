"""The one reader of a run's results: JUnit XML, the per-test record, and what each test wrote.

Every consumer — ``rerun-test``, the gates, the fault matrix and the run report — reads results
here and nowhere else:

:func:`parse_junit` / :func:`read_junit`
    a pytest JUnit document → :class:`CaseResult` per test case (node id rebuilt from ``file`` of
    ``junit_family=xunit1``, else from ``classname`` and ``name``).
:func:`read_records`
    ``<run_dir>/tests.jsonl`` (written by :mod:`harness.plugins.record`) → :class:`TestRecord` per
    test: when it ran, its seeds, the workers it owned, and the byte range of every worker log and
    ledger file it wrote.
:func:`span_events` / :func:`span_tail`
    the ledger events and the log lines of one such byte range.

Pure apart from reading files; no Ray, no sglang.
"""

from __future__ import annotations

import json
import logging
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from harness import ledger

log = logging.getLogger(__name__)

OUTCOMES = ("passed", "failed", "error", "skipped")
#: Per-test record file in a pytest run directory (see :mod:`harness.plugins.record`).
RECORD_FILE = "tests.jsonl"


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


def one_line(text: str, limit: int = 160) -> str:
    """First meaningful line of ``text``, trimmed to ``limit`` characters."""
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line if len(line) <= limit else line[: limit - 1] + "…"
    return ""


# ---------------------------------------------------------------------------------------------
# JUnit
# ---------------------------------------------------------------------------------------------


def _relative(file: str, root: Path | None) -> str:
    path = Path(file)
    if root is not None and path.is_absolute():
        try:
            return path.relative_to(root).as_posix()
        except ValueError:
            return path.as_posix()
    return file


def _nodeid(file: str, classname: str, name: str) -> str:
    if not file:  # no file attribute (xunit2), or a collection error named by module
        return f"{classname}::{name}" if classname else name
    module = file[:-3].replace("/", ".") if file.endswith(".py") else file
    if classname.startswith(module + "."):
        cls = classname[len(module) + 1:]
    else:  # a rootdir other than the file's: the class is the last dotted part, unless it is the module
        last = classname.rsplit(".", 1)[-1]
        cls = last if last and last != Path(file).stem else ""
    return file + "".join(f"::{p}" for p in cls.split(".") if p) + f"::{name}"


def parse_junit(xml_text: str, root: Path | None = None) -> list[CaseResult]:
    """Read a pytest JUnit XML document into case results.

    Args:
        xml_text: the document.
        root: absolute ``file`` attributes are made relative to this directory.

    Returns:
        One :class:`CaseResult` per ``<testcase>``, in document order. A case with several of
        ``failure`` / ``error`` / ``skipped`` takes the first in that order.

    Raises:
        ValueError: not XML.
    """
    try:
        doc = ET.fromstring(xml_text)
    except ET.ParseError as e:
        raise ValueError(f"not JUnit XML: {e}") from None
    out = []
    for case in doc.iter("testcase"):
        file = _relative(case.get("file") or "", root)
        nodeid = _nodeid(file, case.get("classname", ""), case.get("name", ""))
        outcome, message, reason, text = "passed", "", "", ""
        for tag, kind in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                reason, text = el.get("message") or "", el.text or ""
                outcome, message = kind, one_line(reason or text)
                break
        out.append(CaseResult(nodeid=nodeid, outcome=outcome, duration=float(case.get("time") or 0), message=message,
                              reason=reason, traceback=text))
    return out


def read_junit(path: str | Path, root: Path | None = None) -> list[CaseResult]:
    """:func:`parse_junit` of a file.

    Raises:
        ValueError: the file is missing, unreadable or not XML (a run killed before pytest wrote it).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read JUnit {path}: {e.strerror}") from None
    return parse_junit(text, root)


# ---------------------------------------------------------------------------------------------
# per-test records and what each test wrote
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """The bytes ``[start, end)`` one test wrote to one file of a run directory."""

    path: Path
    start: int
    end: int

    @property
    def name(self) -> str:
        """The worker the file belongs to (``workers/<name>.log``, ``ledger/<name>.jsonl``)."""
        return self.path.stem


@dataclass(frozen=True)
class TestRecord:
    """What :mod:`harness.plugins.record` wrote for one test.

    Attributes:
        path: the test file (absolute, as the pytest process saw it).
        suffix: the node id after the file (``::TestC::test_y[p]``).
        outcome: passed / failed / error / skipped.
        start, stop: epoch seconds (setup start, teardown end).
        seeds: ``workload_base``, ``workload``, ``hypothesis`` (None where not known).
        workers: the workers the test owned.
        logs, ledgers: the spans of ``workers/*.log`` and ``ledger/*.jsonl`` it wrote.
    """

    __test__ = False  # a data class named Test*, not a test

    path: str
    suffix: str
    outcome: str
    start: float
    stop: float
    seeds: tuple[tuple[str, int | None], ...] = ()
    workers: tuple[str, ...] = ()
    logs: tuple[Span, ...] = ()
    ledgers: tuple[Span, ...] = ()

    def matches(self, nodeid: str) -> bool:
        """Whether ``nodeid`` (any spelling of the file's path) names this test."""
        file, sep, rest = nodeid.partition("::")
        return Path(file).name == Path(self.path).name and (sep + rest) == self.suffix


def read_records(run_dir: str | Path) -> list[TestRecord]:
    """Every test record of a pytest run directory, in the order the tests ran.

    A missing file gives ``[]``; an unreadable line (a run killed mid-write) is skipped.
    """
    root = Path(run_dir)
    path = root / RECORD_FILE
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            d = json.loads(line)
            spans = {kind: tuple(Span(root / rel, int(a), int(b)) for rel, (a, b) in sorted(d.get(kind, {}).items()))
                     for kind in ("logs", "ledgers")}
            out.append(TestRecord(path=str(d["path"]), suffix=str(d["suffix"]), outcome=str(d["outcome"]),
                                  start=float(d["start"]), stop=float(d["stop"]),
                                  seeds=tuple(sorted((str(k), v) for k, v in d.get("seeds", {}).items())),
                                  workers=tuple(d.get("workers", ())), **spans))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            log.warning("%s:%d: unreadable test record skipped (%s)", path, n, e)
    return out


def record_for(nodeid: str, records: Iterable[TestRecord]) -> TestRecord | None:
    """The last record of ``nodeid`` (a test rerun in one directory keeps its latest), or None."""
    found = None
    for r in records:
        if r.matches(nodeid):
            found = r
    return found


def _read_span(span: Span) -> bytes:
    try:
        with open(span.path, "rb") as f:
            f.seek(span.start)
            return f.read(max(0, span.end - span.start))
    except OSError:
        return b""


def span_events(span: Span) -> list[ledger.Event]:
    """The ledger events in one span (a torn last line is skipped, as :func:`harness.ledger.read` does).

    Raises:
        ValueError: a line other than the last is not an event.
    """
    lines = _read_span(span).decode("utf-8", errors="replace").splitlines()
    events = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            events.append(ledger.Event.from_dict(json.loads(line)))
        except (json.JSONDecodeError, TypeError) as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{span.path}: bytes {span.start}-{span.end}: not a ledger event ({e})") from None
    return events


def span_tail(span: Span, lines: int = 40) -> str:
    """The last ``lines`` lines of one span (what the worker logged while the test ran)."""
    text = _read_span(span).decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])
