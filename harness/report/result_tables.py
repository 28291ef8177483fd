"""Pure functions from test results to a text table, markdown and JSON. No Ray, no I/O.

The results themselves (:class:`~harness.report.results.CaseResult` / :class:`~harness.report.results.GroupResult`)
are read by :mod:`harness.report.junit`; the HTML page is :mod:`harness.report.page`.
"""

from __future__ import annotations

from harness.report.results import OUTCOMES, GroupResult


def table(results: list[GroupResult]) -> str:
    """A plain-text table: group, runner, tests, passed/failed/skipped/xfailed, wall time, status."""
    head = ("group", "runner", "tests", "passed", "failed", "skipped", "xfailed", "wall", "status")
    rows = [head]
    for r in results:
        status = "ok" if r.ok else ("not run" if r.returncode is None else "FAILED")
        rows.append(
            (
                r.name,
                r.runner,
                str(len(r.cases)),
                str(r.count("passed")),
                str(r.count("failed") + r.count("error")),
                str(r.count("skipped")),
                str(r.count("xfailed")),
                f"{r.wall_time:.1f}s",
                status,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(results: list[GroupResult], link: str = "") -> str:
    """A markdown summary: one table row per group, then the failures with their headlines, then the
    expected failures with their reasons."""
    lines = [
        "| group | runner | tests | passed | failed | skipped | xfailed | wall |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        icon = "✅" if r.ok else "❌"
        lines.append(
            f"| {icon} {r.name} | {r.runner} | {len(r.cases)} | {r.count('passed')} | "
            f"{r.count('failed') + r.count('error')} | {r.count('skipped')} | {r.count('xfailed')} | "
            f"{r.wall_time:.1f}s |"
        )
    failing = [(r, c) for r in results for c in r.failures]
    notes = [r for r in results if r.note]
    if failing or notes:
        lines += ["", "**Failures**", ""]
        lines += [f"- `{r.name}`: {r.note}" for r in notes]
        lines += [f"- `{c.nodeid}` ({r.name}): {c.message or c.outcome}" for r, c in failing]
    expected = [(r, c) for r in results for c in r.cases if c.outcome == "xfailed"]
    if expected:
        lines += ["", "**Expected failures** (xfail)", ""]
        lines += [f"- `{c.nodeid}` ({r.name}): {c.message or 'no reason given'}" for r, c in expected]
    if link:
        lines += ["", f"[details]({link})"]
    return "\n".join(lines) + "\n"


def to_json(results: list[GroupResult]) -> dict:
    """A JSON-able summary (``ok``, and per group its counts, properties and cases)."""
    return {
        "ok": all(r.ok for r in results),
        "groups": [
            {
                "name": r.name,
                "topology": r.topology,
                "runner": r.runner,
                "ok": r.ok,
                "returncode": r.returncode,
                "wall_time": round(r.wall_time, 3),
                "note": r.note,
                "counts": {o: r.count(o) for o in OUTCOMES},
                "properties": dict(r.properties),
                "cases": [
                    {"nodeid": c.nodeid, "outcome": c.outcome, "duration": round(c.duration, 3), "message": c.message}
                    for c in r.cases
                ],
            }
            for r in results
        ],
    }


def durations(results: list[GroupResult]) -> dict[str, float]:
    """Measured seconds per node id (the max over groups when a test ran on several topologies)."""
    out: dict[str, float] = {}
    for r in results:
        for c in r.cases:
            if c.outcome != "skipped":
                out[c.nodeid] = max(out.get(c.nodeid, 0.0), round(c.duration, 3))
    return out
