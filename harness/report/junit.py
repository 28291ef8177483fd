"""The one reader (and merger) of pytest's JUnit XML: every consumer — rerun-test, the gates, the fault
matrix, the run report, a suite run inside a worker — reads JUnit here and nowhere else.

:func:`parse_junit` / :func:`read_junit` give a :class:`~harness.report.results.CaseResult` per test case;
:func:`merge_junit` folds per-group documents into one, each suite stamped with where it ran. How node ids,
xfails and strict xpasses are read: docs/modules.md.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from harness.report.results import CaseResult, one_line

#: The ``type`` pytest gives the ``<skipped>`` element of an expected failure.
XFAIL_TYPE = "pytest.xfail"


def _relative(file: str, root: Path | None) -> str:
    path = Path(file)
    if root is not None and path.is_absolute():
        try:
            return path.relative_to(root).as_posix()
        except ValueError:
            return path.as_posix()
    return file


def _nodeid(file: str, classname: str, name: str) -> str:
    if not file:  # no file attribute (xunit2), or a collection error named by module
        return f"{classname}::{name}" if classname else name
    module = file[:-3].replace("/", ".") if file.endswith(".py") else file
    if classname.startswith(module + "."):
        cls = classname[len(module) + 1 :]
    else:  # a rootdir other than the file's: the class is the last dotted part, unless it is the module
        last = classname.rsplit(".", 1)[-1]
        cls = last if last and last != Path(file).stem else ""
    return file + "".join(f"::{p}" for p in cls.split(".") if p) + f"::{name}"


def parse_junit(xml_text: str, root: Path | None = None) -> list[CaseResult]:
    """Read a pytest JUnit XML document into case results.

    Args:
        xml_text: the document.
        root: absolute ``file`` attributes are made relative to this directory.

    Returns:
        One :class:`CaseResult` per ``<testcase>``, in document order. A case with several of
        ``failure`` / ``error`` / ``skipped`` takes the first in that order.

    Raises:
        ValueError: not XML.
    """
    try:
        doc = ET.fromstring(xml_text)
    except ET.ParseError as e:
        raise ValueError(f"not JUnit XML: {e}") from None
    out = []
    for case in doc.iter("testcase"):
        file = _relative(case.get("file") or "", root)
        nodeid = _nodeid(file, case.get("classname", ""), case.get("name", ""))
        outcome, message, reason, text = "passed", "", "", ""
        for tag, kind in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                reason, text = el.get("message") or "", el.text or ""
                outcome, message = kind, one_line(reason or text)
                if tag == "skipped" and el.get("type") == XFAIL_TYPE:
                    outcome = "xfailed"
                break
        out.append(
            CaseResult(
                nodeid=nodeid,
                outcome=outcome,
                duration=float(case.get("time") or 0),
                message=message,
                reason=reason,
                traceback=text,
            )
        )
    return out


def read_junit(path: str | Path, root: Path | None = None) -> list[CaseResult]:
    """:func:`parse_junit` of a file.

    Raises:
        ValueError: the file is missing, unreadable or not XML (a run killed before pytest wrote it).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read JUnit {path}: {e.strerror}") from None
    return parse_junit(text, root)


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
    totals: dict[str, int] = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
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
    for k, n in totals.items():
        merged.set(k, str(n))
    merged.set("time", f"{total_time:.3f}")
    ET.indent(merged)
    return ET.tostring(merged, encoding="unicode", xml_declaration=True) + "\n"
