"""The verdict of a gate run: pure functions from per-suite outcomes to PASS / FAIL with reasons.

A suite entry passes when it ran, its required tests ran, no group failed whole, its pass rate reaches
``min_pass_rate`` and no test failed with a class in :data:`NEVER_TOLERATED`. The gate passes when the
target is the version it requires and every *required* suite passes. The conditions in full:
docs/modules.md.
"""

from __future__ import annotations

from dataclasses import dataclass

NEVER_TOLERATED = ("crash", "import", "accounting")


@dataclass(frozen=True)
class TestOutcome:
    """One test's result in a gate run.

    Attributes:
        nodeid: the test.
        group: the rerun group (topology) it ran in.
        outcome: final outcome (passed, failed, error, skipped).
        attempts: outcomes of every run, first run first (``("failed", "passed")`` = passed on a rerun).
        failure_class: the class of the last failure (``""`` when it never failed).
        message: the last failure's one-line reason.
    """

    __test__ = False  # not a pytest class

    nodeid: str
    group: str
    outcome: str
    attempts: tuple[str, ...] = ()
    failure_class: str = ""
    message: str = ""

    @property
    def failed(self) -> bool:
        return self.outcome in ("failed", "error")

    @property
    def flaky(self) -> bool:
        """Passed in the end after failing at least once."""
        return self.outcome == "passed" and any(a in ("failed", "error") for a in self.attempts)


@dataclass(frozen=True)
class SuiteOutcome:
    """One gate suite entry's results.

    Attributes:
        name: the entry.
        required: False for informational entries.
        min_pass_rate: its threshold.
        tests: per-test outcomes.
        notes: group-level failures (one line each).
        error: why the entry could not run at all (selection or plan error), else ``""``.
        require: tests (node ids or prefixes) that must have run on this entry's runner.
    """

    name: str
    required: bool
    min_pass_rate: float
    tests: tuple[TestOutcome, ...] = ()
    notes: tuple[str, ...] = ()
    error: str = ""
    require: tuple[str, ...] = ()

    def count(self, outcome: str) -> int:
        return sum(1 for t in self.tests if t.outcome == outcome)

    @property
    def passed(self) -> int:
        return self.count("passed")

    @property
    def failed(self) -> int:
        return self.count("failed") + self.count("error")

    @property
    def skipped(self) -> int:
        return self.count("skipped")

    @property
    def xfailed(self) -> int:
        """Expected failures (neither a pass nor a failure in the pass rate)."""
        return self.count("xfailed")

    @property
    def flaky(self) -> int:
        return sum(1 for t in self.tests if t.flaky)

    @property
    def pass_rate(self) -> float | None:
        """passed / (passed + failed); None when nothing ran."""
        ran = self.passed + self.failed
        return self.passed / ran if ran else None


@dataclass(frozen=True)
class SuiteVerdict:
    """A suite's status and the reasons when it failed."""

    outcome: SuiteOutcome
    ok: bool
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class Verdict:
    """The gate's verdict.

    Attributes:
        passed: True = PASS.
        reasons: why it failed (empty on PASS).
        warnings: informational failures and flaky passes (never change the verdict).
        suites: per-suite verdicts in gate order.
    """

    passed: bool
    reasons: tuple[str, ...]
    warnings: tuple[str, ...]
    suites: tuple[SuiteVerdict, ...]

    @property
    def word(self) -> str:
        return "PASS" if self.passed else "FAIL"


def judge_suite(s: SuiteOutcome) -> SuiteVerdict:
    """Whether one suite entry passed, with reasons (pure; see the module docstring)."""
    if s.error:
        return SuiteVerdict(s, False, (f"{s.name}: {s.error}",))
    reasons = [f"{s.name}: {n}" for n in s.notes]
    reasons += _unmet_requirements(s)
    rate = s.pass_rate
    if rate is None:
        reasons.append(f"{s.name}: no test ran ({s.skipped} skipped); a gate needs evidence")
    elif rate < s.min_pass_rate:
        reasons.append(
            f"{s.name}: pass rate {rate:.1%} ({s.passed}/{s.passed + s.failed}) is below {s.min_pass_rate:.1%}"
        )
    for t in s.tests:
        if t.failed and (t.failure_class in NEVER_TOLERATED or s.min_pass_rate >= 1.0):
            reasons.append(f"{s.name}: {t.nodeid} [{t.group}] {t.failure_class or t.outcome}: {t.message or t.outcome}")
    return SuiteVerdict(s, not reasons, tuple(reasons))


def _unmet_requirements(s: SuiteOutcome) -> list[str]:
    """A reason per required test that did not run: skipped (with its reason) or never reported."""
    out = []
    for req in s.require:
        matched = [t for t in s.tests if t.nodeid == req or t.nodeid.startswith(req)]
        if not matched:
            out.append(f"{s.name}: required test {req} did not run here (not collected on this runner)")
        for t in matched:
            if t.outcome == "skipped":
                out.append(f"{s.name}: required test {t.nodeid} [{t.group}] skipped: {t.message or 'no reason given'}")
    return out


def judge(suites: list[SuiteOutcome], sglang_required: str = "", sglang_installed: str | None = None) -> Verdict:
    """The gate's verdict (pure).

    Args:
        suites: every entry's outcome, in gate order.
        sglang_required: the version the gate requires (``""``: not checked).
        sglang_installed: the installed version (None: not installed).

    Returns:
        The :class:`Verdict`.
    """
    reasons: list[str] = []
    warnings: list[str] = []
    if sglang_required and sglang_installed != sglang_required:
        have = sglang_installed or "not installed"
        reasons.append(f"sglang {sglang_required} is required, found {have}; run it with --sglang {sglang_required}")
    verdicts = tuple(judge_suite(s) for s in suites)
    for v in verdicts:
        if not v.ok:
            if v.outcome.required:
                reasons.extend(v.reasons)
            else:
                warnings.extend(f"(informational) {r}" for r in v.reasons)
        for t in v.outcome.tests:
            if t.flaky:
                warnings.append(
                    f"{v.outcome.name}: {t.nodeid} [{t.group}] passed after {len(t.attempts) - 1} flaky rerun(s) "
                    f"({t.failure_class})"
                )
    return Verdict(passed=not reasons, reasons=tuple(reasons), warnings=tuple(warnings), suites=verdicts)


def judge_jobs(jobs: list[tuple[str, dict | None]]) -> tuple[bool, tuple[str, ...]]:
    """The verdict of a gate split over CI jobs, one per runner label (pure).

    Each job's ``result.json`` is the verdict of its share of the suites (required versus
    informational and the sglang check already applied), so the gate passes when there is at least
    one job and every job passed. A job that left no result (it failed before the gate reported)
    fails the gate: no evidence, no pass.

    Args:
        jobs: (runner label, the job's ``result.json`` or None when it has none), in matrix order.

    Returns:
        (passed, reasons): one reason per failure, prefixed with the runner label.
    """
    reasons: list[str] = []
    if not jobs:
        reasons.append("no runner job: the plan is empty or the plan job failed (see its log)")
    for label, result in jobs:
        if result is None:
            reasons.append(f"{label}: no result.json; the job ended before the gate reported (see its log)")
        elif result.get("passed") is not True:
            reasons.extend(f"{label}: {r}" for r in (result.get("reasons") or ["FAIL (no reason recorded)"]))
    return not reasons, tuple(reasons)
