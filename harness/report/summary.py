"""Pure functions from test results to JUnit XML, markdown and JSON. No Ray, no I/O.

The results themselves (:class:`~harness.report.results.CaseResult` / :class:`~harness.report.results.GroupResult`)
are read by :mod:`harness.report.results`; the HTML page is :mod:`harness.report.page`.
``merge_junit`` folds per-group JUnit files into one, stamping each ``<testsuite>`` with
``<property>`` elements (topology, runner, group, …) so a merged file still says where each test ran.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from harness.report.results import OUTCOMES, GroupResult


# ---------------------------------------------------------------------------------------------
# JUnit
# ---------------------------------------------------------------------------------------------


def merge_junit(parts: list[tuple[str, dict[str, str]]]) -> str:
    """Merge JUnit documents into one ``<testsuites>``, stamping properties on each suite.

    Args:
        parts: (xml text, properties) per group, e.g. ``{"topology": "cpu", "runner": "ubuntu-latest"}``.
            Unparsable texts become an empty suite with an ``error`` property (the group's failure is
            reported elsewhere; the merge itself never fails).

    Returns:
        The merged XML document (with totals on ``<testsuites>``).
    """
    merged = ET.Element("testsuites")
    totals = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    total_time = 0.0
    for xml_text, props in parts:
        try:
            root = ET.fromstring(xml_text)
            suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        except ET.ParseError as e:
            suites = [ET.Element("testsuite", {"name": props.get("group", "?"), "tests": "0"})]
            props = {**props, "error": f"unreadable JUnit: {e}"}
        for s in suites:
            if props.get("group"):
                s.set("name", f"{props['group']}")
            pe = s.find("properties")
            if pe is None:
                pe = ET.Element("properties")
                s.insert(0, pe)
            for k, v in props.items():
                for old in [p for p in pe.findall("property") if p.get("name") == k]:
                    pe.remove(old)  # re-merging a merged file does not duplicate properties
                ET.SubElement(pe, "property", {"name": k, "value": str(v)})
            for k in totals:
                totals[k] += int(s.get(k) or 0)
            total_time += float(s.get("time") or 0)
            merged.append(s)
    for k, v in totals.items():
        merged.set(k, str(v))
    merged.set("time", f"{total_time:.3f}")
    ET.indent(merged)
    return ET.tostring(merged, encoding="unicode", xml_declaration=True) + "\n"


# ---------------------------------------------------------------------------------------------
# tables, markdown, JSON
# ---------------------------------------------------------------------------------------------


def table(results: list[GroupResult]) -> str:
    """A plain-text table: group, runner, tests, passed/failed/skipped, wall time, status."""
    head = ("group", "runner", "tests", "passed", "failed", "skipped", "wall", "status")
    rows = [head]
    for r in results:
        status = "ok" if r.ok else ("not run" if r.returncode is None else "FAILED")
        rows.append((r.name, r.runner, str(len(r.cases)), str(r.count("passed")), str(r.count("failed") + r.count("error")),
                     str(r.count("skipped")), f"{r.wall_time:.1f}s", status))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(results: list[GroupResult], link: str = "") -> str:
    """A markdown summary: one table row per group, then the failures with one-line reasons."""
    lines = ["| group | runner | tests | passed | failed | skipped | wall |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        icon = "✅" if r.ok else "❌"
        lines.append(f"| {icon} {r.name} | {r.runner} | {len(r.cases)} | {r.count('passed')} | "
                     f"{r.count('failed') + r.count('error')} | {r.count('skipped')} | {r.wall_time:.1f}s |")
    failing = [(r, c) for r in results for c in r.failures]
    notes = [r for r in results if r.note]
    if failing or notes:
        lines += ["", "**Failures**", ""]
        lines += [f"- `{r.name}`: {r.note}" for r in notes]
        lines += [f"- `{c.nodeid}` ({r.name}): {c.message or c.outcome}" for r, c in failing]
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
                "cases": [{"nodeid": c.nodeid, "outcome": c.outcome, "duration": round(c.duration, 3), "message": c.message}
                          for c in r.cases],
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
