"""``harness runs [--limit N] [--json] [--prune [--keep N]]``: the recent runs under ``runs/``.

One line per run, newest first: when it started, how it ended, how long it took, the command, the
sglang target and the report's path (:mod:`harness.runs`). The first line says how many runs are kept
and how to change it; ``--prune`` applies that retention now (it also runs when a run ends).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from harness import runs
from harness.commands import UsageError
from harness.rundir import DEFAULT_BASE


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("runs", help="list the recent runs (when, command, target, verdict, report); prune old ones")
    p.add_argument("--limit", type=int, default=20, metavar="N", help="show the newest N runs (default 20; 0: all)")
    p.add_argument("--json", action="store_true", help="print the runs as JSON")
    p.add_argument("--prune", action="store_true", help="remove the runs beyond the newest --keep now")
    p.add_argument(
        "--keep",
        type=int,
        metavar="N",
        help=f"runs to keep (default ${runs.KEEP_ENV} or {runs.DEFAULT_KEEP}; 0: keep all)",
    )
    p.add_argument("--runs-dir", type=Path, default=DEFAULT_BASE, help=argparse.SUPPRESS)
    p.set_defaults(func=_runs)


def _runs(args: argparse.Namespace) -> int:
    if args.limit < 0:
        raise UsageError(f"--limit {args.limit}: must be ≥ 0 (0 shows every run)")
    if args.keep is not None and args.keep < 0:
        raise UsageError(f"--keep {args.keep}: must be ≥ 0 (0 keeps every run)")
    try:
        keep = runs.keep_count() if args.keep is None else args.keep
    except ValueError as e:
        raise UsageError(str(e)) from None
    base: Path = args.runs_dir
    removed = runs.prune(base, keep) if args.prune else []
    found = runs.scan(base)
    shown = found[: args.limit] if args.limit else found
    if args.json:
        print(
            json.dumps(
                {
                    "runs_dir": str(base),
                    "keep": keep,
                    "removed": [str(p) for p in removed],
                    "runs": [_as_dict(r, found) for r in shown],
                },
                indent=2,
            )
        )
        return 0
    kept = (
        f"keeping the newest {keep} (set {runs.KEEP_ENV}=N or pass --keep N; 0 keeps all)"
        if keep
        else "keeping every run"
    )
    print(f"{len(found)} run(s) in {_short(base)}; {kept}")
    for path in removed:
        print(f"removed {path.name}")
    latest = base / runs.LATEST
    if latest.is_symlink():
        print(f"latest: {_short(latest)} -> {os.readlink(latest)}")
    if not shown:
        return 0
    head = ("started", "verdict", "took", "command", "target", "report")
    rows = [head] + [
        (
            _when(r.started),
            r.state,
            _took(r),
            r.command or "-",
            r.target or "-",
            _short(Path(r.report)) if r.report else "-",
        )
        for r in shown
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    return 0


def _as_dict(r: runs.RunInfo, found: list[runs.RunInfo]) -> dict:
    return {
        "name": r.name,
        "path": str(r.path),
        "started": r.started,
        "ended": r.ended,
        "state": r.state,
        "command": r.command,
        "target": r.target,
        "report": r.report,
        "kept_because": runs.kept_because(r, found),
    }


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "-"


def _took(r: runs.RunInfo) -> str:
    if r.ended is None:
        return "-"
    seconds = max(0.0, r.ended - r.started)
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def _short(path: Path) -> str:
    """The path relative to the working directory when it is under it (shorter to read and to copy)."""
    try:
        return str(Path(os.path.abspath(path)).relative_to(Path.cwd()))
    except ValueError:
        return str(path)
