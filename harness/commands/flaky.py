"""``harness flaky [--last N] [--history FILE]``: tests whose pass rate over the last N runs is between 0 and 100 %.

Reads ``runs/flaky-history.jsonl`` (every gate run appends its per-test outcomes). Exit 0 always
when the history is readable (an empty list says nothing is flaky); 2 on bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import rundir
from harness.commands import UsageError
from harness.gates import history


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("flaky", help="list tests that both passed and failed over the last N runs")
    p.add_argument("--last", type=int, default=20, metavar="N", help="look at the newest N runs (default 20)")
    p.add_argument(
        "--history",
        type=Path,
        default=rundir.DEFAULT_BASE / history.FILE_NAME,
        metavar="FILE",
        help=f"the history file (default runs/{history.FILE_NAME})",
    )
    p.set_defaults(func=_flaky)


def _flaky(args: argparse.Namespace) -> int:
    if args.last < 1:
        raise UsageError(f"--last {args.last}: must be ≥ 1")
    records = history.read(args.history)
    tests = history.flaky(records, args.last)
    window = min(args.last, len(records))
    if not tests:
        print(f"no flaky tests in the last {window} run(s) of {args.history.name}")
        return 0
    print(f"{'pass rate':>9}  {'passed':>6}/{'tries':<6} {'last':7} test  (last {window} run(s))")
    for t in tests:
        print(f"{t.pass_rate:9.0%}  {t.passed:>6}/{t.attempts:<6} {t.last:7} {t.nodeid}")
    return 0
