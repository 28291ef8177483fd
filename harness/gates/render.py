"""Reports of a gate run: the verdict block, ``summary.md``, ``result.json``, the merged JUnit and the
tables of its HTML page (:mod:`harness.report.page`). Pure.

``summary.md`` is what a release manager reads: the verdict and its reasons, one row per suite
(required or informational, passed / failed / skipped / flaky, pass rate against the threshold),
then each failing test with its class, reason and the ``repro.json`` to rerun it with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness import report
from harness.gates.verdict import Verdict
from harness.report import page


@dataclass(frozen=True)
class RunInfo:
    """What every report of one gate run is stamped with.

    Attributes:
        gate: the gate's name.
        run_dir: the run directory (as a string).
        git_sha: the commit tested (``unknown`` outside git); ``git_dirty``: uncommitted changes present.
        sglang_version: the target's (None: no sglang); ``sglang_required``: what the gate requires.
        hypothesis_seed, workload_seed: the seeds every suite ran with.
        wall_time: seconds for the whole gate.
        sglang: the sglang target description (``Target.to_dict()``; empty: not recorded).
    """

    gate: str
    run_dir: str
    git_sha: str
    git_dirty: bool
    sglang_version: str | None
    sglang_required: str
    hypothesis_seed: int
    workload_seed: int
    wall_time: float = 0.0
    sglang: tuple[tuple[str, Any], ...] = ()

    def properties(self) -> dict[str, str]:
        """JUnit properties stamped on every suite."""
        target = {
            f"sglang_{k}": str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in self.sglang
            if k in ("origin", "spec", "root", "commit", "dirty") and v is not None
        }
        return {
            "gate": self.gate,
            "git_sha": self.git_sha,
            "git_dirty": str(self.git_dirty).lower(),
            "sglang_version": self.sglang_version or "not installed",
            **target,
            "hypothesis_seed": str(self.hypothesis_seed),
            "workload_seed": str(self.workload_seed),
        }


def verdict_lines(v: Verdict) -> list[str]:
    """The console verdict: ``PASS`` / ``FAIL``, then one line per reason and warning."""
    lines = [f"{v.word}"]
    lines += [f"  reason: {r}" for r in v.reasons]
    lines += [f"  warning: {w}" for w in v.warnings]
    return lines


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def summary_md(info: RunInfo, v: Verdict, repros: dict[str, str], page: str = "") -> str:
    """The human summary.

    Args:
        info: the run's stamp.
        v: the verdict.
        repros: ``"<suite>/<group>::<nodeid>"`` → repro.json path relative to the run directory.
        page: the run's HTML report relative to ``summary.md`` (``index.html``), linked under the verdict.
    """
    icon = "✅" if v.passed else "❌"
    lines = [
        f"# Gate `{info.gate}`: {icon} {v.word}",
        "",
        f"git `{info.git_sha}`{' (dirty)' if info.git_dirty else ''} · sglang {info.sglang_version or 'not installed'}"
        f"{f' (required {info.sglang_required})' if info.sglang_required else ''} · "
        f"seeds hypothesis={info.hypothesis_seed} "
        f"workload={info.workload_seed} · {info.wall_time:.1f}s",
        "",
    ]
    if page:
        lines += [f"Report with KV-pool timelines: [{page}]({page}) (in the run's `report/` directory)", ""]
    if v.reasons:
        lines += ["**Why it failed**", ""] + [f"- {r}" for r in v.reasons] + [""]
    if v.warnings:
        lines += ["**Warnings**", ""] + [f"- {w}" for w in v.warnings] + [""]
    lines += [
        "| suite | kind | passed | failed | skipped | flaky | pass rate | needed | status |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for sv in v.suites:
        s = sv.outcome
        status = "✅" if sv.ok else ("❌" if s.required else "⚠️")
        lines.append(
            f"| {s.name} | {'required' if s.required else 'informational'} | {s.passed} | {s.failed} | {s.skipped} | "
            f"{s.flaky} | {_rate(s.pass_rate)} | {s.min_pass_rate:.0%} | {status} |"
        )
    failing = [(sv.outcome, t) for sv in v.suites for t in sv.outcome.tests if t.failed]
    if failing:
        lines += ["", "**Failing tests**", ""]
        for s, t in failing:
            repro = repros.get(f"{s.name}/{t.group}::{t.nodeid}")
            tail = f" — repro: `{repro}`" if repro else ""
            lines.append(
                f"- `{t.nodeid}` ({s.name}, {t.group}) **{t.failure_class or t.outcome}** after "
                f"{len(t.attempts)} run(s): {t.message or t.outcome}{tail}"
            )
    return "\n".join(lines) + "\n"


def result_json(info: RunInfo, v: Verdict, repros: dict[str, str]) -> dict[str, Any]:
    """The machine-readable result (``verdict``, ``reasons``, ``warnings``, the stamp, suites and tests)."""
    return {
        "gate": info.gate,
        "verdict": v.word,
        "passed": v.passed,
        "reasons": list(v.reasons),
        "warnings": list(v.warnings),
        "git_sha": info.git_sha,
        "git_dirty": info.git_dirty,
        "sglang_version": info.sglang_version,
        "sglang_required": info.sglang_required,
        "sglang": dict(info.sglang) or None,
        "seeds": {"hypothesis": info.hypothesis_seed, "workload": info.workload_seed},
        "wall_time": round(info.wall_time, 3),
        "suites": [
            {
                "name": sv.outcome.name,
                "required": sv.outcome.required,
                "ok": sv.ok,
                "reasons": list(sv.reasons),
                "pass_rate": sv.outcome.pass_rate,
                "min_pass_rate": sv.outcome.min_pass_rate,
                "counts": {
                    "passed": sv.outcome.passed,
                    "failed": sv.outcome.failed,
                    "skipped": sv.outcome.skipped,
                    "xfailed": sv.outcome.xfailed,
                    "flaky": sv.outcome.flaky,
                },
                "notes": list(sv.outcome.notes),
                "error": sv.outcome.error,
                "tests": [
                    {
                        "nodeid": t.nodeid,
                        "group": t.group,
                        "outcome": t.outcome,
                        "attempts": list(t.attempts),
                        "failure_class": t.failure_class,
                        "message": t.message,
                        "repro": repros.get(f"{sv.outcome.name}/{t.group}::{t.nodeid}"),
                    }
                    for t in sv.outcome.tests
                ],
            }
            for sv in v.suites
        ],
    }


def merged_junit(info: RunInfo, parts: list[tuple[str, dict[str, str]]]) -> str:
    """One JUnit document of every group (and rerun) of the gate, each suite stamped with the run's properties.

    Args:
        info: the stamp (gate, git SHA, sglang version, seeds).
        parts: (JUnit text, per-group properties such as suite, group, topology, simulated).
    """
    return report.merge_junit([(text, {**props, **info.properties()}) for text, props in parts])


def jobs_md(
    gate: str,
    jobs: list[tuple[str, dict | None]],
    passed: bool,
    reasons: tuple[str, ...],
    details: tuple[tuple[str, str], ...] = (),
) -> str:
    """The summary of a gate split over CI jobs (``harness gate verdict``).

    Args:
        gate: the gate's name.
        jobs: (runner label, its ``result.json`` or None), as given to :func:`harness.gates.verdict.judge_jobs`.
        passed, reasons: what ``judge_jobs`` returned.
        details: (runner label, that job's ``summary.md``) appended one section each, headings demoted.
    """
    lines = [f"# Gate `{gate}`: {'✅ PASS' if passed else '❌ FAIL'} on {len(jobs)} runner(s)", ""]
    if reasons:
        lines += ["**Why it failed**", ""] + [f"- {r}" for r in reasons] + [""]
    lines += ["| runner | verdict | suites |", "| --- | --- | --- |"]
    for label, result in jobs:
        word = "no result" if result is None else str(result.get("verdict", "?"))
        suites = ", ".join(str(s.get("name")) for s in result.get("suites", [])) if result else "-"
        lines.append(f"| {label} | {word} | {suites} |")
    for label, md in details:
        body = [("##" + ln) if ln.startswith("#") else ln for ln in md.rstrip("\n").splitlines()]
        lines += ["", f"## Runner `{label}`", "", *body]
    return "\n".join(lines) + "\n"


def page_tables(
    v: Verdict, repros: dict[str, str], flaky_history: list[tuple[str, float, int, int]]
) -> list[page.Table]:
    """The gate's own tables on its HTML page: the verdict table and the flaky record.

    Args:
        v: the verdict.
        repros: as for :func:`summary_md`.
        flaky_history: (node id, pass rate, passed, attempts) of tests flaky over the recent runs
            (:func:`harness.gates.history.flaky`), lowest pass rate first.

    Returns:
        Two tables: one row per suite; one row per test that needed a rerun or failed in this run,
        then the history's flaky tests.
    """
    rows, status = [], []
    for sv in v.suites:
        s = sv.outcome
        rows.append(
            (
                s.name,
                "required" if s.required else "informational",
                str(s.passed),
                str(s.failed),
                str(s.skipped),
                str(s.xfailed),
                str(s.flaky),
                _rate(s.pass_rate),
                f"{s.min_pass_rate:.0%}",
                "; ".join(sv.reasons) or "ok",
            )
        )
        status.append("ok" if sv.ok else ("bad" if s.required else "warn"))
    verdict_table = page.Table(
        "Gate verdict",
        ("suite", "kind", "passed", "failed", "skipped", "xfailed", "flaky", "pass rate", "needed", "status"),
        tuple(rows),
        tuple(status),
    )
    frows, fstatus = [], []
    for sv in v.suites:
        for t in sv.outcome.tests:
            if len(t.attempts) > 1 or t.failed:
                repro = repros.get(f"{sv.outcome.name}/{t.group}::{t.nodeid}", "")
                frows.append(
                    (
                        t.nodeid,
                        f"{sv.outcome.name} / {t.group}",
                        " → ".join(t.attempts) or t.outcome,
                        "flaky (passed on a rerun)" if t.flaky else t.outcome,
                        t.failure_class or "-",
                        repro or "-",
                    )
                )
                fstatus.append("warn" if t.flaky else "bad")
    for nodeid, rate, passed, attempts in flaky_history:
        frows.append(
            (nodeid, "history", f"{passed}/{attempts} passed", f"flaky over recent runs ({rate:.0%})", "-", "-")
        )
        fstatus.append("warn")
    flaky_table = page.Table(
        "Flaky record",
        ("test", "suite / group", "attempts", "result", "failure class", "repro"),
        tuple(frows),
        tuple(fstatus),
        note="this run's reruns and failures, then the tests the flaky history shows as flaky"
        if frows
        else "no test needed a rerun or failed in this run, and the history shows none flaky",
    )
    return [verdict_table, flaky_table]
