"""The run report people look at: ``<run_dir>/report/index.html``, one static page per run.

:func:`write` takes a run's results — its verdict, its groups (:class:`harness.report.results.GroupResult`,
each with its pytest run directory) and any tables of its own (a gate's verdict table and flaky
record, the fault × suite matrix) — and writes the page with one PNG per ledger-writing test beside
it in ``report/timelines/``. ``rerun-test``, ``harness gate run`` and ``harness faults check`` call
it; so can any other runner of groups.

The page: a header (verdict and reasons, the sglang target, the harness commit, seeds, wall times,
topology and runner per group), the run's own tables, then per test its outcome, duration and
failure message, the KV-pool timeline of every rank it used (:mod:`harness.report.timeline`) with the
ledger violations listed beside it at the event that broke each rule, a per-request table, and the
log tail each worker wrote while the test ran. No script, no network: it reads the same from a CI
artifact download or a file browser. Links are relative to the report directory.
"""

from __future__ import annotations

import hashlib
import html
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from harness.rundir import REPO_ROOT
from harness.report import results
from harness.report import stamp
from harness.report import timeline
from harness.report.results import CaseResult, GroupResult, TestRecord

log = logging.getLogger(__name__)

INDEX = "index.html"
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


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:120]


def _file_name(text: str) -> str:
    """A file name for ``text``: readable, and unique even where two long node ids share their first 100 characters."""
    return f"{_safe(text)[:100]}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


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
h1{margin:8px 0 4px;font-size:26px} h2{margin:28px 0 8px;font-size:19px;border-bottom:1px solid #d0d4d9;padding-bottom:4px}
h3{margin:0;font-size:15px;font-family:ui-monospace,Menlo,Consolas,monospace;word-break:break-all}
.verdict.pass{color:#1a7f37} .verdict.fail{color:#cf222e}
table{border-collapse:collapse;background:#fff;margin:6px 0 10px;font-size:13px}
th,td{border:1px solid #d0d4d9;padding:3px 8px;text-align:left;vertical-align:top} th{background:#eef0f3}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600;color:#fff;margin-right:8px}
.badge.passed{background:#1a7f37}.badge.failed,.badge.error{background:#cf222e}.badge.skipped{background:#9a6700}
tr.bad{background:#fff4f4} tr.warn{background:#fff8e5}
tr.ok td:first-child{border-left:4px solid #1a7f37} tr.bad td:first-child{border-left:4px solid #cf222e}
tr.warn td:first-child{border-left:4px solid #9a6700}
.test{background:#fff;border:1px solid #d0d4d9;border-radius:6px;margin:10px 0;padding:10px 14px}
.test.bad{border-left:5px solid #cf222e} .head{display:flex;align-items:center;gap:6px;flex-wrap:wrap}
.msg{font-family:ui-monospace,Menlo,Consolas,monospace;background:#fff4f4;border:1px solid #f3c1c1;padding:6px 8px;
white-space:pre-wrap;margin:8px 0;font-size:12.5px}
.meta{color:#57606a;font-size:12.5px} img.timeline{max-width:100%;border:1px solid #d0d4d9;margin-top:8px;display:block}
table.violations td{font-size:12.5px} table.violations tr td:first-child{color:#cf222e;font-weight:700}
pre{background:#0d1117;color:#e6edf3;padding:8px 10px;overflow-x:auto;font-size:12px;max-height:420px}
details{margin:6px 0} summary{cursor:pointer;color:#0b5cad} ul.reasons{margin:4px 0 8px}
a{color:#0b5cad}
"""


def write(report_dir: Path, header: Header, groups: Sequence[GroupResult], tables: Sequence[Table] = (),
          repo_root: Path = REPO_ROOT) -> Path:
    """Write ``report_dir/index.html`` and its timeline PNGs (see the module docstring).

    Args:
        report_dir: the run's ``report/`` directory (created).
        header: verdict, reasons, wall time and run-wide seeds.
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
    target = header.sglang
    per_group = [(g, results.read_records(g.run_dir) if g.run_dir else []) for g in groups]
    body = [_header(header, target, sha, dirty, per_group, report_dir)]
    body += [_table(t) for t in tables]
    body.append(_failures_index(per_group))
    for g, records in per_group:
        body.append(_group_tests(g, records, report_dir))
    page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width\"><title>{_e(header.kind)}: {header.word}</title>"
            f"<style>{CSS}</style></head>\n<body><main>\n" + "\n".join(body) + "\n</main></body></html>\n")
    out = report_dir / INDEX
    out.write_text(page, encoding="utf-8")
    log.info("report page: %s", out)
    return out


def _header(h: Header, target: stamp.Target, sha: str, dirty: bool,
            per_group: list[tuple[GroupResult, list[TestRecord]]], report_dir: Path) -> str:
    cls = "pass" if h.passed else "fail"
    out = [f'<h1 id="verdict" class="verdict {cls}">{_e(h.kind)}: {h.word}</h1>']
    if h.reasons:
        out.append('<ul class="reasons">' + "".join(f"<li>{_e(r)}</li>" for r in h.reasons) + "</ul>")
    if h.warnings:
        out.append('<details><summary>warnings</summary><ul class="reasons">'
                   + "".join(f"<li>{_e(w)}</li>" for w in h.warnings) + "</ul></details>")
    seeds = ", ".join(f"{k}={v}" for k, v in h.seeds.items())
    rows = [("sglang target", f"{target.version} · origin {target.origin}" + (f" · commit {target.commit}" if target.commit else "")),
            ("harness commit", f"{sha}{' (uncommitted changes)' if dirty else ''}"),
            ("seeds", seeds or "per group, below"),
            ("wall time", duration(h.wall_time)),
            ("run directory", report_dir.parent.name),
            ("written", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))]
    out.append('<table class="stamp">' + "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows) + "</table>")
    out.append("<h2>Groups</h2><table class=\"groups\"><tr><th>group</th><th>topology</th><th>runner</th><th>simulated</th>"
               "<th>tests</th><th>passed</th><th>failed</th><th>skipped</th><th>wall</th><th>seeds</th><th>note</th></tr>")
    for g, records in per_group:
        props = dict(g.properties)
        state = "ok" if g.ok else "bad"
        bases = sorted({str(dict(r.seeds).get("workload_base")) for r in records if dict(r.seeds).get("workload_base") is not None})
        hyp = sorted({str(dict(r.seeds).get("hypothesis")) for r in records if dict(r.seeds).get("hypothesis") is not None})
        seed_text = ", ".join([f"workload base {'/'.join(bases)}"] * bool(bases) + [f"hypothesis {'/'.join(hyp)}"] * bool(hyp))
        pytest_log = Path(props["log"]) if props.get("log") else (g.run_dir / "pytest.log" if g.run_dir else None)
        note = _e(g.note)
        if pytest_log is not None and pytest_log.is_file():
            note += f' <a href="{_e(_rel(pytest_log, report_dir))}">{_e(pytest_log.name)}</a>'
        out.append(f'<tr class="{state}"><td>{_e(g.name)}</td><td>{_e(g.topology)}</td><td>{_e(g.runner)}</td>'
                   f"<td>{_e(props.get('simulated', '-'))}</td><td class=num>{len(g.cases)}</td>"
                   f"<td class=num>{g.count('passed')}</td><td class=num>{g.count('failed') + g.count('error')}</td>"
                   f"<td class=num>{g.count('skipped')}</td><td class=num>{_e(duration(g.wall_time))}</td>"
                   f"<td>{_e(seed_text or '-')}</td><td>{note}</td></tr>")
    out.append("</table>")
    return "\n".join(out)


def _table(t: Table) -> str:
    out = [f"<h2>{_e(t.title)}</h2>"]
    if t.note:
        out.append(f'<p class="meta">{_e(t.note)}</p>')
    out.append('<table class="run-table"><tr>' + "".join(f"<th>{_e(h)}</th>" for h in t.head) + "</tr>")
    for i, row in enumerate(t.rows):
        cls = t.status[i] if i < len(t.status) else ""
        out.append(f'<tr class="{cls}">' + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _anchor(group: GroupResult, case: CaseResult) -> str:
    return "t-" + _safe(f"{group.name}-{case.nodeid}")


def _failures_index(per_group: list[tuple[GroupResult, list[TestRecord]]]) -> str:
    failing = [(g, c) for g, _ in per_group for c in g.failures]
    notes = [g for g, _ in per_group if g.note]
    if not failing and not notes:
        return ""
    out = ["<h2>Failures</h2><ul>"]
    out += [f"<li><b>{_e(g.name)}</b>: {_e(g.note)}</li>" for g in notes]
    out += [f'<li><a href="#{_anchor(g, c)}"><code>{_e(c.nodeid)}</code></a> ({_e(g.name)}): {_e(c.message or c.outcome)}</li>'
            for g, c in failing]
    out.append("</ul>")
    return "\n".join(out)


def _group_tests(g: GroupResult, records: list[TestRecord], report_dir: Path) -> str:
    out = [f"<h2>Tests of {_e(g.name)} <span class=meta>({_e(g.topology)} on {_e(g.runner)})</span></h2>"]
    if not g.cases:
        out.append(f'<p class="meta">no test results{": " + _e(g.note) if g.note else ""}</p>')
    for case in g.cases:
        out.append(_test(g, case, results.record_for(case.nodeid, records), report_dir))
    return "\n".join(out)


def _rel(path: Path, report_dir: Path) -> str:
    return Path(os.path.relpath(path, report_dir)).as_posix()


def _test(g: GroupResult, case: CaseResult, rec: TestRecord | None, report_dir: Path) -> str:
    bad = case.outcome in ("failed", "error")
    out = [f'<section class="test{" bad" if bad else ""}" id="{_anchor(g, case)}" data-outcome="{case.outcome}">',
           f'<div class="head"><span class="badge {case.outcome}">{case.outcome}</span><h3>{_e(case.nodeid)}</h3>'
           f'<span class="meta">{_e(duration(case.duration))}'
           + (f" · workload seed {_e(dict(rec.seeds).get('workload'))}" if rec and dict(rec.seeds).get("workload") is not None else "")
           + "</span></div>"]
    if case.outcome != "passed" and (case.reason or case.message):
        out.append(f'<div class="msg">{_e(case.reason or case.message)}</div>')
    if rec is not None and rec.ledgers:
        out.append(_timeline(g, case, rec, report_dir))
    if rec is not None and rec.logs:
        out.append(_logs(rec, report_dir, open_=bad))
    if bad and case.traceback:
        out.append(f"<details><summary>traceback</summary><pre>{_e(case.traceback)}</pre></details>")
    out.append("</section>")
    return "\n".join(out)


def _timeline(g: GroupResult, case: CaseResult, rec: TestRecord, report_dir: Path) -> str:
    try:
        events = [ev for span in rec.ledgers for ev in results.span_events(span)]
        ranks = timeline.build(timeline.events_by_worker(events))
    except (ValueError, TypeError) as e:
        return f'<p class="meta">ledger unreadable: {_e(e)}</p>'
    if not ranks:
        return ""
    png = report_dir / TIMELINES / f"{_file_name(g.name + '-' + case.nodeid)}.png"
    try:
        timeline.plot(ranks, png, title=case.nodeid)
    except ImportError as e:  # matplotlib missing: the page still has the tables
        log.warning("no timeline plot for %s: %s", case.nodeid, e)
        img = f'<p class="meta">timeline not drawn: {_e(e)}; install requirements/base.txt</p>'
    else:
        img = (f'<img class="timeline" src="{_e(_rel(png, report_dir))}" '
               f'alt="KV-pool timeline of {_e(case.nodeid)}: pages in use per pool on {len(ranks)} rank(s)">')
    marks = sorted((m for r in ranks for m in r.marks), key=lambda m: int(m.label[1:]))
    peaks = "; ".join(f"{r.worker}: " + ", ".join(f"{p} {n}" for p, n in r.peak.items()) for r in ranks)
    out = ['<div class="timeline-block">',
           f'<p class="meta">ledger: {len(events)} event(s) on {len(ranks)} rank(s) · peak pages in use — {_e(peaks)}'
           f" · {sum(len(r.violation_t) for r in ranks)} violating event(s)</p>", img]
    if marks:
        out.append('<table class="violations"><tr><th></th><th>rule</th><th>at event (first)</th><th>request</th>'
                   "<th>pages the event named</th><th>pages the request held</th><th>what the rule demands</th>"
                   "<th>what broke it</th></tr>")
        for m in marks:
            at = f"{m.worker} #{m.seq} {m.kind} at {m.t:.3f} s" if m.seq is not None else f"{m.worker} (at the end)"
            if m.repeats:
                at += f"; {m.repeats} more event(s) to #{m.last_seq}"
            out.append(f'<tr class="violation" data-rule="{_e(m.rule)}" data-worker="{_e(m.worker)}" '
                       f'data-seq="{_e(m.seq if m.seq is not None else "")}" data-rid="{_e(m.rid)}">'
                       f"<td>{_e(m.label)}</td><td>{_e(m.rule)}</td><td>{_e(at)}</td><td>{_e(m.rid or '-')}</td>"
                       f"<td>{_e(m.pages or '-')}</td><td>{_e(m.held or '-')}</td><td>{_e(m.rule_text)}</td>"
                       f"<td>{_e(m.message)}</td></tr>")
        out.append("</table>")
    rows = [(r.worker, q) for r in ranks for q in r.requests]
    pools = [p for p in timeline.POOLS if any(p in r.used for r in ranks)]
    out.append(f"<details><summary>pages per request ({len({q.rid for _, q in rows})} request(s))</summary>"
               '<table class="requests"><tr><th>request</th><th>rank</th><th>first</th><th>last</th><th>events</th>'
               + "".join(f"<th>peak {p}</th>" for p in pools) + "<th>still held at the end</th></tr>")
    for worker, q in rows:
        held = ", ".join(f"{p} {n}" for p, n in q.held.items() if n)
        out.append(f"<tr{' class=bad' if held else ''}><td>{_e(q.rid)}</td><td>{_e(worker)}</td>"
                   f"<td class=num>{q.first:.3f}</td><td class=num>{q.last:.3f}</td><td class=num>{q.events}</td>"
                   + "".join(f"<td class=num>{q.peak.get(p, 0)}</td>" for p in pools) + f"<td>{_e(held or '-')}</td></tr>")
    out.append("</table></details></div>")
    return "\n".join(out)


def _logs(rec: TestRecord, report_dir: Path, open_: bool) -> str:
    out = []
    for span in rec.logs:
        tail = results.span_tail(span, LOG_TAIL_LINES)
        if not tail.strip():
            continue
        out.append(f"<details{' open' if open_ else ''}><summary>log of {_e(span.name)} while the test ran "
                   f'(last {LOG_TAIL_LINES} lines; <a href="{_e(_rel(span.path, report_dir))}">whole log</a>)</summary>'
                   f"<pre>{_e(tail)}</pre></details>")
    return "\n".join(out)
