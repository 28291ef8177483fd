"""pytest plugin concern: a record of every test, so the run report can show what each test did.

After each test's teardown, one JSON line goes to ``<run_dir>/tests.jsonl`` (read back by
:func:`harness.report.records.read_records`): its outcome, seeds, workers and the byte ranges of the worker
logs and ledgers it wrote. The line's shape: docs/modules.md.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest

from harness.clock import DEFAULT, Clock, wait_for
from harness.plugins.failfast import owned_workers
from harness.plugins.seeds import base_seed_key, derive
from harness.plugins.state import state_key
from harness.rundir import RunDir

_sizes_key = pytest.StashKey[dict]()
_start_key = pytest.StashKey[float]()
_outcome_key = pytest.StashKey[str]()
_workers_key = pytest.StashKey[list]()

#: Sub-directories of the run directory whose files are attributed to tests, and their suffix.
WATCHED = (("logs", "workers", ".log"), ("ledgers", "ledger", ".jsonl"))


def _run_dir(config: pytest.Config) -> Path | None:
    st = config.stash.get(state_key, None)
    return Path(st.run_dir_path) if st is not None else None


def _sizes(run_dir: Path | None) -> dict[str, int]:
    """``"workers/x.log" -> size`` of every watched file (empty when the run dir does not exist)."""
    out: dict[str, int] = {}
    if run_dir is None:
        return out
    for _, sub, ext in WATCHED:
        try:
            entries = list(os.scandir(run_dir / sub))
        except OSError:
            continue
        for e in entries:
            if e.name.endswith(ext):
                try:
                    out[f"{sub}/{e.name}"] = e.stat().st_size
                except OSError:
                    continue  # removed between listing and stat
    return out


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    run_dir = _run_dir(item.config)
    item.stash[_sizes_key] = _sizes(run_dir)
    item.stash[_start_key] = time.time()
    try:
        return (yield)
    finally:
        if run_dir is not None and run_dir.is_dir():
            _write(item, run_dir, time.time())


def new_attempt(item: pytest.Item) -> None:
    """Forget the outcome recorded so far for ``item``: it runs again (``harness.plugins.race_rerun``) and
    the record keeps the last attempt's."""
    if _outcome_key in item.stash:
        del item.stash[_outcome_key]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    report = yield
    names = item.stash.setdefault(_workers_key, [])
    # Read the owners now: a fixture may clear its worker list when it stops them at teardown.
    names.extend(w.name for w in owned_workers(item) if w.name not in names)
    previous = item.stash.get(_outcome_key, "passed")
    if report.failed:
        outcome = "failed" if report.when == "call" else "error"
        item.stash[_outcome_key] = "failed" if previous == "failed" else outcome
    elif report.skipped and previous == "passed":
        item.stash[_outcome_key] = "skipped"
    return report


#: Seconds, at most, a failed test's verdict waits while a request of the test is still in flight, for
#: its servers to write what the failure set off (the release an abort triggers) before judging.
SETTLE_S = 10.0


@dataclass(frozen=True)
class LedgerReading:
    """What a test's workers wrote to their ledgers: ``violations``, the findings on what the test made
    them do (a request still in flight among them, :data:`harness.ledger.IN_FLIGHT`), and ``events``,
    those of every ledger file that grew during the test, whole (the context a request's phases need)."""

    violations: list = field(default_factory=list)
    events: list = field(default_factory=list)

    @property
    def in_flight(self) -> list:
        """The findings of requests still in flight."""
        from harness import ledger

        return ledger.split_in_flight(self.violations)[1]


def read_ledger(item: pytest.Item) -> LedgerReading:
    """The ledger of what ``item`` made its workers do so far: every ledger file that grew since the
    test's setup is checked whole (its configuration and earlier requests are context), and the
    violations at an event the test wrote (or, found at the end, on a request it wrote) are kept.
    Empty when the session has no run directory or the files cannot be read."""
    from harness import ledger

    run_dir = _run_dir(item.config)
    before = item.stash.get(_sizes_key, None)
    if run_dir is None or before is None:
        return LedgerReading()
    found, seen = [], []
    mine_all: set = set()
    for rel, size in _sizes(run_dir).items():
        if not rel.startswith("ledger/") or size <= before.get(rel, 0):
            continue
        try:
            events = ledger.read(run_dir / rel)
        except (OSError, ValueError):
            continue
        seen.extend(events)
        start = before.get(rel, 0)
        mine = _events_from(run_dir / rel, start)
        seqs = {(e.worker, e.seq) for e in mine}
        rids = {(e.worker, e.rid) for e in mine}
        for v in ledger.check(events):
            if (v.worker, v.seq) in seqs or (v.seq is None and (v.worker, v.rid) in rids):
                found.append(v)
        mine_all.update(seqs)
    # The content rules read a room's prefill and decode files together: what they find there replaces what
    # one file alone said of the same event (a late writer only the other file names).
    both = [v for v in ledger.check_content(seen) if (v.worker, v.seq) in mine_all]
    keys = {(v.rule, v.worker, v.seq) for v in both}
    return LedgerReading([v for v in found if (v.rule, v.worker, v.seq) not in keys] + both, seen)


def settle(
    read: Callable[[], LedgerReading], *, timeout_s: float | None = None, clock: Clock = DEFAULT
) -> LedgerReading:
    """``read()`` again until no request is in flight, for at most ``timeout_s`` (default
    :data:`SETTLE_S`): the servers' bounded chance to write what a failure set off (a client that gave
    up makes sglang abort its request and release its pages a moment later) before a verdict is taken.

    Returns:
        The first reading with nothing in flight, else the last one (taken at the bound).
    """
    last = read()
    if not last.in_flight:
        return last

    def quiet() -> LedgerReading | None:
        nonlocal last
        last = read()
        return None if last.in_flight else last

    try:
        return wait_for(
            quiet,
            SETTLE_S if timeout_s is None else timeout_s,
            "requests in flight to finish",
            interval=0.25,
            clock=clock,
        )
    except TimeoutError:
        return last


def ledger_violations(item: pytest.Item) -> list:
    """The violations of :func:`read_ledger` (read once, at once)."""
    return read_ledger(item).violations


def _events_from(path: Path, start: int) -> list:
    """The events of a ledger file from byte ``start`` on (a torn last line is skipped)."""
    from harness import ledger

    with open(path, "rb") as f:
        f.seek(start)
        lines = f.read().decode("utf-8", errors="replace").splitlines()
    out = []
    for line in lines:
        try:
            out.append(ledger.Event.from_dict(json.loads(line)))
        except (ValueError, TypeError):
            continue
    return out


def _write(item: pytest.Item, run_dir: Path, stop: float) -> None:
    before = item.stash.get(_sizes_key, {})
    after = _sizes(run_dir)
    spans: dict[str, dict[str, list[int]]] = {kind: {} for kind, _, _ in WATCHED}
    for rel, size in after.items():
        start = before.get(rel, 0)
        if size > start:
            kind = next(k for k, sub, _ in WATCHED if rel.startswith(sub + "/"))
            spans[kind][rel] = [start, size]
    _, sep, rest = item.nodeid.partition("::")
    suffix = (sep + rest) if sep else ""
    base = item.config.stash.get(base_seed_key, None)
    seeds = {
        "workload_base": base,
        "workload": derive(base, Path(item.path).name, suffix) if base is not None else None,
        "hypothesis": item.config.getoption("hypothesis_seed", None),
    }
    rec = {
        "path": str(Path(item.path).resolve()),
        "suffix": suffix,
        "outcome": item.stash.get(_outcome_key, "passed"),
        "start": item.stash.get(_start_key, stop),
        "stop": stop,
        "seeds": seeds,
        "workers": item.stash.get(_workers_key, []),
        **spans,
    }
    with open(RunDir(run_dir).records, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
