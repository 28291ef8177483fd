"""What the kill matrix concludes from its runs, per fault and suite file: pure, from the JUnit results
of the clean run and of each fault's run (the rules are in :mod:`harness.faultcheck`'s docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from harness import faults as fault_catalog


def suite_file(selection: str) -> str:
    """The file (or directory) part of a selection (``path::test[id]`` -> ``path``)."""
    return selection.split("::", 1)[0].rstrip("/")


CLEAN = "clean"


CAUGHT, MISSED, BROKEN, NOT_APPLICABLE, NOT_APPLIED = "caught", "missed", "broken", "n/a", "not-applied"


FAILING = ("failed", "error")


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
        stop_at_catch: the run stopped at its first catch (``--stop-at-catch``): the tests after it never ran.
    """

    label: str
    suites: tuple[str, ...]
    returncode: int
    outcomes: tuple[TestOutcome, ...]
    wall_s: float
    junit: Path
    log: Path
    fired: frozenset[str] = frozenset()
    stop_at_catch: bool = False

    @property
    def ran(self) -> bool:
        """pytest ran the tests to the end (exit 0: all passed, 1: some failed), or to the catch it
        stopped at (exit 2, interrupted by ``--stop-at-catch``)."""
        return self.returncode in (0, 1) or (self.returncode == 2 and self.stop_at_catch)

    @property
    def passed(self) -> bool:
        """Every test passed (or was skipped) and at least one test ran."""
        return self.returncode == 0 and bool(self.outcomes)

    def failing(self) -> dict[str, TestOutcome]:
        """Failed or errored tests by id."""
        return {o.test_id: o for o in self.outcomes if o.outcome in FAILING}


@dataclass(frozen=True)
class Cell:
    """One fault x suite entry of the matrix.

    Attributes:
        fault: the fault name.
        suite: the suite file.
        status: ``caught``, ``missed``, ``broken`` or ``n/a``.
        tests: the ids of the tests that caught it (broken: the tests that failed otherwise).
        reason: for ``broken``, the first such test's message.
        by_sglang: the failing tests whose failure one of sglang's own checks raised (alone, or
            agreeing with the harness's oracle): the catches attributed to sglang's oracle. A cell
            caught only by them is ``broken``: the evidence must come from the harness's own.
    """

    fault: str
    suite: str
    status: str
    tests: tuple[str, ...] = ()
    reason: str = ""
    by_sglang: tuple[str, ...] = ()


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


def in_suite(outcome: TestOutcome, suite: str) -> bool:
    suite = suite_file(suite)
    return outcome.file == suite or outcome.file.startswith(suite + "/")


def has_evidence(outcome: TestOutcome, evidence: Iterable[str]) -> bool:
    """Whether a failing test's report shows one of the expected evidence strings."""
    return any(e in outcome.text or e in outcome.message for e in evidence)


#: How a failure headline (:mod:`harness.plugins.explain`) says one of sglang's own checks raised it.
SGLANG_CHECK_MARKS = ("sglang-check ", "sglang's check agreed")


def by_sglang_check(outcome: TestOutcome) -> bool:
    """Whether one of sglang's own checks raised (or agreed with) this failure."""
    return outcome.message.startswith(SGLANG_CHECK_MARKS[0]) or SGLANG_CHECK_MARKS[1] in outcome.message


def build_cells(
    name: str, suites: tuple[str, ...], clean: SuiteRun, run: SuiteRun, evidence: tuple[str, ...] = ()
) -> tuple[Cell, ...]:
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
        mine = [o for o in run.outcomes if in_suite(o, suite)]
        if not run.ran:
            cells.append(Cell(name, suite, BROKEN, reason=f"pytest exited {run.returncode}"))
            continue
        counted = [o for o in mine if o.test_id in clean_passed]
        caught = tuple(sorted(o.test_id for o in counted if o.outcome == "failed" and has_evidence(o, evidence)))
        other = [o for o in counted if o.outcome in FAILING and o.test_id not in caught]
        sglang = tuple(sorted(o.test_id for o in counted if o.outcome in FAILING and by_sglang_check(o)))
        if caught:
            cells.append(Cell(name, suite, CAUGHT, caught, by_sglang=sglang))
        elif other:
            first = other[0]
            where = (
                "was caught by sglang's own check only, not the harness's oracle"
                if by_sglang_check(first)
                else "errored outside the test body"
                if first.outcome == "error"
                else "failed without the evidence"
            )
            cells.append(
                Cell(
                    name,
                    suite,
                    BROKEN,
                    tuple(o.test_id for o in other),
                    f"{first.test_id} {where}: {first.message}",
                    by_sglang=sglang,
                )
            )
        elif counted:
            cells.append(Cell(name, suite, MISSED))
        elif not mine and run.stop_at_catch:
            cells.append(Cell(name, suite, NOT_APPLICABLE, reason="not run: the run stopped at its first catch"))
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


def suite_group(suite: str) -> str:
    # Suites under one directory of suites/ share a process; e.g. the unit suites and the PD suites
    # run side by side (both pay their own imports; Ray start-up dominates the PD ones).
    return "/".join(Path(suite).parts[:2])
