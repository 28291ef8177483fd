"""The one reader of results (``harness.report.results``) and the per-test record plugin that feeds it.

JUnit is hand-written; the record is produced by the real plugin in a pytester session whose test
writes a ledger and a worker log into the run directory (no Ray needed for that).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import ledger
from harness import rundir
from harness.report import records
from harness.report import junit
from harness.gates import classify
from harness import faultcheck

pytest_plugins = ["pytester"]

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="suites.pd.test_a.TestC.TestInner" name="test_nested" file="suites/pd/test_a.py" time="0.2"/>
<testcase classname="pd.test_a" name="test_bad" file="{root}/suites/pd/test_a.py" time="1.5">
  <failure message="harness.engines.sim.driver.PDError: 1 problem(s):&#10;[swa-over-window] d#3 rid=r1: too many"
  >E   WorkerDied: no
E   assert 0</failure></testcase>
<testcase classname="x.y" name="test_err"><error message="">fixture 'gpu' not found</error></testcase>
<testcase classname="" name="suites.pd.test_c"><error message="collection failure">ImportError: torch</error></testcase>
</testsuite></testsuites>
"""


def test_junit_node_ids_messages_and_details(tmp_path: Path):
    path = tmp_path / "j.xml"
    path.write_text(JUNIT.format(root=tmp_path))

    cases = junit.read_junit(path, root=tmp_path)

    assert [(c.nodeid, c.outcome) for c in cases] == [
        ("suites/pd/test_a.py::TestC::TestInner::test_nested", "passed"),
        # an absolute file made relative; a classname from another rootdir still names no class
        ("suites/pd/test_a.py::test_bad", "failed"),
        ("x.y::test_err", "error"),
        ("suites.pd.test_c", "error"),
    ]
    bad = cases[1]
    assert bad.message == "harness.engines.sim.driver.PDError: 1 problem(s):"
    assert bad.reason.endswith("rid=r1: too many") and "WorkerDied" in bad.traceback
    assert bad.duration == 1.5 and bad.file == "suites/pd/test_a.py"
    assert cases[2].message == "fixture 'gpu' not found"  # no message attribute: the text's first line
    assert cases[3].file == ""


def test_unreadable_junit_is_one_value_error(tmp_path: Path):
    with pytest.raises(ValueError, match="cannot read JUnit"):
        junit.read_junit(tmp_path / "missing.xml")
    (tmp_path / "cut.xml").write_text("<testsuites><testsuite>")
    with pytest.raises(ValueError, match="not JUnit XML"):
        junit.read_junit(tmp_path / "cut.xml")


def test_every_consumer_reads_the_same_cases(tmp_path: Path):
    path = tmp_path / "j.xml"
    path.write_text(JUNIT.format(root=tmp_path))
    cases = junit.read_junit(path, root=tmp_path)

    fault_view = faultcheck.parse_junit(path, root=tmp_path)
    gate_view = classify.failures(cases)

    assert [(o.test_id, o.outcome, o.message) for o in fault_view] == [(c.nodeid, c.outcome, c.message) for c in cases]
    assert [f.nodeid for f in gate_view] == ["suites/pd/test_a.py::test_bad", "x.y::test_err", "suites.pd.test_c"]
    # classified from the whole message (its second line names the rule), before the traceback's E lines
    assert [f.failure_class for f in gate_view] == ["accounting", "error", "import"]
    assert [f.failure_class for f in classify.failures_from_junit(path.read_text())] == [
        "accounting",
        "error",
        "import",
    ]


def test_spans_read_the_bytes_a_test_wrote(tmp_path: Path):
    path = tmp_path / "ledger" / "d.jsonl"
    with ledger.LedgerWriter(path, "d", "decode") as w:
        w.record("prealloc", "r0", 64, pages={"swa": (1,)})
        mark = path.stat().st_size
        w.record("prealloc", "r1", 64, pages={"swa": (2,)})
        w.record("release", "r1", 64, pages={"swa": (2,)})
    end = path.stat().st_size
    with open(path, "a") as f:
        f.write('{"seq": 3, "kind": "rel')  # a worker killed mid-line

    evs = records.span_events(records.Span(path, mark, path.stat().st_size))

    assert [(e.seq, e.rid) for e in evs] == [(1, "r1"), (2, "r1")]
    log = tmp_path / "w.log"
    log.write_text("old\n" + "".join(f"line {i}\n" for i in range(50)))
    assert records.span_tail(records.Span(log, 4, log.stat().st_size), 3) == "line 47\nline 48\nline 49"
    assert records.span_events(records.Span(path, 0, 0)) == [] and end > mark


def test_record_plugin_writes_what_each_test_wrote(pytester, tmp_path: Path):
    run_dir = tmp_path / "run"
    pytester.makepyfile(
        test_rec="""
        import pytest
        from harness import ledger

        def test_writes(run_dir):
            with ledger.LedgerWriter(run_dir.ledger_file("dec-r0"), "dec-r0", "decode") as w:
                w.record("prealloc", "a", 64, pages={"swa": (1, 2)})
            run_dir.worker_log("dec-r0").write_text("hello from the worker\\n")

        def test_quiet(run_dir):
            pass

        def test_fails(run_dir):
            with open(run_dir.worker_log("dec-r0"), "a") as f:
                f.write("second test line\\n")
            assert False

        @pytest.mark.skip(reason="no")
        def test_skipped():
            pass
    """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--run-dir", str(run_dir), "--workload-seed", "7")
    result.assert_outcomes(passed=2, failed=1, skipped=1)

    recs = records.read_records(run_dir)

    assert [(r.suffix, r.outcome) for r in recs] == [
        ("::test_writes", "passed"),
        ("::test_quiet", "passed"),
        ("::test_fails", "failed"),
        ("::test_skipped", "skipped"),
    ]
    first, quiet, fails, _ = recs
    assert [s.name for s in first.ledgers] == ["dec-r0"] and [s.name for s in first.logs] == ["dec-r0"]
    assert [e.rid for s in first.ledgers for e in records.span_events(s)] == ["a"]
    assert quiet.ledgers == () and quiet.logs == ()
    assert records.span_tail(fails.logs[0]) == "second test line"  # only the bytes this test wrote
    assert dict(first.seeds)["workload_base"] == 7 and first.start <= first.stop <= quiet.start
    assert records.record_for("sub/test_rec.py::test_fails", recs) is fails  # any spelling of the file's path
    assert records.record_for("test_rec.py::test_nope", recs) is None


def test_no_record_without_a_run_directory(pytester):
    pytester.makepyfile("def test_ok(): pass")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--run-dir", "never-made")
    result.assert_outcomes(passed=1)
    assert not (pytester.path / "never-made").exists()


def test_torn_record_lines_are_skipped(tmp_path: Path):
    line = {
        "path": "/x/test_a.py",
        "suffix": "::t",
        "outcome": "passed",
        "start": 1.0,
        "stop": 2.0,
        "ledgers": {"ledger/w.jsonl": [0, 10]},
    }
    (tmp_path / rundir.RECORD_FILE).write_text(json.dumps(line) + "\n" + '{"path": "/x/te')
    [rec] = records.read_records(tmp_path)
    assert rec.ledgers == (records.Span(tmp_path / "ledger" / "w.jsonl", 0, 10),)


XFAIL_TESTS = """
import pytest


@pytest.mark.xfail(reason="sglang#40309: _pre_alloc never reclaims SWA pages", strict=True)
def test_known_bug():
    assert False


@pytest.mark.xfail(reason="sglang#99999: fixed upstream since", strict=True)
def test_fixed_bug():
    assert True


def test_plain():
    assert True
"""


def test_expected_failures_are_counted_and_shown_with_their_reason(pytester, tmp_path: Path):
    from harness.report import result_tables as summary
    from harness.report.results import GroupResult
    from harness.rerun import comment

    pytester.makepyfile(test_xf=XFAIL_TESTS)
    xml = tmp_path / "junit.xml"
    pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--junitxml={xml}", "-o", "junit_family=xunit1")
    cases = {c.nodeid.split("::")[-1]: c for c in junit.read_junit(xml)}
    assert (cases["test_known_bug"].outcome, cases["test_known_bug"].message) == (
        "xfailed",
        "sglang#40309: _pre_alloc never reclaims SWA pages",
    )
    assert cases["test_known_bug"].xfail and not cases["test_plain"].xfail
    # an unexpected pass of a strict xfail is a failure that says why
    assert cases["test_fixed_bug"].outcome == "failed"
    assert cases["test_fixed_bug"].message == "[XPASS(strict)] sglang#99999: fixed upstream since"
    group = GroupResult("cpu", "cpu", "ubuntu-latest", tuple(cases.values()), 1.0, 1)
    md = summary.markdown([group])
    assert "| ❌ cpu | ubuntu-latest | 3 | 1 | 1 | 0 | 1 | 1.0s |" in md
    assert "**Expected failures** (xfail)" in md and "sglang#40309: _pre_alloc never reclaims SWA pages" in md
    assert "[XPASS(strict)] sglang#99999" in md.split("**Expected failures**")[0]
    assert summary.to_json([group])["groups"][0]["counts"]["xfailed"] == 1
    assert ", 1 xfailed" in comment.render_line(comment.from_result(group))
    assert summary.table([group]).splitlines()[0].split()[6] == "xfailed"
