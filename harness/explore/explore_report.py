"""The report of ``harness explore`` and of a replay: ``<run>/report/index.html`` through
:func:`harness.report.page.write` (tables: the run's figures, the batches of schedules run, the rules'
costs, the shrunk schedule) and ``summary.md``, the same tables in markdown."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from harness import atomic
from harness.explore.machine import Finding, Replayed, Session
from harness.explore.pair import Step
from harness.report import page
from harness.report.stamp import Target


def write(root: Path, header: page.Header, tables: Sequence[page.Table]) -> Path:
    """Write ``root/report/index.html`` and ``summary.md``; returns the page's path."""
    out = root / "report"
    index = page.write(out, header, [], tuple(tables))
    atomic.write_text(out / "summary.md", markdown(header, tables))
    return index


def markdown(header: page.Header, tables: Sequence[page.Table]) -> str:
    """The verdict, its reasons and every table, as markdown."""
    lines = [f"# {header.kind}: {header.word}", ""] + [f"- {r}" for r in header.reasons]
    for t in tables:
        lines += ["", f"## {t.title}", ""] + ([t.note, ""] if t.note else [])
        lines += ["| " + " | ".join(t.head) + " |", "|" + "---|" * len(t.head)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in t.rows]
    return "\n".join(lines) + "\n"


def for_session(root: Path, session: Session, wall: float, sglang: Target, repro: Path | None) -> Path:
    """The report of an exploration: what it ran and, when a schedule broke, the shrunk schedule."""
    p, finding = session.progress, session.finding
    first = "-" if session.first_failure_s is None else f"{session.first_failure_s:.1f} s"
    tables = [
        page.Table(
            "Exploration",
            ("seed", "schedules", "steps", "steps/s", "stopped by", "first failure after"),
            (
                (
                    str(session.seed),
                    str(p.schedules),
                    str(p.steps),
                    f"{p.steps / wall:.0f}" if wall else "-",
                    session.stopped,
                    first,
                ),
            ),
        ),
        page.Table(
            "Schedules run",
            ("batch seed", "schedules", "steps", "outcome"),
            tuple((str(b.seed), str(b.schedules), str(b.steps), b.outcome) for b in session.batches),
            tuple("bad" if b.outcome == "failure" else "" for b in session.batches),
            note="one Hypothesis run per batch (its schedules include the shrinking ones)",
        ),
        page.Table(
            "Rules",
            ("rule", "calls", "mean ms", "total s"),
            tuple(
                (
                    name,
                    str(p.rule_calls[name]),
                    f"{1000 * p.rule_seconds[name] / p.rule_calls[name]:.2f}",
                    f"{p.rule_seconds[name]:.1f}",
                )
                for name in sorted(p.rule_calls, key=lambda r: -p.rule_seconds[r] / p.rule_calls[r])
            ),
            note="slowest (mean) first",
        ),
    ]
    if finding is not None:
        tables.append(_schedule("Shrunk schedule", finding, finding.steps, repro))
    reasons = (finding.failure,) if finding is not None else ()
    header = page.Header(
        "harness explore", finding is None, reasons, wall_time=wall, seeds={"explore": session.seed}, sglang=sglang
    )
    return write(root, header, tables)


def for_replay(
    root: Path, repro: dict[str, Any], path: Path, done: Replayed, wall: float, sglang: Target, events: str
) -> Path:
    """The report of a replay: the replayed schedule, and whether its events matched the recorded ones."""
    table = _schedule("Replayed schedule", None, done.steps, path, failure=done.failure, events=events)
    reasons = (done.failure,) if done.failure else ()
    header = page.Header(
        "harness explore --replay",
        done.failure is None,
        reasons,
        wall_time=wall,
        seeds={"explore": repro.get("seed", "-")},
        sglang=sglang,
    )
    return write(root, header, [table])


def _schedule(
    title: str,
    finding: Finding | None,
    steps: list[Step],
    repro: Path | None,
    failure: str | None = None,
    events: str = "",
) -> page.Table:
    failure = finding.failure if finding is not None else failure
    rows = [(str(i), s.op, " ".join(f"{k}={v}" for k, v in s.args.items()), s.outcome) for i, s in enumerate(steps, 1)]
    if finding is not None and finding.at_end:
        rows.append((str(len(steps) + 1), "end", "", "abort what is in flight, flush, check the baseline"))
    notes = [finding.lines()[0]] if finding is not None else []
    notes += [f"failure: {failure}" if failure else "no failure", events]
    if repro is not None:
        notes.append(f"repro: {repro} (replay: rerun-test --from {repro})")
    return page.Table(
        title,
        ("#", "operation", "arguments", "outcome"),
        tuple(rows),
        tuple("bad" if r[3].startswith("raised") else "" for r in rows),
        note="; ".join(n for n in notes if n),
    )
