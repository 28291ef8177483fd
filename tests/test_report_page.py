"""The run report: timelines from hand-built ledger events, the page written from a hand-built run
directory, and the links to it from the /rerun-test comment and the gate's summary.md.

The fault case is the "decode never frees out-of-window SWA pages" shape: a request's fourth SWA
page is taken while the bound is three, so the page must mark ``swa-over-window`` at exactly that
event, naming the request and its pages.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from PIL import Image

from harness import ledger
from harness.report import page as html_report
from harness import rundir
from harness.report import results
from harness.report import timeline
from harness.gates import render
from harness.gates.verdict import SuiteOutcome, TestOutcome, judge
from harness.rerun import comment

PAGE, WINDOW = 64, 100  # bound: ceil((100 + 64) / 64) = 3 SWA pages per request


def _ev(
    seq: int, kind: str, rid: str, worker: str = "dec-r0", component: str = "decode", ts: float = 0.0, **kw
) -> ledger.Event:
    return ledger.Event(
        seq=seq,
        ts=1000.0 + (ts or seq * 0.01),
        kind=kind,
        rid=rid,
        component=component,
        worker=worker,
        page_size=PAGE,
        window=WINDOW,
        **kw,
    )


def _faulted() -> dict[str, list[ledger.Event]]:
    """Prefill ships r1; decode takes 2 SWA pages, then never evicts: its 4th SWA page breaks the bound."""
    prefill = [
        _ev(0, "prealloc", "r1", "pre-r0", "prefill", pages={"full": (1, 2, 3), "swa": (1, 2, 3)}),
        _ev(1, "transfer", "r1", "pre-r0", "prefill", pages={"full": (1, 2, 3), "swa": (1, 2, 3)}),
        _ev(2, "release", "r1", "pre-r0", "prefill", pages={"full": (1, 2, 3), "swa": (1, 2, 3)}),
    ]
    config = ledger.Event(
        seq=-1,
        ts=1000.0,
        kind="config",
        rid=ledger.CONFIG_RID,
        component="decode",
        worker="dec-r0",
        page_size=PAGE,
        **ledger.config_event(
            ledger.LedgerConfig(page_size=PAGE, window=WINDOW, swa_tail=True, eviction_interval=1),
            {"full": 64, "swa": 64},
        ),
    )
    decode = [
        config,
        _ev(
            0,
            "prealloc",
            "r1",
            pages={"full": (5, 6, 7), "swa": (8, 9)},
            fill_len=164,
            swa_tail_len=100,
            evicted_seqlen=64,
        ),
        _ev(1, "transfer", "r1", pages={"full": (5, 6, 7), "swa": (8, 9)}),
        _ev(2, "decode_alloc", "r1", pages={"full": (10,), "swa": (11,)}, fill_len=200),  # live span [64, 200): 3 pages
        _ev(3, "decode_alloc", "r1", pages={"full": (12,), "swa": (13,)}),  # 4 SWA pages > 3: the break
        _ev(4, "decode_alloc", "r1", pages={"full": (14,), "swa": (15,)}),  # still over: a repeat
        _ev(5, "decode_alloc", "r2", pages={"full": (20,), "swa": (21,)}),
        _ev(6, "release", "r1", pages={"full": (5, 6, 7, 10, 12, 14), "swa": (8, 9, 11, 13, 15)}),
    ]
    return {"pre-r0": prefill, "dec-r0": decode}


def test_timeline_marks_the_first_event_that_broke_the_rule():
    ranks = timeline.build(_faulted())

    assert [r.worker for r in ranks] == ["pre-r0", "dec-r0"]  # prefill first
    pre, dec = ranks
    assert pre.marks == () and pre.used["swa"] == (3, 3, 0)
    assert dec.used["swa"] == (2, 2, 3, 4, 5, 6, 1) and dec.used["full"][-1] == 1
    flying = [m for m in dec.marks if m.rule == ledger.IN_FLIGHT]
    [over] = [m for m in dec.marks if m.rule == "swa-over-window"]
    assert (over.label, over.seq, over.kind, over.rid) == ("V1", 3, "decode_alloc", "r1")
    assert over.pages == "full [12]; swa [13]" and over.held == "full [5, 6, 7, 10, 12]; swa [8, 9, 11, 13]"
    assert (over.repeats, over.last_seq) == (1, 4)
    assert over.rule_text == ledger.RULES["swa-over-window"]
    assert abs(over.t - 0.03) < 1e-6
    # r2 not released yet: in flight (pages in two pools, one finding), one mark at r2's last event
    assert [(m.rid, m.seq, m.label, m.repeats) for m in flying] == [("r2", 5, "V2", 0)]
    assert len(dec.violation_t) == 3  # swa-over-window twice, r2 in flight once
    assert {q.rid: dict(q.held) for q in dec.requests}["r2"] == {"full": 1, "swa": 1}
    assert "V1 swa-over-window at dec-r0#3 decode_alloc rid=r1 pages full [12]; swa [13]" in over.line()


def test_clean_events_have_no_marks_and_downsampling_keeps_peaks():
    clean = {w: [e for e in evs if e.rid != "r2"] for w, evs in _faulted().items()}
    clean["dec-r0"] = [e for e in clean["dec-r0"] if e.seq < 3 or e.kind == "release"]
    clean["dec-r0"][-1] = _ev(6, "release", "r1", pages={"full": (5, 6, 7, 10), "swa": (8, 9, 11)})
    assert all(r.marks == () for r in timeline.build(clean))

    t = [i / 10 for i in range(10_000)]
    y = [5] * 10_000
    y[7777] = 99  # one spike among 10k points
    xs, ys = timeline.downsample(t, y, max_points=300)
    assert len(xs) <= 301 and max(ys) == 99 and (xs[-1], ys[-1]) == (t[-1], y[-1])


def test_every_rule_the_checker_can_break_has_its_text():
    source = "".join(f.read_text() for f in Path(ledger.__file__).parent.glob("*.py"))  # the ledger package
    raised = set(re.findall(r'bad\("([a-z-]+)"', source)) | set(re.findall(r'Violation\("([a-z-]+)"', source))
    assert raised and raised <= set(ledger.RULES), (
        f"rules without a text in ledger.RULES: {sorted(raised - set(ledger.RULES))}"
    )


def _run_dir(tmp_path: Path) -> tuple[Path, results.GroupResult]:
    """A run directory as rerun-test leaves it: one group with a ledger-writing failing test and a plain one."""
    gdir = tmp_path / "run" / "groups" / "cpu"
    spans = {}
    for worker, evs in _faulted().items():
        path = gdir / "ledger" / f"{worker}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(e.to_json() + "\n" for e in evs))
        spans[f"ledger/{worker}.jsonl"] = [0, path.stat().st_size]
    log = gdir / "workers" / "dec-r0.log"
    log.parent.mkdir(parents=True)
    log.write_text("before the test\n" + "".join(f"decode step {i} <b>\n" for i in range(60)))
    (gdir / "pytest.log").write_text("pytest output\n")
    recs = [
        {
            "path": "/abs/suites/pd/test_a.py",
            "suffix": "::test_long_decode",
            "outcome": "failed",
            "start": 1,
            "stop": 2,
            "seeds": {"workload_base": 7, "workload": 123, "hypothesis": None},
            "workers": ["pre-r0", "dec-r0"],
            "ledgers": spans,
            "logs": {"workers/dec-r0.log": [16, log.stat().st_size]},
        },
        {
            "path": "/abs/suites/pd/test_a.py",
            "suffix": "::test_plain",
            "outcome": "passed",
            "start": 2,
            "stop": 3,
            "seeds": {"workload_base": 7, "workload": 9, "hypothesis": None},
        },
    ]
    (gdir / rundir.RECORD_FILE).write_text("".join(json.dumps(r) + "\n" for r in recs))
    cases = (
        results.CaseResult(
            "suites/pd/test_a.py::test_long_decode",
            "failed",
            1.5,
            "PDError: 1 ledger violation(s)",
            reason="PDError: 1 ledger violation(s)",
            traceback="E   PDError",
        ),
        results.CaseResult("suites/pd/test_a.py::test_plain", "passed", 0.1),
    )
    group = results.GroupResult(
        "cpu", "cpu", "ubuntu-latest", cases, 3.0, 1, properties=(("simulated", "false"), ("run_dir", str(gdir)))
    )
    return tmp_path / "run", group


def test_page_shows_verdict_timeline_and_the_violation_at_its_event(tmp_path: Path):
    run, group = _run_dir(tmp_path)
    header = html_report.Header("rerun-test", passed=False, reasons=("cpu: 1 test(s) failed",), wall_time=4.0)

    page = html_report.write(run / "report", header, [group])

    text = page.read_text()
    assert '<h1 id="verdict" class="verdict fail">rerun-test: FAIL</h1>' in text
    assert "cpu: 1 test(s) failed" in text and "workload base 7" in text
    imgs = re.findall(r'<img class="timeline" src="([^"]+)"', text)
    assert len(imgs) == 1 and re.fullmatch(
        r"timelines/cpu-suites_pd_test_a.py_test_long_decode-[0-9a-f]{8}\.png", imgs[0]
    )
    row = re.search(
        r'<tr class="violation" data-rule="swa-over-window" data-worker="dec-r0" data-seq="3" data-rid="r1" '
        r'data-follows="">(.*?)</tr>',
        text,
    ).group(1)
    assert "full [12]; swa [13]" in row and "swa [8, 9, 11, 13]" in row and "1 more event(s) to #4" in row
    assert ledger.RULES["swa-over-window"] in row
    # the log tail is what the worker wrote during the test, escaped; links are relative to the report
    assert "decode step 59 &lt;b&gt;" in text and "before the test" not in text and "decode step 19 " not in text
    assert 'href="../groups/cpu/workers/dec-r0.log"' in text and 'href="../groups/cpu/pytest.log"' in text
    assert "<script" not in text and "http://" not in text and "https://" not in text  # self-contained, no network
    png = Image.open(run / "report" / imgs[0])
    assert png.size[0] > 500
    assert (
        png.info[timeline.PNG_VIOLATIONS_KEY]
        .splitlines()[0]
        .startswith("V1 swa-over-window at dec-r0#3 decode_alloc rid=r1 pages full [12]; swa [13]")
    )


def test_a_passing_run_and_missing_evidence_still_make_a_page(tmp_path: Path):
    group = results.GroupResult(
        "cpu",
        "cpu",
        "ubuntu-latest",
        (results.CaseResult("t.py::test_x", "passed", 0.1),),
        1.0,
        0,
        properties=(("run_dir", str(tmp_path / "nothing-here")),),
    )
    page = html_report.write(
        tmp_path / "report",
        html_report.Header("rerun-test", passed=True),
        [group],
        [html_report.Table("Extra", ("a", "b"), (("1", "<2>"),), ("ok",))],
    )
    text = page.read_text()
    assert "rerun-test: PASS" in text and "&lt;2&gt;" in text and "<img" not in text and "Failures" not in text


def test_gate_page_tables_and_summary_link():
    tests = (
        TestOutcome("suites/a.py::t1", "cpu", "passed", ("failed", "passed"), "timing", "slow"),
        TestOutcome("suites/a.py::t2", "cpu", "failed", ("failed",), "accounting", "leak"),
    )
    v = judge([SuiteOutcome("unit", True, 1.0, tests)], "", None)
    verdict_table, flaky = render.page_tables(
        v, {"unit/cpu::suites/a.py::t2": "report/failures/x/repro.json"}, [("suites/b.py::t9", 0.5, 1, 2)]
    )
    # suite, kind, passed, failed, skipped, xfailed, flaky
    assert verdict_table.rows[0][:7] == ("unit", "required", "1", "1", "0", "0", "1") and verdict_table.status == (
        "bad",
    )
    assert [r[0] for r in flaky.rows] == ["suites/a.py::t1", "suites/a.py::t2", "suites/b.py::t9"]
    assert flaky.rows[0][2] == "failed → passed" and flaky.rows[1][5] == "report/failures/x/repro.json"
    info = render.RunInfo("g", "run", "abc", False, "0.5.23", "", 1, 2)
    assert "[index.html](index.html)" in render.summary_md(info, v, {}, page="index.html")
    assert "index.html" not in render.summary_md(info, v, {})


def test_rerun_comment_names_the_report_in_the_artifacts():
    res = results.GroupResult("cpu", "cpu", "ubuntu-latest", (), 1.0, 0)
    line = comment.render_line(comment.from_result(res, link="https://ci/run/1"))
    assert "[report](https://ci/run/1#artifacts) `rerun-cpu/report/index.html`" in line
    # the workflow uploads the group's run directory under that artifact name
    workflow = (Path(__file__).resolve().parents[1] / "ci" / "workflows" / "rerun-test.yml").read_text()
    assert f"name: {comment.ARTIFACT_PREFIX}${{{{ matrix.name }}}}" in workflow and "path: runs/ci" in workflow


@pytest.mark.parametrize("bad", ["not json", '{"kind": "prealloc"}'])
def test_an_unreadable_ledger_is_said_on_the_page(tmp_path: Path, bad: str):
    run, group = _run_dir(tmp_path)
    path = Path(dict(group.properties)["run_dir"]) / "ledger" / "dec-r0.jsonl"
    path.write_text(bad + "\n" + path.read_text())
    text = html_report.write(run / "report", html_report.Header("rerun-test", passed=False), [group]).read_text()
    assert "ledger unreadable" in text and "rerun-test: FAIL" in text


def test_an_expected_failure_is_shown_as_xfail_with_its_reason(tmp_path: Path):
    case = results.CaseResult(
        "t.py::test_known_bug",
        "xfailed",
        0.1,
        message="sglang#40309: never reclaims SWA pages",
        reason="sglang#40309: never reclaims SWA pages",
    )
    group = results.GroupResult("cpu", "cpu", "ubuntu-latest", (case,), 1.0, 0)
    text = html_report.write(tmp_path / "report", html_report.Header("rerun-test", passed=True), [group]).read_text()
    assert '<span class="badge xfailed">xfailed</span>' in text
    assert (
        '<div class="msg xfailed"><span class=why>expected failure: </span>sglang#40309: never reclaims SWA pages</div>'
        in text
    )
    assert "Failures" not in text  # an expected failure is not a failure
    # groups table: tests, passed, failed, skipped, xfailed
    assert (
        "<td class=num>1</td><td class=num>0</td><td class=num>0</td><td class=num>0</td><td class=num>1</td>" in text
    )


def test_timelines_drawn_while_the_run_goes_are_the_pages_own(tmp_path: Path):
    # rerun-test draws finished tests' timelines while its groups run; the page then shows those very
    # PNGs (not drawn again) and still draws one that is missing. A test whose record is not written
    # yet is not done with (asked again later); one without ledger events is, with no PNG.
    run, group = _run_dir(tmp_path)
    gdir, (faulted, plain) = group.run_dir, group.cases
    late = results.CaseResult("suites/pd/test_a.py::test_not_recorded_yet", "passed", 0.1)
    done = html_report.draw_timelines(run / "report", "cpu", gdir, [faulted, plain, late])
    assert done == [faulted.nodeid, plain.nodeid]
    (png,) = (run / "report" / html_report.TIMELINES).iterdir()
    assert png.name.startswith("cpu-suites_pd_test_a.py_test_long_decode-")
    drawn_at = png.stat().st_mtime_ns
    header = html_report.Header("rerun-test", passed=False, reasons=(), wall_time=4.0)
    text = html_report.write(run / "report", header, [group]).read_text()
    assert f'src="timelines/{png.name}"' in text and png.stat().st_mtime_ns == drawn_at
    png.unlink()
    html_report.write(run / "report", header, [group])
    assert png.exists(), "the page draws a timeline nobody drew before it"
