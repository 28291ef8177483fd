"""A pytest run directory's per-test record and what each test wrote.

:func:`read_records` reads ``<run_dir>/tests.jsonl`` (written by :mod:`harness.plugins.record`) into a
:class:`TestRecord` per test; :func:`span_events` / :func:`span_tail` give the ledger events and log lines of
one of its byte ranges. Detail: docs/modules.md.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from harness import ledger
from harness.rundir import RunDir

log = logging.getLogger(__name__)


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
    path = RunDir(root).records
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            d = json.loads(line)
            spans = {
                kind: tuple(Span(root / rel, int(a), int(b)) for rel, (a, b) in sorted(d.get(kind, {}).items()))
                for kind in ("logs", "ledgers")
            }
            out.append(
                TestRecord(
                    path=str(d["path"]),
                    suffix=str(d["suffix"]),
                    outcome=str(d["outcome"]),
                    start=float(d["start"]),
                    stop=float(d["stop"]),
                    seeds=tuple(sorted((str(k), v) for k, v in d.get("seeds", {}).items())),
                    workers=tuple(d.get("workers", ())),
                    **spans,
                )
            )
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
