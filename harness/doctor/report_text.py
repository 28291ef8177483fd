"""Render a doctor :class:`~harness.doctor.result.Report` as a text table or as JSON (for CI). Pure."""

from __future__ import annotations

import json

from harness.doctor.result import Report

_COLUMNS = ("CHECK", "NODE", "GPU", "STATUS", "DETAIL")


def table(report: Report) -> str:
    """The report as a table; each row that is not ok is followed by its ``how to fix`` line.

    Args:
        report: the doctor's report.

    Returns:
        The text, ending with a one-line verdict.
    """
    cells = [(r.check, r.node, r.gpu, r.status.value.upper(), r.detail) for r in report.rows]
    widths = [max([len(c[i]) for c in cells] + [len(_COLUMNS[i])]) for i in range(4)]
    lines = [f"harness doctor {report.topology} on {report.cluster}", ""]
    lines.append("  ".join(h.ljust(w) for h, w in zip(_COLUMNS[:4], widths)) + "  " + _COLUMNS[4])
    indent = " " * (sum(widths) + 8)
    for r, c in zip(report.rows, cells):
        lines.append("  ".join(v.ljust(w) for v, w in zip(c[:4], widths)) + "  " + c[4])
        if not r.status.ok:
            lines.append(f"{indent}how to fix: {r.fix}")
    lines.append("")
    lines.append(verdict(report))
    return "\n".join(lines)


def verdict(report: Report) -> str:
    """One line: the counts per status, the wall time and OK / NOT OK."""
    counts = ", ".join(f"{n} {s}" for s, n in sorted(report.counts().items()))
    word = "OK" if report.ok else "NOT OK"
    note = (
        " (simulated rows count as passed: no real GPU was checked)"
        if report.ok and report.counts().get("simulated")
        else ""
    )
    return f"{word}: {counts} in {report.wall_s:.1f} s{note}"


def to_json(report: Report) -> str:
    """The report as a JSON document: topology, simulated, ok, exit_code, wall_s, counts, rows."""
    return json.dumps(
        {
            "topology": report.topology,
            "cluster": report.cluster,
            "simulated": report.simulated,
            "ok": report.ok,
            "exit_code": report.exit_code,
            "wall_s": round(report.wall_s, 3),
            "counts": report.counts(),
            "rows": [r.to_json() for r in report.rows],
        },
        indent=2,
    )
