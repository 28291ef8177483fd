"""A tiny pytest plugin that streams per-test results as JSON lines for rerun-test's live progress.

Loaded by the executor with ``-p harness.rerun.progress``; it writes to the file named in
``HARNESS_RERUN_PROGRESS`` (and does nothing without it), one flushed line per event. The lines' shape:
docs/modules.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import pytest

from harness.plugins.explain import CLASSES
from harness.report.results import one_line
from harness.rerun.execute import PROGRESS_ENV as ENV

_state: dict[str, dict] = {}  # nodeid -> outcome being accumulated over setup/call/teardown
_paths: dict[str, str] = {}  # nodeid -> absolute file (nodeids are relative to a rootdir we do not control)


def _write(event: dict) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(event) + "\n")


def _message(report: pytest.BaseReport) -> str:
    if getattr(report, "wasxfail", None) is not None and report.skipped:  # an expected failure: its reason
        reason = str(getattr(report, "wasxfail"))
        return one_line(reason[len("reason: ") :] if reason.startswith("reason: ") else reason)
    lr = report.longrepr
    if lr is None:
        return ""
    if isinstance(lr, tuple) and len(lr) == 3:  # skip: (file, line, reason)
        text = str(lr[2])
    else:
        crash = getattr(lr, "reprcrash", None)
        text = crash.message if crash is not None else str(lr)
    return one_line(text)


def _in_phase(message: str, when: str) -> str:
    """A setup or teardown failure's line: its evidence class first, as every failure's line leads
    (``error in setup: RuntimeError: boom``); a message the explainer left unclassified is an error."""
    head, _, rest = message.partition(" ")
    if head in CLASSES:
        return f"{head} in {when}: {rest}"
    return f"error in {when}: {message}"


def pytest_collection_finish(session: pytest.Session) -> None:
    _write({"event": "collected", "count": len(session.items)})


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        path = Path(str(report.fspath)).resolve() if report.fspath else Path(report.nodeid)
        _write(
            {
                "event": "result",
                "path": str(path),
                "suffix": "",
                "outcome": "error",
                "duration": 0.0,
                "message": "collection error: " + _message(report),
            }
        )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    st = _state.setdefault(report.nodeid, {"outcome": "passed", "duration": 0.0, "message": ""})
    st["duration"] += report.duration
    if report.when == "call":
        if report.failed:
            st.update(outcome="failed", message=_message(report))
        elif report.skipped:  # xfail / skip inside the test
            xfailed = getattr(report, "wasxfail", None) is not None
            st.update(outcome="xfailed" if xfailed else "skipped", message=_message(report))
    elif report.failed and st["outcome"] != "failed":
        st.update(outcome="error", message=_in_phase(_message(report), report.when))
    elif report.skipped and report.when == "setup":
        st.update(outcome="skipped", message=_message(report))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:  # noqa: ARG001
    # A wrapper, not a plain implementation: a plain one is skipped once an earlier one returns (the
    # known-race rerun, harness.plugins.race_rerun, runs the test itself).
    _paths[item.nodeid] = str(Path(item.path).resolve())
    return (yield)


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    st = _state.pop(nodeid, None)
    if st is None:
        return
    _, sep, rest = nodeid.partition("::")
    _write({"event": "result", "path": _paths.pop(nodeid, ""), "suffix": (sep + rest) if sep else "", **st})
