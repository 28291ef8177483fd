"""Pure functions from test results to JUnit XML, markdown and JSON. No Ray, no I/O.

:class:`CaseResult` / :class:`GroupResult` are the results of one test / one runner group.
``merge_junit`` folds per-group JUnit files into one, stamping each ``<testsuite>`` with
``<property>`` elements (topology, runner, group, …) so a merged file still says where each test ran.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

OUTCOMES = ("passed", "failed", "error", "skipped")


@dataclass(frozen=True)
class CaseResult:
    """One test's outcome.

    Attributes:
        nodeid: ``suites/x/test_a.py::TestC::test_y[p]``.
        outcome: one of :data:`OUTCOMES`.
        duration: seconds.
        message: one line (the failure's reason or skip reason), ``""`` when passed.
    """

    nodeid: str
    outcome: str
    duration: float = 0.0
    message: str = ""


@dataclass(frozen=True)
class GroupResult:
    """One runner group's run.

    Attributes:
        name: the group (``cpu``, ``8-gpu-h200-1of2``).
        topology, runner: where it ran.
        cases: per-test results.
        wall_time: seconds of the whole pytest process.
        returncode: pytest's exit code (None: not run).
        note: one line when the group itself failed (crash, usage error, nothing collected).
        properties: extra key/values for reports (``simulated``, ``run_dir``, …).
    """

    name: str
    topology: str
    runner: str
    cases: tuple[CaseResult, ...] = ()
    wall_time: float = 0.0
    returncode: int | None = None
    note: str = ""
    properties: tuple[tuple[str, str], ...] = field(default=())

    def count(self, outcome: str) -> int:
        return sum(1 for c in self.cases if c.outcome == outcome)

    @property
    def failures(self) -> tuple[CaseResult, ...]:
        return tuple(c for c in self.cases if c.outcome in ("failed", "error"))

    @property
    def ok(self) -> bool:
        """Passed: pytest exited 0 (or 5 never: nothing collected is a failure), no failed/error case."""
        return self.returncode == 0 and not self.failures and not self.note


def one_line(text: str, limit: int = 160) -> str:
    """First meaningful line of ``text``, trimmed to ``limit`` characters."""
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line if len(line) <= limit else line[: limit - 1] + "…"
    return ""


# ---------------------------------------------------------------------------------------------
# JUnit
# ---------------------------------------------------------------------------------------------


def parse_junit(xml_text: str) -> list[CaseResult]:
    """Read a pytest JUnit XML document into case results.

    The node id is rebuilt from ``file`` (xunit1) when present, else from ``classname`` and ``name``.

    Raises:
        ValueError: not XML.
    """
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as e:
        raise ValueError(f"not JUnit XML: {e}") from None
    out = []
    for case in root.iter("testcase"):
        name = case.get("name", "")
        classname = case.get("classname", "")
        file = case.get("file")
        if file:
            module = file[:-3].replace("/", ".") if file.endswith(".py") else file
            cls = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
            nodeid = file + "".join(f"::{p}" for p in cls.split(".") if p) + f"::{name}"
        else:
            nodeid = f"{classname}::{name}" if classname else name
        outcome, message = "passed", ""
        for tag, kind in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                outcome, message = kind, one_line(el.get("message") or el.text or "")
                break
        out.append(CaseResult(nodeid=nodeid, outcome=outcome, duration=float(case.get("time") or 0), message=message))
    return out


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
