"""The run report people look at: ``<run_dir>/report/index.html``, one static page per run.

:func:`write` takes a run's verdict, groups and own tables and writes the page, with one KV-pool timeline
PNG per ledger-writing test. No script, no network, relative links: it reads the same from a CI artifact or
a file browser. What the page shows: docs/modules.md. Over 400 lines: every section of the one page.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from harness import atomic, rundir
from harness.report import records as run_records
from harness.report import stamp, timeline
from harness.report.records import TestRecord
from harness.report.results import CaseResult, GroupResult
from harness.rundir import REPO_ROOT

log = logging.getLogger(__name__)

INDEX = "index.html"
#: The page's template (``harness/report/templates/``), rendered with autoescape on: every value is
#: escaped where the template writes it, so no value can open a tag in a CI artifact.
TEMPLATE = "page.html.j2"

if TYPE_CHECKING:
    import jinja2


@cache
def _templates() -> "jinja2.Environment":
    # jinja2 is imported when a page is written, not with this module: rerun-test plans (and writes
    # no page) on a bare interpreter, which imports this module through the rerun package.
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("harness.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )


TIMELINES = "timelines"
LOG_TAIL_LINES = 40
#: Repository root: the harness commit is read from here.


@dataclass(frozen=True)
class Table:
    """A table of the run's own (a gate's verdict table, the fault matrix).

    Attributes:
        title: its heading.
        head: column names.
        rows: cells as text (escaped when written).
        status: per row ``ok`` / ``bad`` / ``warn`` / ``""`` (a coloured first cell).
        note: a line under the heading.
    """

    title: str
    head: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    status: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class Header:
    """What the page says first.

    Attributes:
        kind: what ran (``rerun-test``, ``gate per-commit``, ``faults check``).
        passed: the verdict.
        reasons: why it failed (one line each).
        warnings: what did not change the verdict but should be read.
        wall_time: seconds for the whole run.
        seeds: run-wide seeds (a gate's); per-group seeds are read from the test records.
        sglang: the sglang target the run tested (its runner's
            :func:`harness.targets.sglang.selection.stamp`).
    """

    kind: str
    passed: bool
    reasons: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    wall_time: float = 0.0
    seeds: Mapping[str, object] = field(default_factory=dict)
    sglang: stamp.Target = stamp.UNRECORDED

    @property
    def word(self) -> str:
        return "PASS" if self.passed else "FAIL"


def _file_name(text: str) -> str:
    """A file name for ``text``: readable, and unique even where two long node ids share their first 100 characters."""
    return f"{rundir.safe_name(text)[:100]}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def duration(seconds: float) -> str:
    """``0.42 s``, ``12.3 s``, ``4 min 05 s``."""
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 120:
        return f"{seconds:.1f} s"
    m = int(seconds // 60)
    return f"{m} min {seconds - 60 * m:02.0f} s"


CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d2125;background:#f6f7f9}
main{max-width:1280px;margin:0 auto;padding:16px 24px 48px}
h1{margin:8px 0 4px;font-size:26px}
h2{margin:28px 0 8px;font-size:19px;border-bottom:1px solid #d0d4d9;padding-bottom:4px}
h3{margin:0;font-size:15px;font-family:ui-monospace,Menlo,Consolas,monospace;word-break:break-all}
.verdict.pass{color:#1a7f37} .verdict.fail{color:#cf222e}
table{border-collapse:collapse;background:#fff;margin:6px 0 10px;font-size:13px}
th,td{border:1px solid #d0d4d9;padding:3px 8px;text-align:left;vertical-align:top} th{background:#eef0f3}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600;color:#fff;
margin-right:8px}
.badge.passed{background:#1a7f37}.badge.failed,.badge.error{background:#cf222e}.badge.skipped{background:#9a6700}
.badge.xfailed{background:#6e40c9}
tr.bad{background:#fff4f4} tr.warn{background:#fff8e5}
tr.ok td:first-child{border-left:4px solid #1a7f37} tr.bad td:first-child{border-left:4px solid #cf222e}
tr.warn td:first-child{border-left:4px solid #9a6700}
.test{background:#fff;border:1px solid #d0d4d9;border-radius:6px;margin:10px 0;padding:10px 14px}
.test.bad{border-left:5px solid #cf222e} .head{display:flex;align-items:center;gap:6px;flex-wrap:wrap}
.msg{font-family:ui-monospace,Menlo,Consolas,monospace;background:#fff4f4;border:1px solid #f3c1c1;padding:6px 8px;
white-space:pre-wrap;margin:8px 0;font-size:12.5px}
.msg.xfailed,.msg.skipped{background:#f6f8fa;border-color:#d0d4d9} .msg .why{color:#57606a}
tr.knock-on td:first-child{color:#9a6700;font-weight:400}
.meta{color:#57606a;font-size:12.5px} img.timeline{max-width:100%;border:1px solid #d0d4d9;margin-top:8px;display:block}
table.violations td{font-size:12.5px} table.violations tr td:first-child{color:#cf222e;font-weight:700}
pre{background:#0d1117;color:#e6edf3;padding:8px 10px;overflow-x:auto;font-size:12px;max-height:420px}
details{margin:6px 0} summary{cursor:pointer;color:#0b5cad} ul.reasons{margin:4px 0 8px}
a{color:#0b5cad}
"""


def write(
    report_dir: Path,
    header: Header,
    groups: Sequence[GroupResult],
    tables: Sequence[Table] = (),
    repo_root: Path = REPO_ROOT,
) -> Path:
    """Write ``report_dir/index.html`` and its timeline PNGs (see the module docstring).

    Args:
        report_dir: the run's ``report/`` directory (created).
        header: verdict, reasons, wall time, run-wide seeds and the sglang target.
        groups: the run's groups; a group's ``run_dir`` property points at its pytest run
            directory (``tests.jsonl``, ``workers/``, ``ledger/``; its ``log`` property, if any,
            the pytest output, else ``<run_dir>/pytest.log``). Groups without one show their JUnit
            results only.
        tables: the run's own tables, shown after the header.
        repo_root: where the harness commit is read.

    Returns:
        The path of ``index.html``.

    Raises:
        OSError: the report directory cannot be written.
    """
    report_dir.mkdir(parents=True, exist_ok=True)
    sha, dirty = stamp.git_state(repo_root)
    per_group = [(g, run_records.read_records(g.run_dir) if g.run_dir else []) for g in groups]
    page = (
        _templates()
        .get_template(TEMPLATE)
        .render(
            css=CSS,
            h=header,
            stamp_rows=_stamp_rows(header, sha, dirty, report_dir),
            groups=[_group_row(g, records, report_dir) for g, records in per_group],
            tables=[
                {
                    "title": t.title,
                    "note": t.note,
                    "head": t.head,
                    "rows": [(t.status[i] if i < len(t.status) else "", row) for i, row in enumerate(t.rows)],
                }
                for t in tables
            ],
            notes=[g for g, _ in per_group if g.note],
            failures=[
                {"anchor": _anchor(g, c), "nodeid": c.nodeid, "group": g.name, "message": c.message or c.outcome}
                for g, _ in per_group
                for c in g.failures
            ],
            test_groups=[
                {
                    "name": g.name,
                    "topology": g.topology,
                    "runner": g.runner,
                    "note": g.note,
                    "tests": [_test(g, c, run_records.record_for(c.nodeid, records), report_dir) for c in g.cases],
                }
                for g, records in per_group
            ],
            log_tail_lines=LOG_TAIL_LINES,
        )
    )
    out = report_dir / INDEX
    atomic.write_text(out, page)
    log.info("report page: %s", out)
    return out


def _stamp_rows(h: Header, sha: str, dirty: bool, report_dir: Path) -> list[tuple[str, str]]:
    target = h.sglang
    seeds = ", ".join(f"{k}={v}" for k, v in h.seeds.items())
    return [
        (
            "sglang target",
            f"{target.version} · origin {target.origin}" + (f" · commit {target.commit}" if target.commit else ""),
        ),
        ("harness commit", f"{sha}{' (uncommitted changes)' if dirty else ''}"),
        ("seeds", seeds or "per group, below"),
        ("wall time", duration(h.wall_time)),
        ("run directory", report_dir.parent.name),
        ("written", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())),
    ]


def _group_row(g: GroupResult, records: list[TestRecord], report_dir: Path) -> dict[str, Any]:
    props = dict(g.properties)
    bases = sorted(
        {str(dict(r.seeds).get("workload_base")) for r in records if dict(r.seeds).get("workload_base") is not None}
    )
    hyp = sorted({str(dict(r.seeds).get("hypothesis")) for r in records if dict(r.seeds).get("hypothesis") is not None})
    seed_text = ", ".join(
        [f"workload base {'/'.join(bases)}"] * bool(bases) + [f"hypothesis {'/'.join(hyp)}"] * bool(hyp)
    )
    pytest_log = Path(props["log"]) if props.get("log") else (g.run_dir / "pytest.log" if g.run_dir else None)
    log_link = (
        {"href": _rel(pytest_log, report_dir), "name": pytest_log.name}
        if pytest_log is not None and pytest_log.is_file()
        else None
    )
    return {
        "state": "ok" if g.ok else "bad",
        "name": g.name,
        "topology": g.topology,
        "runner": g.runner,
        "simulated": props.get("simulated", "-"),
        "tests": len(g.cases),
        "passed": g.count("passed"),
        "failed": g.count("failed") + g.count("error"),
        "skipped": g.count("skipped"),
        "xfailed": g.count("xfailed"),
        "wall": duration(g.wall_time),
        "seeds": seed_text or "-",
        "note": g.note,
        "log": log_link,
    }


def _anchor(group: GroupResult, case: CaseResult) -> str:
    return "t-" + rundir.safe_name(f"{group.name}-{case.nodeid}")


def _rel(path: Path, report_dir: Path) -> str:
    return Path(os.path.relpath(path, report_dir)).as_posix()


def _test(g: GroupResult, case: CaseResult, rec: TestRecord | None, report_dir: Path) -> dict[str, Any]:
    bad = case.outcome in ("failed", "error")
    seed = dict(rec.seeds).get("workload") if rec else None
    return {
        "bad": bad,
        "anchor": _anchor(g, case),
        "outcome": case.outcome,
        "nodeid": case.nodeid,
        "duration": duration(case.duration),
        "workload_seed": seed,
        "message": (case.reason or case.message) if case.outcome != "passed" else "",
        "timeline": _timeline(g, case, rec, report_dir) if rec is not None and rec.ledgers else None,
        "logs": _logs(rec, report_dir) if rec is not None and rec.logs else [],
        "traceback": case.traceback if bad else "",
    }


def _events_and_ranks(rec: TestRecord) -> tuple[list, list]:
    """A test's ledger events and the ranks' timelines built from them.

    Raises:
        ValueError, TypeError: an unreadable ledger.
    """
    events = [ev for span in rec.ledgers for ev in run_records.span_events(span)]
    return events, timeline.build(timeline.events_by_worker(events))


def _timeline(g: GroupResult, case: CaseResult, rec: TestRecord, report_dir: Path) -> dict[str, Any]:
    try:
        events, ranks = _events_and_ranks(rec)
    except (ValueError, TypeError) as e:
        return {"error": str(e), "ranks": 0}
    if not ranks:
        return {"error": "", "ranks": 0}
    png = _png(report_dir, g.name, case)
    img_error = ""
    try:
        if not png.exists():  # else drawn while the run's other groups ran (draw_timelines)
            timeline.plot(ranks, png, title=case.nodeid)
    except ImportError as e:  # matplotlib missing: the page still has the tables
        log.warning("no timeline plot for %s: %s", case.nodeid, e)
        img_error = str(e)
    marks = []
    for m in sorted((m for r in ranks for m in r.marks), key=lambda m: int(m.label[1:])):
        at = f"{m.worker} #{m.seq} {m.kind} at {m.t:.3f} s" if m.seq is not None else f"{m.worker} (at the end)"
        if m.repeats:
            at += f"; {m.repeats} more event(s) to #{m.last_seq}"
        marks.append(
            {
                "rule": m.rule,
                "worker": m.worker,
                "seq": m.seq if m.seq is not None else "",
                "rid": m.rid,
                "label": m.label,
                "at": at,
                "pages": m.pages,
                "held": m.held,
                "rule_text": m.rule_text,
                "message": m.message,
                "follows": m.follows,
            }
        )
    rows = [(r.worker, q) for r in ranks for q in r.requests]
    pools = [p for p in timeline.POOLS if any(p in r.used for r in ranks)]
    return {
        "error": "",
        "events": len(events),
        "ranks": len(ranks),
        "violating": sum(len(r.violation_t) for r in ranks),
        "peaks": "; ".join(f"{r.worker}: " + ", ".join(f"{p} {n}" for p, n in r.peak.items()) for r in ranks),
        "png": _rel(png, report_dir),
        "img_error": img_error,
        "marks": marks,
        "pools": pools,
        "resources": _resources(events),
        "request_count": len({q.rid for _, q in rows}),
        "requests": [
            {
                "rid": q.rid,
                "worker": worker,
                "first": f"{q.first:.3f}",
                "last": f"{q.last:.3f}",
                "events": q.events,
                "peaks": [q.peak.get(p, 0) for p in pools],
                "held": ", ".join(f"{p} {n}" for p, n in q.held.items() if n),
            }
            for worker, q in rows
        ],
    }


def _resources(events: Sequence[Any]) -> list[dict[str, Any]]:
    """Per worker, each resource besides KV pages (:mod:`harness.ledger.resources`): its baseline and the
    last value read, for the report's baseline table."""
    from harness.ledger.resources import RESOURCES, baselines

    return [
        {
            "worker": r.worker,
            "resource": r.resource,
            "source": RESOURCES[r.resource].source,
            "counts": r.counts,
            "baseline": "-" if r.baseline is None else r.baseline,
            "last": r.last,
            "at": f"#{r.last_seq} {r.last_kind}",
            "bad": not r.at_baseline,
        }
        for r in baselines(events)
    ]


def _png(report_dir: Path, group: str, case: CaseResult) -> Path:
    return report_dir / TIMELINES / f"{_file_name(group + '-' + case.nodeid)}.png"


def draw_timelines(report_dir: Path, group: str, run_dir: Path, cases: Sequence[CaseResult]) -> list[str]:
    """Draw the timeline PNGs of finished tests of a group now (:func:`write` then uses them): a run
    calls it as its groups' tests finish, while the groups run, instead of drawing every test's
    (about 0.2 s each, one at a time) after the last group ends. The PNGs are those :func:`write`
    draws, at the same paths (one already there is left as it is: a report directory is one run's).

    Args:
        report_dir: the run's ``report/`` directory.
        group: the group's name.
        run_dir: the group's pytest run directory (``tests.jsonl``, ``ledger/``).
        cases: finished tests of the group.

    Returns:
        The node ids of ``cases`` that are done with: drawn, drawn before, or without ledger events.
        A test whose record is not written yet is left out (ask again later); one whose timeline cannot
        be built or drawn is done with here (:func:`write` says why on the page).
    """
    records = run_records.read_records(run_dir)
    done = []
    for case in cases:
        rec = run_records.record_for(case.nodeid, records)
        if rec is None:
            continue
        done.append(case.nodeid)
        png = _png(report_dir, group, case)
        if not rec.ledgers or png.exists():
            continue
        try:
            _, ranks = _events_and_ranks(rec)
            if ranks:
                timeline.plot(ranks, png, title=case.nodeid)
        except (ValueError, TypeError, ImportError) as e:
            log.debug("timeline of %s left to the page: %s", case.nodeid, e)
    return done


def _logs(rec: TestRecord, report_dir: Path) -> list[dict[str, str]]:
    out = []
    for span in rec.logs:
        tail = run_records.span_tail(span, LOG_TAIL_LINES)
        if tail.strip():
            out.append({"name": span.name, "href": _rel(span.path, report_dir), "tail": tail})
    return out
