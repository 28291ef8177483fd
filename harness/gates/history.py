"""The flaky record: every gate run appends its per-test outcomes; flaky tests are read back from it.

One JSON line per run in ``flaky-history.jsonl`` (the runs directory's root), appended in one ``write``
so concurrent runs do not interleave. A test is flaky when its pass rate over the last N runs is strictly
between 0 and 100 %. The line's shape: docs/modules.md.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FILE_NAME = "flaky-history.jsonl"


@dataclass(frozen=True)
class FlakyTest:
    """A test with mixed outcomes: passes and fails over ``runs`` runs (``attempts`` in all)."""

    nodeid: str
    passed: int
    attempts: int
    runs: int
    last: str

    @property
    def pass_rate(self) -> float:
        return self.passed / self.attempts


def append(
    path: Path, run: str, tests: dict[str, list[str]], gate: str = "", git_sha: str = "", ts: float | None = None
) -> None:
    """Append one run's outcomes.

    Args:
        path: the history file (created with its directory).
        run: the run's id (its directory name).
        tests: node id → outcomes of its attempts (``passed``/``failed``/``error``; skips are dropped).
        gate: the gate that ran, if any.
        git_sha: the commit tested.
        ts: the time (default now).
    """
    kept = {k: [o for o in v if o != "skipped"] for k, v in tests.items()}
    record = {
        "run": run,
        "gate": gate,
        "ts": time.time() if ts is None else ts,
        "git_sha": git_sha,
        "tests": {k: v for k, v in kept.items() if v},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def read(path: Path) -> list[dict]:
    """Every run record, oldest first; unreadable lines (a run killed mid-write) are skipped."""
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s:%d: unreadable history line skipped", path, n)
            continue
        if isinstance(rec, dict) and isinstance(rec.get("tests"), dict):
            out.append(rec)
    return out


def flaky(records: list[dict], last: int | None = None) -> list[FlakyTest]:
    """Tests whose pass rate over the last ``last`` runs is strictly between 0 and 100 % (pure).

    Args:
        records: run records, oldest first (as :func:`read` returns them).
        last: only the newest ``last`` runs (None: all).

    Returns:
        Flaky tests, lowest pass rate first (then by node id).
    """
    window = records[-last:] if last else records
    passed: dict[str, int] = {}
    attempts: dict[str, int] = {}
    runs: dict[str, int] = {}
    latest: dict[str, str] = {}
    for rec in window:
        for nodeid, outcomes in rec["tests"].items():
            if not outcomes:
                continue
            passed[nodeid] = passed.get(nodeid, 0) + sum(1 for o in outcomes if o == "passed")
            attempts[nodeid] = attempts.get(nodeid, 0) + len(outcomes)
            runs[nodeid] = runs.get(nodeid, 0) + 1
            latest[nodeid] = outcomes[-1]
    out = [FlakyTest(k, passed[k], attempts[k], runs[k], latest[k]) for k in attempts if 0 < passed[k] < attempts[k]]
    return sorted(out, key=lambda t: (t.pass_rate, t.nodeid))
