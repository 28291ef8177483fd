"""The kill matrix for people and tools: JSON, a text table, the run page's fault × suite table and
its groups (every fault run's JUnit results and logs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import faults as fault_catalog
from harness.faultcheck.verdicts import CAUGHT, CLEAN, FAILING, NOT_APPLIED, Cell, Matrix, SuiteRun, Verdict
from harness.report import junit, page
from harness.report.results import GroupResult
from harness.rundir import REPO_ROOT, RunDir
from harness.targets.sglang import selection


def to_dict(matrix: Matrix) -> dict[str, Any]:
    """The matrix as JSON-able data.

    Args:
        matrix: the result of :func:`check`.

    Returns:
        ``{"ok", "wall_s", "clean": {...}, "faults": [{"name", "upstream", "evidence", "status", "reason",
        "fired", "wall_s", "suites": [{"suite", "status", "tests", "reason", "by_sglang_check"}]}]}``
        (``by_sglang_check``: the failing tests one of sglang's own checks raised or agreed with).
    """
    known = fault_catalog.catalog()
    cells_by_fault: dict[str, list[Cell]] = {}
    for cell in matrix.cells:
        cells_by_fault.setdefault(cell.fault, []).append(cell)

    def run_dict(run: SuiteRun) -> dict[str, Any]:
        return {
            "returncode": run.returncode,
            "wall_s": round(run.wall_s, 1),
            "tests": len(run.outcomes),
            "failing": sorted(run.failing()),
            "junit": str(run.junit),
            "log": str(run.log),
        }

    def fault_dict(v: Verdict) -> dict[str, Any]:
        run = matrix.runs.get(v.fault)
        fault = known.get(v.fault)
        return {
            "name": v.fault,
            "upstream": fault.upstream if fault else "",
            "evidence": list(fault.evidence) if fault else [],
            "status": v.status,
            "reason": v.reason,
            "fired": bool(run and v.fault in run.fired),
            "wall_s": round(run.wall_s, 1) if run else 0.0,
            "suites": [
                {
                    "suite": c.suite,
                    "status": c.status,
                    "tests": list(c.tests),
                    "reason": c.reason,
                    "by_sglang_check": list(c.by_sglang),
                }
                for c in cells_by_fault.get(v.fault, [])
            ],
        }

    return {
        "ok": matrix.ok,
        "wall_s": round(matrix.wall_s, 1),
        "clean": {"passed": matrix.clean.passed, "suites": list(matrix.clean.suites), **run_dict(matrix.clean)},
        "faults": [fault_dict(v) for v in matrix.verdicts],
    }


def render(matrix: Matrix) -> str:
    """The matrix as text: one block per fault, one line per suite with the catching tests.

    Args:
        matrix: the result of :func:`check`.

    Returns:
        Lines for a terminal (no trailing newline).
    """
    clean = matrix.clean
    lines = [
        f"clean run: {'passed' if clean.passed else 'FAILED'} ({len(clean.outcomes)} tests, "
        f"exit {clean.returncode}, {clean.wall_s:.0f} s) {' '.join(clean.suites)}"
    ]
    if not clean.passed:
        lines += [f"  {t}: {o.message}" for t, o in sorted(clean.failing().items())]
        lines.append(f"  log: {clean.log}")
        lines.append("faults not run: the clean run must pass first")
        return "\n".join(lines)
    cells_by_fault: dict[str, list[Cell]] = {}
    for cell in matrix.cells:
        cells_by_fault.setdefault(cell.fault, []).append(cell)
    width = max(len(v.fault) for v in matrix.verdicts) if matrix.verdicts else 0
    for v in matrix.verdicts:
        run = matrix.runs.get(v.fault)
        took = f"({run.wall_s:.0f} s)" if run else ""
        head = f"{v.fault:<{width}}  {v.status.upper():<11} {took}"
        lines.append(head + (f"  {v.reason}" if v.reason else ""))
        for cell in cells_by_fault.get(v.fault, []):
            lines.append(f"  {cell.status:<6} {cell.suite}" + (f"  ({cell.reason})" if cell.reason else ""))
            if cell.status == CAUGHT:
                lines.extend(f"           {t.split('::', 1)[-1]}" for t in cell.tests)
            if cell.by_sglang:
                lines.append(
                    f"           (sglang's own checks raised or agreed with {len(cell.by_sglang)} failing test(s))"
                )
    counted = [v for v in matrix.verdicts if v.status != NOT_APPLIED]
    caught = sum(v.status == CAUGHT for v in counted)
    lines.append(
        f"{caught}/{len(counted)} faults caught ({len(matrix.verdicts) - len(counted)} not applied); "
        f"wall time {matrix.wall_s:.0f} s"
    )
    return "\n".join(lines)


def table(matrix: Matrix) -> str:
    """The fault x suite table in markdown: one row per fault, one column per suite file run,
    each cell ``caught`` / ``missed`` / ``broken`` / ``n/a`` (``not run`` where the fault's
    selection left that suite out).

    Args:
        matrix: the result of :func:`check`.

    Returns:
        The table (no trailing newline).
    """
    suites = list(dict.fromkeys(c.suite for c in matrix.cells))
    by = {(c.fault, c.suite): c.status for c in matrix.cells}
    short = [Path(s).stem.removeprefix("test_") for s in suites]
    lines = ["| fault | verdict | " + " | ".join(short) + " |", "|---|---|" + "---|" * len(suites)]
    for v in matrix.verdicts:
        row = [by.get((v.fault, s), "not run") for s in suites]
        lines.append(f"| {v.fault} | {v.status} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def page_table(matrix: Matrix) -> page.Table:
    """The fault × suite table of the run's HTML page: one row per fault, one column per suite.

    Args:
        matrix: the result of :func:`check`.

    Returns:
        The table (cells: ``caught (N)``, ``missed``, ``broken``, blank where the fault does not target the suite).
    """
    suites = list(dict.fromkeys(c.suite for c in matrix.cells))
    known = fault_catalog.catalog()
    by = {(c.fault, c.suite): c for c in matrix.cells}
    rows, status = [], []
    for v in matrix.verdicts:
        cells = []
        for s in suites:
            c = by.get((v.fault, s))
            cells.append("" if c is None else f"{c.status} ({len(c.tests)})" if c.tests else c.status)
        rows.append(
            (
                v.fault,
                known[v.fault].upstream if v.fault in known else "",
                v.status + (f": {v.reason}" if v.reason else ""),
                *cells,
            )
        )
        status.append("ok" if v.status == CAUGHT else "bad")
    clean = matrix.clean
    note = (
        f"clean run {'passed' if clean.passed else 'FAILED'} ({len(clean.outcomes)} tests, exit {clean.returncode}); "
        f"a fault is caught by a suite when its code ran and a test that passed clean fails in its body "
        f"with the evidence the fault names"
    )
    if not clean.passed:
        note += "; faults not run: the clean run must pass first"
    return page.Table("Fault × suite", ("fault", "upstream", "verdict", *suites), tuple(rows), tuple(status), note)


def page_groups(matrix: Matrix, out_dir: Path, root: Path = REPO_ROOT) -> list[GroupResult]:
    """The runs of a check as groups of the HTML page: one per JUnit report under ``out_dir/junit``.

    Each group's run directory is the run's ``out_dir/pytest/<label>`` (its test records, worker
    logs and ledgers); its log is ``out_dir/workers/<label>.log``.

    Args:
        matrix: the result of :func:`check`.
        out_dir: the check's run directory.
        root: the repository root (test files are relative to it).

    Returns:
        The clean run's parts first, then one group per fault run, in catalog order.
    """
    runs = {CLEAN: matrix.clean, **matrix.runs}
    labels = sorted(
        (p.stem for p in RunDir(out_dir).junit.glob("*.xml")),
        key=lambda s: (s not in runs and not s.startswith(CLEAN), list(runs).index(s) if s in runs else 0, s),
    )
    groups = []
    for label in labels:
        try:
            cases = tuple(junit.read_junit(RunDir(out_dir).junit_file(label), root))
        except ValueError as e:
            cases, note = (), str(e)
        else:
            note = ""
        run = runs.get(label)
        failing = any(c.outcome in FAILING for c in cases)
        code = run.returncode if run is not None else (1 if failing else 0)
        what = "clean run" if label.startswith(CLEAN) else f"with fault {label} (a failing test caught it)"
        groups.append(
            GroupResult(
                name=label,
                topology="per test",
                runner=what,
                cases=cases,
                wall_time=run.wall_s if run is not None else matrix.clean.wall_s,
                returncode=code,
                note=note or ("" if code in (0, 1) else f"pytest exited {code}"),
                properties=(
                    ("run_dir", str(out_dir / "pytest" / label)),
                    ("log", str(RunDir(out_dir).worker_log(label))),
                ),
            )
        )
    return groups


def write_page(matrix: Matrix, out_dir: Path, root: Path = REPO_ROOT) -> Path:
    """Write the check's HTML page, ``out_dir/report/index.html`` (:mod:`harness.report.page`).

    Args:
        matrix: the result of :func:`check`.
        out_dir: the check's run directory.
        root: the repository root.

    Returns:
        The page's path.
    """
    reasons = [
        f"{v.fault}: {v.status}" + (f" ({v.reason})" if v.reason else "") for v in matrix.verdicts if v.status != CAUGHT
    ]
    if not matrix.clean.passed:
        reasons.insert(0, f"the clean run failed (exit {matrix.clean.returncode}); faults not run")
    header = page.Header("faults check", matrix.ok, tuple(reasons), wall_time=matrix.wall_s, sglang=selection.stamp())
    return page.write(
        RunDir(out_dir).report, header, page_groups(matrix, out_dir, root), [page_table(matrix)], repo_root=root
    )
