"""The version matrix: the same specs on several sglang targets, one table.

``harness matrix --sglang A,B,... SPECS`` resolves every target first, then runs ``rerun-test`` per target
one after another (a Ray worker that imported one sglang cannot import another) and tabulates the results.
The pure parts take plain data. Detail: docs/modules.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from harness.rundir import RunDir
from harness.workers import procs

logger = logging.getLogger(__name__)

_OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")


@dataclass(frozen=True)
class Cell:
    """One target × test file: counts per outcome and the distinct reasons of failures and skips."""

    counts: dict[str, int] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()

    def text(self) -> str:
        """``3 passed, 1 skipped`` (outcomes with a count only; ``-`` when nothing ran)."""
        parts = [f"{self.counts[o]} {o}" for o in _OUTCOMES if self.counts.get(o)]
        return ", ".join(parts) or "-"


@dataclass(frozen=True)
class TargetRun:
    """One target's run.

    Attributes:
        spec: the TARGET as given.
        label: the resolved target's one-line description.
        run_dir: its rerun-test run directory.
        returncode: rerun-test's exit code.
        wall_s: seconds it took.
        cells: test file -> :class:`Cell`.
        note: one line when the run itself failed (no summary written).
    """

    spec: str
    label: str
    run_dir: Path
    returncode: int
    wall_s: float
    cells: dict[str, Cell]
    note: str = ""


def parse_targets(value: str) -> list[str]:
    """Split ``--sglang 0.5.19,0.5.20,PATH`` into TARGETs (order kept, duplicates and blanks dropped).

    Args:
        value: the option's value.

    Returns:
        The TARGETs.

    Raises:
        ValueError: no target given.
    """
    targets = list(dict.fromkeys(t.strip() for t in value.split(",") if t.strip()))
    if not targets:
        raise ValueError("--sglang names no target; pass e.g. --sglang 0.5.21,0.5.23,../sglang/python")
    return targets


def summarize(summary: dict) -> dict[str, Cell]:
    """Per test file counts and reasons from a rerun-test ``summary.json`` (pure).

    Args:
        summary: the parsed ``report/summary.json``.

    Returns:
        Test file -> :class:`Cell`.
    """
    counts: dict[str, dict[str, int]] = {}
    reasons: dict[str, list[str]] = {}
    for group in summary.get("groups", []):
        for case in group.get("cases", []):
            file = case["nodeid"].split("::", 1)[0]
            outcome = case["outcome"]
            counts.setdefault(file, {}).setdefault(outcome, 0)
            counts[file][outcome] += 1
            if outcome != "passed" and case.get("message"):
                text = f"{outcome}: {case['message']}"
                if text not in reasons.setdefault(file, []):
                    reasons[file].append(text)
        if group.get("note"):
            reasons.setdefault(f"({group['name']})", []).append(f"group: {group['note']}")
            counts.setdefault(f"({group['name']})", {})
    return {f: Cell(counts[f], tuple(reasons.get(f, ()))) for f in sorted(counts)}


def slug(spec: str) -> str:
    """A directory name for a TARGET (``0.5.21``, ``tree-python``, ``wheel-sglang-0.5.21``)."""
    if re.match(r"^\d+\.\d+\.\d+", spec):
        return spec
    name = Path(spec.rstrip("/")).name or "root"
    kind = "wheel" if spec.endswith(".whl") else "tree"
    return f"{kind}-{re.sub(r'[^A-Za-z0-9._-]+', '-', name)}"


def run_target(
    spec: str,
    label: str,
    specs: list[str],
    run_dir: Path,
    *,
    repo_root: Path,
    extra_args: list[str] = (),
    timeout_s: float | None = None,
    out: Callable[[str], None] = print,
) -> TargetRun:
    """Run ``rerun-test --sglang spec SPECS`` in a subprocess and read its summary.

    Args:
        spec: the TARGET.
        label: its resolved description (for output).
        specs: rerun-test specs.
        run_dir: this target's run directory.
        repo_root: the repository (rerun-test's working directory).
        extra_args: more rerun-test arguments (``--timeout``, ``--ray-address`` …).
        timeout_s: a limit for the whole target (None: none); the run is killed after it.
        out: console lines.

    Returns:
        The :class:`TargetRun`.
    """
    from harness.targets.sglang import selection as target_mod

    env = {k: v for k, v in os.environ.items() if k != target_mod.ENV_VAR}
    cmd = [
        sys.executable,
        "-m",
        "harness.commands.rerun",
        "--sglang",
        spec,
        "--run-dir",
        str(run_dir),
        *extra_args,
        *specs,
    ]
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "rerun-test.log"
    out(f"matrix: {label}: {' '.join(specs)} (run dir {run_dir})")
    start = time.monotonic()
    code, _ = procs.run_logged(cmd, cwd=repo_root, env=env, log=log, timeout_s=timeout_s)
    wall = time.monotonic() - start
    summary_path = RunDir(run_dir).report / "summary.json"
    if not summary_path.is_file():
        tail = [ln for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()][-1:]
        return TargetRun(spec, label, run_dir, code, wall, {}, note=f"rerun-test exited {code}: {''.join(tail)}")
    cells = summarize(json.loads(summary_path.read_text(encoding="utf-8")))
    out(f"matrix: {label}: exit {code} in {wall:.0f} s")
    return TargetRun(spec, label, run_dir, code, wall, cells)


def _files(runs: list[TargetRun]) -> list[str]:
    return sorted({f for r in runs for f in r.cells})


def render_text(runs: list[TargetRun]) -> str:
    """The table for a terminal: one row per target, one column per test file, then the reasons (pure)."""
    files = _files(runs)
    head = ["target", "wall", *[Path(f).name for f in files]]
    rows = [[r.label, f"{r.wall_s:.0f}s", *[r.cells[f].text() if f in r.cells else "-" for f in files]] for r in runs]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head, *rows]]
    for r in runs:
        if r.note:
            lines.append(f"{r.label}: {r.note}")
        for f in files:
            for reason in r.cells[f].reasons if f in r.cells else ():
                lines.append(f"{r.label} · {Path(f).name}: {reason}")
    return "\n".join(lines)


def render_markdown(runs: list[TargetRun]) -> str:
    """The table as markdown, then the reasons (pure)."""
    files = _files(runs)
    lines = [
        "| target | wall | " + " | ".join(f"`{Path(f).name}`" for f in files) + " |",
        "| --- | ---: |" + " --- |" * len(files),
    ]
    for r in runs:
        cells = [r.cells[f].text() if f in r.cells else "-" for f in files]
        lines.append(f"| {r.label} | {r.wall_s:.0f}s | " + " | ".join(cells) + " |")
    reasons = [
        f"- {r.label} · `{Path(f).name}`: {reason}"
        for r in runs
        for f in files
        for reason in (r.cells[f].reasons if f in r.cells else ())
    ]
    reasons += [f"- {r.label}: {r.note}" for r in runs if r.note]
    if reasons:
        lines += ["", *reasons]
    return "\n".join(lines) + "\n"


def to_json(runs: list[TargetRun]) -> dict:
    """JSON-able matrix: per target its spec, label, run dir, exit code, wall time and cells (pure)."""
    return {
        "targets": [
            {
                "spec": r.spec,
                "label": r.label,
                "run_dir": str(r.run_dir),
                "returncode": r.returncode,
                "wall_s": round(r.wall_s, 1),
                "note": r.note,
                "files": {f: {"counts": c.counts, "reasons": list(c.reasons)} for f, c in r.cells.items()},
            }
            for r in runs
        ]
    }
