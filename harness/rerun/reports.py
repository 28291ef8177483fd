"""A rerun-test run's report files under ``<run_dir>/report/``: the groups' JUnit merged (each suite
stamped with its group, topology, runner and the sglang target), ``summary.md`` (what the
``/rerun-test`` status comment links), ``summary.json``, the measured ``durations.json`` and the HTML
page (:mod:`harness.report.page`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from harness import atomic, report
from harness.changes import report as changed
from harness.changes.report import ChangedCoverage
from harness.report import page
from harness.report.results import GroupResult
from harness.rerun.comment import LINK_PLACEHOLDER
from harness.rundir import RunDir
from harness.targets.sglang import selection

if TYPE_CHECKING:
    from harness.targets.sglang.selection import Target


def write_reports(
    run_dir: Path,
    results: list[GroupResult],
    link: str = "",
    wall_time: float = 0.0,
    target: Target | None = None,
    coverage: ChangedCoverage | None = None,
) -> Path:
    """Merged JUnit, markdown, JSON, measured durations and the HTML page under ``run_dir/report``; the
    sglang ``target`` (when given) is stamped on every JUnit suite and is ``sglang`` in ``summary.json``.

    Args:
        run_dir: the run's directory (the groups' JUnit files are ``junit/<group>.xml`` in it).
        results: the groups' results.
        link: the URL of the run's logs for the markdown summary ("" or the comment's placeholder: none).
        wall_time: the run's wall time, for the page's header.
        target: the sglang under test.
        coverage: what the run executed of the target's changed lines (``--coverage --changed``): a
            section of ``summary.md``, ``coverage`` in ``summary.json``, a table of the page.

    Returns:
        The page (``report/index.html``).
    """
    out = RunDir(run_dir).report
    out.mkdir(parents=True, exist_ok=True)
    stamp = target.properties() if target is not None else {}
    parts = []
    for r in results:
        xml = RunDir(run_dir).junit_file(r.name)
        text = xml.read_text(encoding="utf-8") if xml.exists() else f'<testsuite name="{r.name}" tests="0"/>'
        parts.append(
            (text, {"group": r.name, "topology": r.topology, "runner": r.runner, **dict(r.properties), **stamp})
        )
    atomic.write_text(out / "junit.xml", report.merge_junit(parts))
    md = report.markdown(results, link if link != LINK_PLACEHOLDER else "")
    if coverage is not None:
        md = f"{md.rstrip()}\n\n{changed.markdown(coverage)}"
    atomic.write_text(out / "summary.md", md)
    summary = report.to_json(results)
    if target is not None:
        summary["sglang"] = target.to_dict()
    if coverage is not None:
        summary["coverage"] = coverage.to_json()
    atomic.write_json(out / "summary.json", summary)
    atomic.write_json(out / "durations.json", report.durations(results), sort_keys=True)
    failed = [f"{r.name}: {r.note}" for r in results if r.note]
    failed += [f"{r.name}: {len(r.failures)} test(s) failed" for r in results if r.failures]
    header = page.Header(
        "rerun-test",
        passed=all(r.ok for r in results),
        reasons=tuple(failed),
        wall_time=wall_time,
        sglang=selection.stamp(target),
    )
    tables = ()
    if coverage is not None:
        tables = (
            page.Table(
                f"Changed lines of sglang (vs {coverage.base})",
                tuple(changed.HEAD),
                tuple(tuple(r) for r in changed.table_rows(coverage)),
                tuple("ok" if not r.missed else "bad" for r in coverage.rows),
                coverage.line(),
            ),
        )
    return page.write(out, header, results, tables)
