"""Classify a test failure from its JUnit element, so the flaky policy reruns only what may be flaky.

Classes, first match wins: ``crash``, ``import``, ``timeout``, ``accounting``, ``accuracy``, ``timing``,
``assertion``, ``error``. Only ``accuracy`` and ``timing`` may ever be rerun
(:data:`harness.gates.model.FLAKY_ELIGIBLE`). What each class matches, and why the order: docs/modules.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from harness.report import junit, results

CLASSES = ("crash", "import", "timeout", "accounting", "accuracy", "timing", "assertion", "error")

_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    # A failure headline (harness.plugins.explain) starts with its evidence class; the classes map here.
    # One of sglang's own accounting checks is accounting even when it took its server down with it.
    ("accounting", re.compile(r"^sglang-check\b")),
    (
        "crash",
        re.compile(
            r"^worker-death\b|WorkerDied|Segmentation fault|SIGSEGV|SIGKILL|SIGABRT|core dumped|Fatal Python error|"
            r"worker .* died|process .* (died|exited)|RayActorError|ActorDiedError|OutOfMemoryError",
            re.I,
        ),
    ),
    ("import", re.compile(r"\b(ImportError|ModuleNotFoundError)\b|collection error|error collecting", re.I)),
    # A stall (harness.plugins.explain): a request still in flight when the test gave up on it; its line
    # may quote ledger words (the request it names), never a broken rule.
    ("timeout", re.compile(r"^stall\b|Failed: Timeout|Timeout >|GetTimeoutError|\bTimeoutError\b|timed out", re.I)),
    # Ledger rules print as "[rule-name]"; KV content / window checks and PD invariants are accounting too.
    (
        "accounting",
        re.compile(
            r"^(kv|prealloc)\b|ledger|Violation|accounting|page-(leak|double)|not-baseline|"
            r"free[_ -]?(pages|slots|size)|"
            r"leak(ed)?\b|conservation|swa-over-window|evicted[-_]|\[[a-z]+(?:-[a-z]+)+\]|"
            r"KVCorruption|WindowLost|PreallocError|PDError|invariant",
            re.I,
        ),
    ),
    ("accuracy", re.compile(r"Accuracy|\bgsm8k\b|\bmmlu\b|score .*(below|<)", re.I)),
    ("timing", re.compile(r"Timing(Error)?\b|latency|throughput|too slow|\bTTFT\b|\bITL\b|tokens?/s", re.I)),
    ("assertion", re.compile(r"AssertionError|\bassert\b", re.I)),
)


@dataclass(frozen=True)
class Failure:
    """One failing case as JUnit recorded it.

    Attributes:
        nodeid: the test's node id (as :func:`harness.report.junit.parse_junit` rebuilds it).
        kind: ``failure`` (the test body) or ``error`` (setup/teardown/collection).
        message: the element's ``message`` attribute.
        text: the element's text (the traceback).
        failure_class: one of :data:`CLASSES`.
    """

    nodeid: str
    kind: str
    message: str
    text: str
    failure_class: str


def _error_lines(text: str) -> str:
    """The exception lines of a pytest traceback (``E   …``), not the source lines around them.

    Source shown in a traceback may mention anything (a docstring saying "WorkerDied"); only what
    was raised says what happened. Without ``E`` lines (a plain traceback) the last lines are used.
    """
    lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    if not lines:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()][-3:]
    return "\n".join(lines)


def classify(kind: str, message: str, text: str = "") -> str:
    """The class of one failure.

    Args:
        kind: ``failure`` or ``error`` (JUnit tag).
        message: one line.
        text: the traceback (its exception lines are searched after the message).

    Returns:
        One of :data:`CLASSES`. A setup/teardown ``error`` is never ``accuracy``/``timing``/``assertion``.
    """
    for source in (message, _error_lines(text)):
        for name, pattern in _RULES:
            if pattern.search(source or ""):
                if kind == "error" and name in ("accuracy", "timing", "assertion"):
                    break  # an environment problem, not a measurement: never flaky
                return name
    return "error"


def failures(cases: Iterable[results.CaseResult]) -> list[Failure]:
    """Every failed or errored case of a JUnit report read by :mod:`harness.report.results`, classified."""
    tags = {"failed": "failure", "error": "error"}
    return [
        Failure(c.nodeid, tags[c.outcome], c.reason, c.traceback, classify(tags[c.outcome], c.reason, c.traceback))
        for c in cases
        if c.outcome in tags
    ]


def failures_from_junit(xml_text: str) -> list[Failure]:
    """:func:`failures` of a JUnit document (node ids as :func:`harness.report.junit.parse_junit` rebuilds them).

    Raises:
        ValueError: not XML.
    """
    return failures(junit.parse_junit(xml_text))
