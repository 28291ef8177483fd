"""The kill matrix: which suites catch which catalog fault, measured by running them.

:func:`check` first runs every targeted suite once with no fault (the clean run, which must pass),
or takes the clean results from a JUnit report of a run that already ran them (``--clean-junit``:
CI's test run, so the check does not run the same tests twice, :func:`clean_from_junit`), then once
per fault, each in a fresh ``python -m pytest --inject-fault NAME`` subprocess (the
plugin puts the name in ``HARNESS_FAULTS``, so the adapter applies it at import, exactly as in a Ray
worker or a server), at most ``jobs`` at a time. Results are read from each run's JUnit XML, never from its output.

A fault is *caught* by a suite when a test of that suite passed in the clean run and fails or
errors with the fault; *missed* when none does; *broken* when the fault run itself could not run
(pytest's exit code is neither 0 nor 1: collection error, usage error, timeout), which counts as
not caught. Some faults must be caught by one suite in particular (:data:`REQUIRED`), e.g. the
unaligned tail with sglang's own assertion bypassed must be caught by the ledger checker.

Each fault runs only the suites it targets (:data:`TARGETS`, or a ``TARGETS`` dict in the fault's own
module, e.g. ``harness/faults/pd.py``); a fault declared nowhere runs :data:`DEFAULT_SUITES`. Paths
are relative to the repository root.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from harness import faults as fault_catalog
from harness import html_report, results
from harness.results import GroupResult

logger = logging.getLogger(__name__)

#: The repository root (parent of the ``harness`` package); subprocesses run here.
REPO_ROOT = Path(__file__).resolve().parents[2]

#: Suites a fault without a :data:`TARGETS` entry runs.
DEFAULT_SUITES: tuple[str, ...] = ("suites/unit",)

_LEDGER = "suites/unit/disaggregation/test_decode_prealloc_ledger.py"
_RESERVATION = "suites/unit/disaggregation/test_decode_reservation.py"
_RECLAIM = "suites/unit/disaggregation/test_decode_radix_swa_reclaim.py"
_HISPARSE = "suites/unit/mem_cache/test_hisparse_allocator.py"
# The PD pair over (simulated) Ray: decode steps and the P->D page transfer run only there.
_PD_BASIC = "suites/disaggregation/test_disaggregation_basic.py"

#: Fault name -> the suites (files or directories) it is checked against. Kept to fast CPU suites
#: so the check fits in CI; ``harness faults check --suite PATH`` runs every fault against others.
TARGETS: dict[str, tuple[str, ...]] = {
    "swa-tail-unaligned": (_LEDGER, _RESERVATION),
    "swa-tail-unaligned-noassert": (_LEDGER,),
    "release-leaks-swa": (_LEDGER,),
    "prealloc-no-swa-evict": (_RECLAIM,),
    "swa-full-length": (_LEDGER, _RESERVATION),
    "decode-reserve-unaligned": (_RESERVATION,),
    "hisparse-budget-swa": (_HISPARSE,),
    "decode-skips-swa-evict": (_PD_BASIC,),
    "corrupt-kv-page": (_PD_BASIC,),
}

#: Fault name -> the capabilities of the sglang target it needs (names in
#: ``harness.targets.sglang.compat.CAPABILITIES``): a fault rebuilt from one release's code, or
#: breaking a step a release does not have, cannot apply to a target lacking them. Such a fault is
#: reported not applicable (with the missing capability) and neither run nor counted.
NEEDS: dict[str, tuple[str, ...]] = {
    "swa-tail-unaligned": ("decode-prealloc-swa-tail",),
    "swa-tail-unaligned-noassert": ("decode-prealloc-swa-tail", "decode-prealloc-async-h2d"),
    "release-leaks-swa": ("free-kv-row-segments",),
    "prealloc-no-swa-evict": ("decode-radix-swa-reclaim",),
    "swa-full-length": ("decode-prealloc-swa-tail",),
    "decode-reserve-unaligned": ("decode-reservation",),
    "hisparse-budget-swa": ("hisparse-prealloc", "hisparse-device", "decode-swa-reservation"),
    "decode-skips-swa-evict": ("free-swa-out-of-window-slots",),
}

#: Fault name -> the suite that must be among its catchers (a claim the check verifies).
REQUIRED: dict[str, str] = {
    "swa-tail-unaligned-noassert": _LEDGER,  # sglang's assert is gone: the ledger checker must see it
}

#: Seconds one pytest subprocess may run before it is killed (and its run counted as broken).
DEFAULT_TIMEOUT_S = 900.0

CLEAN = "clean"
CAUGHT, MISSED, BROKEN, NOT_APPLICABLE = "caught", "missed", "broken", "n/a"
_FAILING = ("failed", "error")


@dataclass(frozen=True)
class TestOutcome:
    """One test case of a JUnit report.

    Attributes:
        test_id: ``path::name`` (``path::Class::name`` inside a class), like a pytest node id.
        file: the test file, relative to the repository root ("" for a collection error).
        outcome: ``passed``, ``failed``, ``error`` or ``skipped``.
        message: the failure / error message (first line), "" when it passed.
    """

    test_id: str
    file: str
    outcome: str
    message: str = ""


@dataclass(frozen=True)
class SuiteRun:
    """One pytest subprocess: the suites it ran, with or without a fault, and its results.

    Attributes:
        label: the fault name, or ``"clean"``.
        suites: the suite paths passed to pytest.
        returncode: pytest's exit code (-9 when killed at the timeout).
        outcomes: every test case of its JUnit report.
        wall_s: seconds it ran.
        junit: its JUnit XML file.
        log: its stdout + stderr.
    """

    label: str
    suites: tuple[str, ...]
    returncode: int
    outcomes: tuple[TestOutcome, ...]
    wall_s: float
    junit: Path
    log: Path

    @property
    def ran(self) -> bool:
        """pytest ran the tests to the end (exit 0: all passed, 1: some failed)."""
        return self.returncode in (0, 1)

    @property
    def passed(self) -> bool:
        """Every test passed (or was skipped) and at least one test ran."""
        return self.returncode == 0 and bool(self.outcomes)

    def failing(self) -> dict[str, TestOutcome]:
        """Failed or errored tests by id."""
        return {o.test_id: o for o in self.outcomes if o.outcome in _FAILING}


@dataclass(frozen=True)
class Cell:
    """One fault x suite entry of the matrix.

    Attributes:
        fault: the fault name.
        suite: the suite path (as targeted).
        status: ``caught``, ``missed`` or ``broken``.
        tests: the ids of the tests that caught it.
    """

    fault: str
    suite: str
    status: str
    tests: tuple[str, ...] = ()


@dataclass(frozen=True)
class Verdict:
    """One fault's overall result.

    Attributes:
        fault: the fault name.
        status: ``caught`` (by at least one suite, and by the required one), ``missed``, ``broken``, or
            ``n/a`` (the target lacks a capability the fault needs: not run, not counted).
        reason: why it is not caught ("" when caught).
    """

    fault: str
    status: str
    reason: str = ""


@dataclass(frozen=True)
class Matrix:
    """The whole check: the clean run, one run per fault, the cells and the verdicts.

    Attributes:
        clean: the clean run.
        runs: fault name -> its run (empty when the clean run failed).
        cells: fault x suite entries, in fault then suite order.
        verdicts: one per fault, in catalog order.
        wall_s: seconds the whole check took.
    """

    clean: SuiteRun
    runs: Mapping[str, SuiteRun] = field(default_factory=dict)
    cells: tuple[Cell, ...] = ()
    verdicts: tuple[Verdict, ...] = ()
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        """The clean run passed and every applicable fault was caught."""
        return self.clean.passed and all(v.status in (CAUGHT, NOT_APPLICABLE) for v in self.verdicts)


def targets_for(name: str) -> tuple[str, ...]:
    """The suites a fault is checked against.

    A fault module may declare its own faults' suites in a module-level ``TARGETS`` dict (name ->
    suite paths), so a new module needs no edit here; an entry in :data:`TARGETS` wins.

    Args:
        name: a fault name.

    Returns:
        Its :data:`TARGETS` entry, else its module's ``TARGETS`` entry, else :data:`DEFAULT_SUITES`.

    Raises:
        FaultError: an unknown fault name.
    """
    if name in TARGETS:
        return TARGETS[name]
    module = sys.modules.get(getattr(fault_catalog.get(name).make, "__module__", ""))
    declared = getattr(module, "TARGETS", None) or {}
    return tuple(declared.get(name, DEFAULT_SUITES))


# ------------------------------------------------------------------------------------- JUnit


def parse_junit(path: Path, root: Path = REPO_ROOT) -> tuple[TestOutcome, ...]:
    """Read the test cases of a pytest JUnit XML report through :func:`harness.results.read_junit`.

    Args:
        path: the XML file (``junit_family=xunit1``, which carries files).
        root: the directory test files are relative to.

    Returns:
        One :class:`TestOutcome` per test case; empty when the file is missing or not XML (a run
        killed before pytest wrote it).
    """
    try:
        cases = results.read_junit(path, root)
    except ValueError:
        return ()
    return tuple(TestOutcome(test_id=c.nodeid, file=c.file, outcome=c.outcome, message=c.message) for c in cases)


# ------------------------------------------------------------------------------------- running


def run_suites(label: str, suites: Iterable[str], out_dir: Path, *, fault: str | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S, root: Path = REPO_ROOT) -> SuiteRun:
    """Run suites in a fresh pytest subprocess, with ``fault`` active (or none), and read its JUnit XML.

    Args:
        label: names the run's files (``<out_dir>/junit/<label>.xml``, ``<out_dir>/workers/<label>.log``).
        suites: suite paths, relative to ``root``.
        out_dir: the run directory.
        fault: the fault to inject (``--inject-fault``); None runs clean. ``HARNESS_FAULTS`` is
            removed from the child's env either way, so the caller's cannot leak into a run.
        timeout_s: the run is killed (its whole process group) after this many seconds.
        root: where pytest runs.

    Returns:
        The :class:`SuiteRun`.
    """
    suites = tuple(suites)
    junit = out_dir / "junit" / f"{label}.xml"
    log = out_dir / "workers" / f"{label}.log"
    junit.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)
    # The fault goes in through the plugin's --inject-fault (it sets HARNESS_FAULTS for the session and
    # everything the tests start); a value inherited from the caller must not leak into any run.
    env = dict(os.environ)
    env.pop(fault_catalog.ENV_VAR, None)
    cmd = [sys.executable, "-m", "pytest", *suites, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "-o", "junit_family=xunit1", "--run-dir", str(out_dir / "pytest" / label)]
    if fault is not None:
        cmd += ["--inject-fault", fault]
    logger.info("run %s: %s", label, " ".join(cmd))
    start = time.monotonic()
    with open(log, "wb") as fh:
        # Own session so a timeout kills pytest and everything it started, and nothing else.
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.error("run %s passed its %.0f s limit; killing its process group", label, timeout_s)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = -signal.SIGKILL
    wall = time.monotonic() - start
    return SuiteRun(label=label, suites=suites, returncode=returncode, outcomes=parse_junit(junit, root),
                    wall_s=wall, junit=junit, log=log)


# ------------------------------------------------------------------------------------- matrix


def _in_suite(outcome: TestOutcome, suite: str) -> bool:
    suite = suite.rstrip("/")
    return outcome.file == suite or outcome.file.startswith(suite + "/")


def build_cells(name: str, suites: tuple[str, ...], clean: SuiteRun, run: SuiteRun) -> tuple[Cell, ...]:
    """The matrix row of one fault (pure).

    Args:
        name: the fault.
        suites: the suites it targeted.
        clean: the clean run.
        run: the fault's run.

    Returns:
        One :class:`Cell` per suite.
    """
    clean_passed = {o.test_id for o in clean.outcomes if o.outcome == "passed"}
    failing = run.failing()
    cells = []
    for suite in suites:
        if not run.ran:
            cells.append(Cell(name, suite, BROKEN))
            continue
        caught = tuple(sorted(t for t, o in failing.items() if t in clean_passed and _in_suite(o, suite)))
        cells.append(Cell(name, suite, CAUGHT if caught else MISSED, caught))
    return tuple(cells)


def verdict(name: str, cells: Iterable[Cell], run: SuiteRun) -> Verdict:
    """One fault's overall result (pure).

    Args:
        name: the fault.
        cells: its matrix row.
        run: its run.

    Returns:
        The :class:`Verdict`.
    """
    cells = list(cells)
    if not run.ran:
        return Verdict(name, BROKEN, f"pytest exited {run.returncode} (see {run.log})")
    catchers = {c.suite for c in cells if c.status == CAUGHT}
    if not catchers:
        return Verdict(name, MISSED, "no targeted suite failed")
    required = REQUIRED.get(name)
    if required and required not in catchers:
        return Verdict(name, MISSED, f"not caught by {required}, which must catch it")
    return Verdict(name, CAUGHT)


def _suite_group(suite: str) -> str:
    # Suites under one directory of suites/ share a process; e.g. the unit suites and the PD suites
    # run side by side (both pay their own imports; Ray start-up dominates the PD ones).
    return "/".join(Path(suite).parts[:2])


def run_clean(suites: tuple[str, ...], out_dir: Path, *, jobs: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S,
              root: Path = REPO_ROOT) -> SuiteRun:
    """The clean run of ``suites``: one subprocess per group of suites (:func:`_suite_group`), ``jobs``
    at a time, merged into one :class:`SuiteRun`.

    Args:
        suites: the suite paths.
        out_dir: the run directory.
        jobs: subprocesses at a time.
        timeout_s: limit of each subprocess.
        root: the repository root.

    Returns:
        The merged run: its outcomes are all groups' outcomes, its exit code 0 only when every
        group's was 0 (else the first non-zero one), its wall time the longest group's.
    """
    groups: dict[str, list[str]] = {}
    for suite in suites:
        groups.setdefault(_suite_group(suite), []).append(suite)
    if len(groups) <= 1:
        return run_suites(CLEAN, suites, out_dir, timeout_s=timeout_s, root=root)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        parts = list(pool.map(lambda item: run_suites(f"{CLEAN}-{item[0]}", tuple(item[1][1]), out_dir,
                                                      timeout_s=timeout_s, root=root), enumerate(groups.items())))
    failed = [p.returncode for p in parts if p.returncode != 0]
    return SuiteRun(label=CLEAN, suites=suites, returncode=failed[0] if failed else 0,
                    outcomes=tuple(o for p in parts for o in p.outcomes), wall_s=max(p.wall_s for p in parts),
                    junit=parts[0].junit.parent, log=parts[0].log.parent)


def clean_from_junit(path: Path, suites: tuple[str, ...], root: Path = REPO_ROOT) -> SuiteRun:
    """The clean run read from the JUnit XML (``junit_family=xunit1``) of a run that ran ``suites``.

    It passes when every suite has at least one passing test in the report and none of its tests
    failed; a suite the report does not cover fails it (its message names the suite).

    Args:
        path: the JUnit XML of an earlier pytest run (e.g. CI's ``./dev test``).
        suites: the suites the faults target.
        root: the repository root (test files in the report are relative to it).

    Returns:
        A :class:`SuiteRun` labelled ``clean`` holding the suites' outcomes (wall time 0).
    """
    outcomes = tuple(o for o in parse_junit(path, root) if any(_in_suite(o, s) for s in suites))
    missing = [s for s in suites if not any(_in_suite(o, s) and o.outcome == "passed" for o in outcomes)]
    failing = any(o.outcome in _FAILING for o in outcomes)
    if missing:
        logger.error("%s has no passing test of %s: run them there, or drop --clean-junit", path, ", ".join(missing))
    return SuiteRun(label=CLEAN, suites=suites, returncode=1 if (missing or failing) else 0,
                    outcomes=outcomes if not missing else (), wall_s=0.0, junit=path, log=path)


def target_lacks(names: Iterable[str], *, root: Path = REPO_ROOT,
                 timeout_s: float = 300.0) -> dict[str, str]:
    """Which faults cannot apply to the sglang target this process selected, and why.

    The capabilities are probed in one subprocess (probing imports sglang; the caller does not need
    it), which inherits the target through ``HARNESS_SGLANG`` / ``PYTHONPATH``.

    Args:
        names: fault names.
        root: the repository root.
        timeout_s: limit of the probe.

    Returns:
        Fault name -> one line naming the missing capability, for the faults that do not apply.

    Raises:
        RuntimeError: the probe itself failed (the target does not import).
    """
    wanted = {n: NEEDS.get(n, ()) for n in names}
    caps = sorted({c for needs in wanted.values() for c in needs})
    if not caps:
        return {}
    code = ("import json, sys; from harness.targets.sglang import compat, target; target.current(); "
            "print(json.dumps({c: compat.missing(c) for c in sys.argv[1:]}))")
    env = {k: v for k, v in os.environ.items() if k != fault_catalog.ENV_VAR}
    done = subprocess.run([sys.executable, "-c", code, *caps], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"probing the sglang target's capabilities failed: {tail}")
    missing = json.loads(done.stdout.strip().splitlines()[-1])
    out = {}
    for name, needs in wanted.items():
        lacking = [f"{c} ({missing[c]})" for c in needs if missing.get(c)]
        if lacking:
            out[name] = "the sglang target lacks " + "; ".join(lacking)
    return out


def check(names: Iterable[str] | None = None, *, suites: tuple[str, ...] | None = None, out_dir: Path,
          jobs: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S, root: Path = REPO_ROOT,
          clean_junit: Path | None = None) -> Matrix:
    """Run the clean run, then every fault against its suites, and build the kill matrix.

    Args:
        names: the faults to check (default: the whole catalog, in catalog order).
        suites: run every fault against these suites instead of its :data:`TARGETS`.
        out_dir: the run directory (``junit/`` and ``workers/`` logs go there).
        jobs: fault runs at a time.
        timeout_s: limit of each pytest subprocess.
        root: the repository root.
        clean_junit: take the clean run from this JUnit report instead of running it (:func:`clean_from_junit`).

    Returns:
        The :class:`Matrix`; its ``runs`` is empty when the clean run did not pass.

    Raises:
        FaultError: an unknown fault name.
    """
    start = time.monotonic()
    names = list(fault_catalog.catalog()) if names is None else [fault_catalog.get(n).name for n in names]
    lacks = target_lacks(names, root=root)
    for name, reason in lacks.items():
        logger.warning("fault %s does not apply: %s", name, reason)
    every, names = names, [n for n in names if n not in lacks]
    plan = {name: (suites if suites is not None else targets_for(name)) for name in names}
    union = tuple(dict.fromkeys(s for targeted in plan.values() for s in targeted))
    if clean_junit is not None:
        clean = clean_from_junit(clean_junit, union, root)
    else:
        clean = run_clean(union, out_dir, jobs=jobs, timeout_s=timeout_s, root=root)
    if not clean.passed:
        logger.error("clean run failed (exit %d); faults not run", clean.returncode)
        return Matrix(clean=clean, wall_s=time.monotonic() - start)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {name: pool.submit(run_suites, name, plan[name], out_dir, fault=name, timeout_s=timeout_s, root=root)
                   for name in names}
        runs = {name: future.result() for name, future in futures.items()}
    cells: list[Cell] = []
    verdicts = []
    for name in every:
        if name in lacks:
            verdicts.append(Verdict(name, NOT_APPLICABLE, lacks[name]))
            continue
        row = build_cells(name, plan[name], clean, runs[name])
        cells.extend(row)
        verdicts.append(verdict(name, row, runs[name]))
    return Matrix(clean=clean, runs=runs, cells=tuple(cells), verdicts=tuple(verdicts), wall_s=time.monotonic() - start)


# ------------------------------------------------------------------------------------- output


def to_dict(matrix: Matrix) -> dict[str, Any]:
    """The matrix as JSON-able data.

    Args:
        matrix: the result of :func:`check`.

    Returns:
        ``{"ok", "wall_s", "clean": {...}, "faults": [{"name", "upstream", "status", "reason",
        "wall_s", "suites": [{"suite", "status", "tests"}]}]}``.
    """
    known = fault_catalog.catalog()
    cells_by_fault: dict[str, list[Cell]] = {}
    for cell in matrix.cells:
        cells_by_fault.setdefault(cell.fault, []).append(cell)

    def run_dict(run: SuiteRun) -> dict[str, Any]:
        return {"returncode": run.returncode, "wall_s": round(run.wall_s, 1), "tests": len(run.outcomes),
                "failing": sorted(run.failing()), "junit": str(run.junit), "log": str(run.log)}

    return {
        "ok": matrix.ok,
        "wall_s": round(matrix.wall_s, 1),
        "clean": {"passed": matrix.clean.passed, "suites": list(matrix.clean.suites), **run_dict(matrix.clean)},
        "faults": [
            {"name": v.fault, "upstream": known[v.fault].upstream if v.fault in known else "",
             "status": v.status, "reason": v.reason,
             "wall_s": round(matrix.runs[v.fault].wall_s, 1) if v.fault in matrix.runs else 0.0,
             "suites": [{"suite": c.suite, "status": c.status, "tests": list(c.tests)}
                        for c in cells_by_fault.get(v.fault, [])]}
            for v in matrix.verdicts
        ],
    }


def render(matrix: Matrix) -> str:
    """The matrix as text: one block per fault, one line per targeted suite with the catching tests.

    Args:
        matrix: the result of :func:`check`.

    Returns:
        Lines for a terminal (no trailing newline).
    """
    clean = matrix.clean
    lines = [f"clean run: {'passed' if clean.passed else 'FAILED'} ({len(clean.outcomes)} tests, "
             f"exit {clean.returncode}, {clean.wall_s:.0f} s) {' '.join(clean.suites)}"]
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
        if v.status == NOT_APPLICABLE:
            lines.append(f"{v.fault:<{width}}  {'N/A':<6}  {v.reason}")
            continue
        run = matrix.runs[v.fault]
        head = f"{v.fault:<{width}}  {v.status.upper():<6}  ({run.wall_s:.0f} s)"
        lines.append(head + (f"  {v.reason}" if v.reason else ""))
        for cell in cells_by_fault.get(v.fault, []):
            lines.append(f"  {cell.status:<6} {cell.suite}")
            lines.extend(f"           {t.split('::', 1)[-1]}" for t in cell.tests)
    caught = sum(v.status == CAUGHT for v in matrix.verdicts)
    counted = sum(v.status != NOT_APPLICABLE for v in matrix.verdicts)
    na = len(matrix.verdicts) - counted
    lines.append(f"{caught}/{counted} faults caught{f' ({na} not applicable to this target)' if na else ''}; "
                 f"wall time {matrix.wall_s:.0f} s")
    return "\n".join(lines)


def page_table(matrix: Matrix) -> html_report.Table:
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
        rows.append((v.fault, known[v.fault].upstream if v.fault in known else "", v.status + (f": {v.reason}" if v.reason else ""),
                     *cells))
        status.append("ok" if v.status == CAUGHT else "bad")
    clean = matrix.clean
    note = (f"clean run {'passed' if clean.passed else 'FAILED'} ({len(clean.outcomes)} tests, exit {clean.returncode}); "
            f"a fault is caught by a suite when one of its tests passed clean and fails with the fault")
    if not clean.passed:
        note += "; faults not run: the clean run must pass first"
    return html_report.Table("Fault × suite", ("fault", "upstream", "verdict", *suites), tuple(rows), tuple(status), note)


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
    labels = sorted((p.stem for p in (out_dir / "junit").glob("*.xml")),
                    key=lambda s: (s not in runs and not s.startswith(CLEAN), list(runs).index(s) if s in runs else 0, s))
    groups = []
    for label in labels:
        try:
            cases = tuple(results.read_junit(out_dir / "junit" / f"{label}.xml", root))
        except ValueError as e:
            cases, note = (), str(e)
        else:
            note = ""
        run = runs.get(label)
        failing = any(c.outcome in _FAILING for c in cases)
        code = run.returncode if run is not None else (1 if failing else 0)
        what = "clean run" if label.startswith(CLEAN) else f"with fault {label} (a failing test caught it)"
        groups.append(GroupResult(name=label, topology="per test", runner=what, cases=cases,
                                  wall_time=run.wall_s if run is not None else matrix.clean.wall_s, returncode=code,
                                  note=note or ("" if code in (0, 1) else f"pytest exited {code}"),
                                  properties=(("run_dir", str(out_dir / "pytest" / label)),
                                              ("log", str(out_dir / "workers" / f"{label}.log")))))
    return groups


def write_page(matrix: Matrix, out_dir: Path, root: Path = REPO_ROOT) -> Path:
    """Write the check's HTML page, ``out_dir/report/index.html`` (:mod:`harness.html_report`).

    Args:
        matrix: the result of :func:`check`.
        out_dir: the check's run directory.
        root: the repository root.

    Returns:
        The page's path.
    """
    reasons = [f"{v.fault}: {v.status}" + (f" ({v.reason})" if v.reason else "") for v in matrix.verdicts if v.status != CAUGHT]
    if not matrix.clean.passed:
        reasons.insert(0, f"the clean run failed (exit {matrix.clean.returncode}); faults not run")
    header = html_report.Header("faults check", matrix.ok, tuple(reasons), wall_time=matrix.wall_s)
    return html_report.write(out_dir / "report", header, page_groups(matrix, out_dir, root), [page_table(matrix)], repo_root=root)
