"""The kill matrix: which suites catch which catalog fault, measured by running them.

:func:`check` first runs every selected suite once with no fault (the clean run, which must pass),
or takes the clean results from a JUnit report of a run that already ran them (``--clean-junit``:
CI's test run, so the check does not run the same tests twice, :func:`clean_from_junit`), then once
per fault, each in a fresh ``python -m pytest --inject-fault NAME`` subprocess (the plugin builds the
patched sglang copy and puts it first on the import path of every process the run starts, or
applies a runtime fault), at most ``jobs`` at a time. Results are read from each run's JUnit XML,
never from its output; a fault's marker lines (env ``HARNESS_FAULT_FIRED``) say whether its broken
code ran.

Per fault and suite file (a *cell*):

* ``caught``: a test that passed in the clean run *failed in its body* with one of the fault's
  expected evidence strings (:attr:`harness.faults.Fault.evidence`) in its report;
* ``broken``: no test caught it, but a test failed with other evidence (a different exception,
  sglang's own assert), errored outside its body (setup / teardown), or the run did not finish;
* ``missed``: every selected test passed;
* ``n/a``: the suite was not run for this fault, or every selected test skipped.

A fault is ``caught`` when its code ran (a marker fired) and a cell caught it; ``broken`` when its
code never ran, or no cell caught it and one is broken; ``missed`` otherwise; ``not-applied`` when its
patch does not apply to the target (said, run nowhere, and not counted). Each fault runs its
catalog selections (``Fault.suites``, the smallest that carry the evidence) unless the caller names
suites (``--suite``, or ``--all`` for every suite that asserts accounting: :data:`ACCOUNTING_SUITES`).
Paths are relative to the repository root.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from harness import faults as fault_catalog
from harness.faults import source
from harness.report import page, results
from harness.report.results import GroupResult
from harness.rundir import REPO_ROOT
from harness.targets.sglang import preload, selection
from harness.workers import procs

logger = logging.getLogger(__name__)

#: The repository root (parent of the ``harness`` package); subprocesses run here.


#: Every suite that asserts accounting (``harness faults check --all``): the unit sweep, ledger,
#: reservation, reclaim and hisparse suites, the in-worker run of the unit suites, the PD pair and
#: e2e suites over Ray, and the real-server suites (the DeepSeek-V4 one needs GPUs: n/a elsewhere).
ACCOUNTING_SUITES: tuple[str, ...] = (
    "suites/unit/disaggregation/test_swa_prealloc_accounting.py",
    "suites/unit/disaggregation/test_decode_prealloc_ledger.py",
    "suites/unit/disaggregation/test_decode_reservation.py",
    "suites/unit/disaggregation/test_decode_radix_swa_reclaim.py",
    "suites/unit/mem_cache/test_hisparse_allocator.py",
    "suites/unit/test_in_ray_worker.py",
    "suites/disaggregation/test_disaggregation_basic.py",
    "suites/disaggregation/test_disaggregation_dsv4.py",
    "suites/e2e/test_swa_accounting.py",
    "suites/disaggregation/test_disaggregation_basic_server.py",
    "suites/disaggregation/test_disaggregation_swa_server.py",
    "suites/disaggregation/test_disaggregation_dsv4_server.py",
)

#: Fault name -> the capabilities of the sglang target it needs (names in
#: ``harness.targets.sglang.compat.CAPABILITIES``): a fault breaking a step a release does not have,
#: or whose suites cannot run on this device for that release, cannot apply to a target lacking them.
#: Such a fault is reported not applied (with the missing capability) and neither run nor counted;
#: a patch that does not apply to the target's source is reported the same way.
NEEDS: dict[str, tuple[str, ...]] = {
    "swa-tail-unaligned": ("decode-prealloc-swa-tail",),
    "swa-tail-short": ("decode-prealloc-swa-tail",),
    "release-leaks-swa": ("free-kv-row-segments",),
    "prealloc-no-swa-evict": ("decode-radix-swa-reclaim",),
    "swa-full-length": ("decode-prealloc-swa-tail",),
    "decode-reserve-unaligned": ("decode-reservation",),
    "hisparse-budget-swa": ("hisparse-prealloc", "hisparse-device", "decode-swa-reservation"),
    "decode-skips-swa-evict": ("free-swa-out-of-window-slots",),
}

#: Seconds one pytest subprocess may run before it is killed (and its run counted as broken).
DEFAULT_TIMEOUT_S = 900.0
#: How long a check waits for the process writing its clean report (``clean_writer``) to finish.
CLEAN_WRITER_TIMEOUT_S = 3600.0
#: Hypothesis and workload seeds of every run, so the sweep draws the same cases and the PD suites
#: the same workloads, clean and broken.
HYPOTHESIS_SEED = 0
WORKLOAD_SEED = 0

CLEAN = "clean"
CAUGHT, MISSED, BROKEN, NOT_APPLICABLE, NOT_APPLIED = "caught", "missed", "broken", "n/a", "not-applied"
_FAILING = ("failed", "error")


@dataclass(frozen=True)
class TestOutcome:
    """One test case of a JUnit report.

    Attributes:
        test_id: ``path::name`` (``path::Class::name`` inside a class), like a pytest node id.
        file: the test file, relative to the repository root ("" for a collection error).
        outcome: ``passed``, ``failed`` (in the test body), ``error`` (setup, teardown,
            collection) or ``skipped``.
        message: the failure / error message (first line), "" when it passed.
        text: the whole message and traceback, where the evidence is looked for.
    """

    test_id: str
    file: str
    outcome: str
    message: str = ""
    text: str = ""


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
        fired: the fault names its marker lines wrote (empty for the clean run).
    """

    label: str
    suites: tuple[str, ...]
    returncode: int
    outcomes: tuple[TestOutcome, ...]
    wall_s: float
    junit: Path
    log: Path
    fired: frozenset[str] = frozenset()

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
        suite: the suite file.
        status: ``caught``, ``missed``, ``broken`` or ``n/a``.
        tests: the ids of the tests that caught it (broken: the tests that failed otherwise).
        reason: for ``broken``, the first such test's message.
    """

    fault: str
    suite: str
    status: str
    tests: tuple[str, ...] = ()
    reason: str = ""


@dataclass(frozen=True)
class Verdict:
    """One fault's overall result.

    Attributes:
        fault: the fault name.
        status: ``caught``, ``missed``, ``broken`` or ``not-applied`` (see the module docstring).
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
        """The clean run passed, no fault was missed or broken, and at least one was caught
        (a patch that does not apply to the target is said and not counted)."""
        counted = [v for v in self.verdicts if v.status != NOT_APPLIED]
        return self.clean.passed and bool(counted) and all(v.status == CAUGHT for v in counted)


def targets_for(name: str) -> tuple[str, ...]:
    """The selections a fault is checked against: its catalog entry's ``suites``.

    Args:
        name: a fault name.

    Returns:
        Node ids or files, relative to the repository root.

    Raises:
        FaultError: an unknown fault name, or one that names no suite.
    """
    fault = fault_catalog.get(name)
    if not fault.suites:
        raise fault_catalog.FaultError(f"fault {name} names no suite that carries its evidence; add Fault.suites")
    return fault.suites


def suite_file(selection: str) -> str:
    """The file (or directory) part of a selection (``path::test[id]`` -> ``path``)."""
    return selection.split("::", 1)[0].rstrip("/")


# ------------------------------------------------------------------------------------- JUnit


def parse_junit(path: Path, root: Path = REPO_ROOT) -> tuple[TestOutcome, ...]:
    """Read the test cases of a pytest JUnit XML report through :func:`harness.report.results.read_junit`.

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
    # the evidence is looked for in the whole message and traceback, not only the first line
    return tuple(TestOutcome(test_id=c.nodeid, file=c.file, outcome=c.outcome, message=c.message,
                             text=f"{c.reason}\n{c.traceback}") for c in cases)


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
    fired_file = out_dir / "fired" / f"{label}.txt"
    fired_file.parent.mkdir(parents=True, exist_ok=True)
    fired_file.unlink(missing_ok=True)
    env[source.FIRED_ENV] = str(fired_file)
    cmd = [sys.executable, "-m", "pytest", *suites, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "-o", "junit_family=xunit1", "--run-dir", str(out_dir / "pytest" / label),
           f"--hypothesis-seed={HYPOTHESIS_SEED}", f"--workload-seed={WORKLOAD_SEED}"]
    if fault is not None:
        cmd += ["--inject-fault", fault]
    logger.info("run %s: %s", label, " ".join(cmd))
    start = time.monotonic()
    # One OpenMP / BLAS thread (the runs go side by side, and beside the tests in CI), started as a fork
    # of an interpreter that imported sglang's third-party graph; each imports sglang (patched or not) itself.
    argv, env = preload.python_command(cmd, env)
    returncode, timed_out = procs.run_logged(argv, cwd=root, env=env, log=log, timeout_s=timeout_s)
    if timed_out:
        logger.error("run %s passed its %.0f s limit; its process group was killed", label, timeout_s)
    wall = time.monotonic() - start
    return SuiteRun(label=label, suites=suites, returncode=returncode, outcomes=parse_junit(junit, root),
                    wall_s=wall, junit=junit, log=log, fired=frozenset(source.fired(fired_file)))


# ------------------------------------------------------------------------------------- matrix


def _in_suite(outcome: TestOutcome, suite: str) -> bool:
    suite = suite_file(suite)
    return outcome.file == suite or outcome.file.startswith(suite + "/")


def has_evidence(outcome: TestOutcome, evidence: Iterable[str]) -> bool:
    """Whether a failing test's report shows one of the expected evidence strings."""
    return any(e in outcome.text or e in outcome.message for e in evidence)


def build_cells(name: str, suites: tuple[str, ...], clean: SuiteRun, run: SuiteRun,
                evidence: tuple[str, ...] = ()) -> tuple[Cell, ...]:
    """The matrix row of one fault, one cell per suite file (pure; see the module docstring).

    Args:
        name: the fault.
        suites: the selections it ran (node ids or files).
        clean: the clean run.
        run: the fault's run.
        evidence: what a catch must show (default: the fault's catalog entry).

    Returns:
        One :class:`Cell` per suite file, in first-selected order.
    """
    evidence = evidence or fault_catalog.get(name).evidence
    clean_passed = {o.test_id for o in clean.outcomes if o.outcome == "passed"}
    cells = []
    for suite in dict.fromkeys(suite_file(s) for s in suites):
        mine = [o for o in run.outcomes if _in_suite(o, suite)]
        if not run.ran:
            cells.append(Cell(name, suite, BROKEN, reason=f"pytest exited {run.returncode}"))
            continue
        counted = [o for o in mine if o.test_id in clean_passed]
        caught = tuple(sorted(o.test_id for o in counted if o.outcome == "failed" and has_evidence(o, evidence)))
        other = [o for o in counted if o.outcome in _FAILING and o.test_id not in caught]
        if caught:
            cells.append(Cell(name, suite, CAUGHT, caught))
        elif other:
            first = other[0]
            where = "errored outside the test body" if first.outcome == "error" else "failed without the evidence"
            cells.append(Cell(name, suite, BROKEN, tuple(o.test_id for o in other),
                              f"{first.test_id} {where}: {first.message}"))
        elif counted:
            cells.append(Cell(name, suite, MISSED))
        else:
            cells.append(Cell(name, suite, NOT_APPLICABLE, reason="no test of it ran (all skipped)"))
    return tuple(cells)


def verdict(name: str, cells: Iterable[Cell], run: SuiteRun) -> Verdict:
    """One fault's overall result (pure; see the module docstring).

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
    if name not in run.fired:
        return Verdict(name, BROKEN, "its broken code never ran (no marker fired): the selection does not reach it")
    if any(c.status == CAUGHT for c in cells):
        return Verdict(name, CAUGHT)
    broken = [c for c in cells if c.status == BROKEN]
    if broken:
        return Verdict(name, BROKEN, broken[0].reason)
    return Verdict(name, MISSED, "no selected test failed with the expected evidence")


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


def _clean_when_written(path: Path | None, writer: tuple[int, int | None] | None, suites: tuple[str, ...],
                        root: Path) -> SuiteRun:
    """The clean run from ``path`` once process ``writer`` (pid, start time) has exited (a missing
    report fails it)."""
    assert path is not None and writer is not None
    pid, start = writer
    logger.info("waiting for process %d to finish the clean report %s", pid, path)
    # No start time: it was gone before the check began.
    left = procs.wait_gone([pid], CLEAN_WRITER_TIMEOUT_S, {pid: start}) if start is not None else []
    if left or not path.is_file():
        why = (f"process {pid} still runs after {CLEAN_WRITER_TIMEOUT_S:.0f} s" if left
               else f"process {pid} exited without writing it")
        logger.error("no clean report at %s: %s", path, why)
        return SuiteRun(label=CLEAN, suites=suites, returncode=1, outcomes=(), wall_s=0.0, junit=path, log=path)
    return clean_from_junit(path, suites, root)


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
    code = ("import json, sys; from harness.targets.sglang import compat, selection; selection.current(); "
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
          clean_junit: Path | None = None, clean_writer: int | None = None, tree: Path | None = None) -> Matrix:
    """Run the clean run, then every fault against its suites, and build the kill matrix.

    Args:
        names: the faults to check (default: the whole catalog, in catalog order).
        suites: run every fault against these selections instead of its catalog ``suites``.
        out_dir: the run directory (``junit/``, ``workers/`` logs and ``fired/`` markers go there).
        jobs: fault runs at a time.
        timeout_s: limit of each pytest subprocess.
        root: the repository root.
        clean_junit: take the clean run from this JUnit report instead of running it (:func:`clean_from_junit`).
        clean_writer: the pid of the process still writing ``clean_junit`` (the test run beside this
            check): the fault runs start at once, and the report is read once that process has
            exited (waiting at most :data:`CLEAN_WRITER_TIMEOUT_S`).
        tree: the target's directory holding ``sglang`` (default: the selected target's).

    Returns:
        The :class:`Matrix`; its ``runs`` is empty when the clean run did not pass.

    Raises:
        FaultError: an unknown fault name.
    """
    start = time.monotonic()
    tree = tree if tree is not None else selection.sglang_root().resolve()
    names = list(fault_catalog.catalog()) if names is None else [fault_catalog.get(n).name for n in names]
    not_applied: dict[str, str] = dict(target_lacks(names, root=root))
    for name in names:
        if name not in not_applied and fault_catalog.get(name).is_patch:
            errors = source.patch_errors(name, tree)
            if errors:
                not_applied[name] = "; ".join(errors)
                logger.warning("fault %s does not apply to the target: %s", name, not_applied[name])
    plan = {name: (suites if suites is not None else targets_for(name)) for name in names if name not in not_applied}
    union = tuple(dict.fromkeys(s for targeted in plan.values() for s in targeted))
    clean: SuiteRun | None = None
    # The writer is known by pid and start time: a pid reused by another process is not waited on.
    writer = (clean_writer, procs.start_time(clean_writer)) if clean_writer is not None else None
    if clean_junit is not None and clean_writer is None:
        clean = clean_from_junit(clean_junit, union, root)
    elif clean_junit is None:
        clean = run_clean(union, out_dir, jobs=jobs, timeout_s=timeout_s, root=root)
    if clean is not None and not clean.passed:
        logger.error("clean run failed (exit %d); faults not run", clean.returncode)
        return Matrix(clean=clean, wall_s=time.monotonic() - start)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {name: pool.submit(run_suites, name, plan[name], out_dir, fault=name, timeout_s=timeout_s, root=root)
                   for name in plan}
        if clean is None:  # the fault runs need nothing of the clean run: it is read while they run
            clean = _clean_when_written(clean_junit, writer, union, root)
        runs = {name: future.result() for name, future in futures.items()}
    if not clean.passed:
        logger.error("clean run failed (exit %d); faults ran but are not judged", clean.returncode)
        return Matrix(clean=clean, wall_s=time.monotonic() - start)
    cells: list[Cell] = []
    verdicts = []
    for name in names:
        if name in not_applied:
            reason = not_applied[name]
            verdicts.append(Verdict(name, NOT_APPLIED, reason if reason.startswith("the sglang target lacks")
                                    else f"patch does not apply: {reason}"))
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
        ``{"ok", "wall_s", "clean": {...}, "faults": [{"name", "upstream", "evidence", "status", "reason",
        "fired", "wall_s", "suites": [{"suite", "status", "tests", "reason"}]}]}``.
    """
    known = fault_catalog.catalog()
    cells_by_fault: dict[str, list[Cell]] = {}
    for cell in matrix.cells:
        cells_by_fault.setdefault(cell.fault, []).append(cell)

    def run_dict(run: SuiteRun) -> dict[str, Any]:
        return {"returncode": run.returncode, "wall_s": round(run.wall_s, 1), "tests": len(run.outcomes),
                "failing": sorted(run.failing()), "junit": str(run.junit), "log": str(run.log)}

    def fault_dict(v: Verdict) -> dict[str, Any]:
        run = matrix.runs.get(v.fault)
        fault = known.get(v.fault)
        return {"name": v.fault, "upstream": fault.upstream if fault else "",
                "evidence": list(fault.evidence) if fault else [], "status": v.status, "reason": v.reason,
                "fired": bool(run and v.fault in run.fired), "wall_s": round(run.wall_s, 1) if run else 0.0,
                "suites": [{"suite": c.suite, "status": c.status, "tests": list(c.tests), "reason": c.reason}
                           for c in cells_by_fault.get(v.fault, [])]}

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
        run = matrix.runs.get(v.fault)
        took = f"({run.wall_s:.0f} s)" if run else ""
        head = f"{v.fault:<{width}}  {v.status.upper():<11} {took}"
        lines.append(head + (f"  {v.reason}" if v.reason else ""))
        for cell in cells_by_fault.get(v.fault, []):
            lines.append(f"  {cell.status:<6} {cell.suite}" + (f"  ({cell.reason})" if cell.reason else ""))
            if cell.status == CAUGHT:
                lines.extend(f"           {t.split('::', 1)[-1]}" for t in cell.tests)
    counted = [v for v in matrix.verdicts if v.status != NOT_APPLIED]
    caught = sum(v.status == CAUGHT for v in counted)
    lines.append(f"{caught}/{len(counted)} faults caught ({len(matrix.verdicts) - len(counted)} not applied); "
                 f"wall time {matrix.wall_s:.0f} s")
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
        rows.append((v.fault, known[v.fault].upstream if v.fault in known else "", v.status + (f": {v.reason}" if v.reason else ""),
                     *cells))
        status.append("ok" if v.status == CAUGHT else "bad")
    clean = matrix.clean
    note = (f"clean run {'passed' if clean.passed else 'FAILED'} ({len(clean.outcomes)} tests, exit {clean.returncode}); "
            f"a fault is caught by a suite when its code ran and a test that passed clean fails in its body "
            f"with the evidence the fault names")
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
    """Write the check's HTML page, ``out_dir/report/index.html`` (:mod:`harness.report.page`).

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
    header = page.Header("faults check", matrix.ok, tuple(reasons), wall_time=matrix.wall_s, sglang=selection.stamp())
    return page.write(out_dir / "report", header, page_groups(matrix, out_dir, root), [page_table(matrix)], repo_root=root)
