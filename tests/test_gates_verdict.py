"""Pure parts of the gates: failure classes, the verdict, the flaky record, the reports and JUnit merge."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from harness.gates import classify, history, render
from harness.gates import bundle as repro
from harness.gates.verdict import SuiteOutcome, TestOutcome, judge, judge_suite


def T(nodeid, outcome, attempts=None, cls="", msg="", group="cpu"):
    return TestOutcome(
        nodeid=nodeid, group=group, outcome=outcome, attempts=attempts or (outcome,), failure_class=cls, message=msg
    )


# ------------------------------------------------------------------ classification


@pytest.mark.parametrize(
    "kind, message, text, expected",
    [
        ("failure", "harness.workers.WorkerDied: decode-0 died (SIGKILL)", "", "crash"),
        ("failure", "RuntimeError: boom", "E   Fatal Python error: Segmentation fault", "crash"),
        ("error", "collection failure", "E   ModuleNotFoundError: No module named 'sgl_kernel'", "import"),
        ("failure", "Failed: Timeout >300.0s", "", "timeout"),
        ("failure", "AssertionError: ledger violations: [page-leak] decode-0", "", "accounting"),
        ("failure", "AssertionError: free pages 3 != 4 after release (latency fine)", "", "accounting"),
        ("failure", "AccuracyError: gsm8k 0.61 < 0.70", "", "accuracy"),
        ("failure", "TimingError: decode latency 12 ms > 10 ms", "", "timing"),
        ("failure", "AssertionError: assert 3 == 4", "", "assertion"),
        ("failure", "ValueError: bad", "", "error"),
        ("error", "failed on setup with TimingError: latency", "", "error"),  # setup problems are never flaky
        # source lines of a traceback do not count, only the raised exception (E lines)
        (
            "failure",
            "PDError: cannot admit",
            '    """WorkerDied: a rank died."""\nE   PDError: cannot admit',
            "accounting",
        ),
        ("failure", "ValueError: bad", '    """WorkerDied: a rank died."""\nE   ValueError: bad', "error"),
        # invariant failures are accounting whatever words they carry, so the flaky policy never reruns them
        ("failure", "AssertionError: fill 300: [swa-tail-short] tail 44 (throughput fine)", "", "accounting"),
        ("failure", "KVCorruption in request r3: full buffer 0 (latency)", "", "accounting"),
        ("failure", "harness.engines.sim.decode_rank.WindowLost: position 200 too slow", "", "accounting"),
        # a stall (a request in flight when the test gave up on it) is a timeout, never accounting, whatever
        # ledger words its line quotes and even without the client's "timed out"
        (
            "failure",
            "stall: request r9: decode prealloc at +0.03 s, nothing after it for 120 s; prefill never scheduled "
            "it | decode released it 0.3 s after the failure (abort: client gave up); the test saw: timeout "
            "ReadTimeout: HTTPConnectionPool(host='127.0.0.1', port=1): Read timed out.",
            "E   requests.exceptions.ReadTimeout: Read timed out.",
            "timeout",
        ),
        (
            "failure",
            "stall: request r9 (decode-0, last phase prealloc) still in flight; the test saw: LedgerBroken: "
            "ledger broken of decode-0: 1 violation(s) [in-flight-at-end] decode-0 rid=r9: decode request ...",
            "E   harness.ledger.causes.LedgerBroken: ledger broken",
            "timeout",
        ),
        ("failure", "ledger [in-flight-at-end] decode-0 prealloc of r9: ...", "", "accounting"),  # never a headline
    ],
)
def test_classify(kind, message, text, expected):
    assert classify.classify(kind, message, text) == expected


def test_failures_from_junit_matches_rerun_node_ids():
    xml = """<testsuites><testsuite name="cpu" tests="3">
      <testcase classname="suites.a.test_x.TestC" name="test_ok" file="suites/a/test_x.py" time="0.1"/>
      <testcase classname="suites.a.test_x.TestC" name="test_slow" file="suites/a/test_x.py" time="0.1">
        <failure message="TimingError: latency 20 ms">E   TimingError: latency 20 ms</failure></testcase>
      <testcase classname="suites.a.test_x" name="test_boot[p1]" file="suites/a/test_x.py" time="0.1">
        <error message="failed on setup with &quot;ImportError: x&quot;">E   ImportError: x</error></testcase>
    </testsuite></testsuites>"""
    got = {(f.nodeid, f.kind, f.failure_class) for f in classify.failures_from_junit(xml)}
    assert got == {
        ("suites/a/test_x.py::TestC::test_slow", "failure", "timing"),
        ("suites/a/test_x.py::test_boot[p1]", "error", "import"),
    }
    with pytest.raises(ValueError):
        classify.failures_from_junit("<nope")


def test_flaky_policy_never_reruns_an_invariant_failure():
    from harness.gates.model import FlakyPolicy

    policy = FlakyPolicy(reruns=3, classes=("accuracy", "timing"))
    for message in ("AssertionError: [reserve-short] pool 'swa' (latency)", "KVCorruption: tokens/s"):
        assert not policy.may_rerun(classify.classify("failure", message), 1)
    assert policy.may_rerun(classify.classify("failure", "TimingError: decode latency 12 ms"), 1)


# ------------------------------------------------------------------ verdict


def test_a_required_test_that_skipped_fails_the_gate_naming_it_and_its_reason():
    dsv4 = "suites/disaggregation/test_disaggregation_dsv4_server.py"
    tests = (
        T("suites/unit/test_a.py::test_ok", "passed"),
        T(
            f"{dsv4}::test_pd_matches_plain[hisparse-off]",
            "skipped",
            group="8-gpu-h200",
            msg="needs 8 real GPUs (8-gpu-h200); this machine has 0",
        ),
    )
    pd = SuiteOutcome("pd", True, 1.0, tests, require=(dsv4,))
    v = judge([pd])
    assert not v.passed
    assert v.reasons == (
        f"pd: required test {dsv4}::test_pd_matches_plain[hisparse-off] [8-gpu-h200] skipped: "
        "needs 8 real GPUs (8-gpu-h200); this machine has 0",
    )
    # not collected at all is no better than skipped; and a required test that ran passes
    assert "did not run here" in judge([SuiteOutcome("pd", True, 1.0, tests[:1], require=(dsv4,))]).reasons[0]
    ran = (tests[0], T(f"{dsv4}::test_pd_matches_plain[hisparse-off]", "passed", group="8-gpu-h200"))
    assert judge([SuiteOutcome("pd", True, 1.0, ran, require=(dsv4,))]).passed


def test_required_failure_fails_informational_only_warns():
    req = SuiteOutcome("unit", True, 1.0, (T("a", "passed"), T("b", "failed", cls="assertion", msg="assert 1 == 2")))
    info = SuiteOutcome("bench", False, 1.0, (T("c", "failed", cls="timing", msg="slow"),))
    v = judge([req, info])
    assert not v.passed and v.word == "FAIL"
    assert v.reasons == ("unit: pass rate 50.0% (1/2) is below 100.0%", "unit: b [cpu] assertion: assert 1 == 2")
    assert v.warnings == (
        "(informational) bench: pass rate 0.0% (0/1) is below 100.0%",
        "(informational) bench: c [cpu] timing: slow",
    )
    v = judge([SuiteOutcome("unit", True, 1.0, (T("a", "passed"),)), info])
    assert v.passed and v.word == "PASS" and v.reasons == () and len(v.warnings) == 2


def test_pass_rate_threshold():
    tests = tuple(T(f"t{i}", "passed") for i in range(19)) + (T("t19", "failed", cls="assertion", msg="off by one"),)
    assert judge_suite(SuiteOutcome("s", True, 0.95, tests)).ok  # 95 % ≥ 95 %
    v = judge_suite(SuiteOutcome("s", True, 0.96, tests))
    assert not v.ok and v.reasons == ("s: pass rate 95.0% (19/20) is below 96.0%",)
    # skips are not runs; a suite where nothing ran has no evidence
    assert judge_suite(SuiteOutcome("s", True, 0.95, tests + (T("sk", "skipped"),))).ok
    v = judge_suite(SuiteOutcome("s", True, 0.5, (T("sk", "skipped"),)))
    assert v.reasons == ("s: no test ran (1 skipped); a gate needs evidence",)


@pytest.mark.parametrize("cls", ["crash", "import", "accounting"])
def test_never_tolerated_classes_fail_whatever_the_rate(cls):
    tests = tuple(T(f"t{i}", "passed") for i in range(99)) + (T("bad", "failed", cls=cls, msg="x"),)
    v = judge_suite(SuiteOutcome("s", True, 0.9, tests))
    assert not v.ok and v.reasons == (f"s: bad [cpu] {cls}: x",)


def test_flaky_pass_counts_as_pass_with_warning_and_notes_and_errors_fail():
    s = SuiteOutcome("s", True, 1.0, (T("f", "passed", ("failed", "passed"), cls="timing"),))
    v = judge([s])
    assert v.passed and s.flaky == 1 and v.warnings == ("s: f [cpu] passed after 1 flaky rerun(s) (timing)",)
    v = judge(
        [SuiteOutcome("s", True, 1.0, (T("a", "passed"),), notes=("[cpu] timed out; see the group's pytest.log",))]
    )
    assert v.reasons == ("s: [cpu] timed out; see the group's pytest.log",)
    v = judge([SuiteOutcome("s", True, 1.0, error="'suites/x/' holds no registered suite file with tests")])
    assert v.reasons == ("s: 'suites/x/' holds no registered suite file with tests",)


def test_sglang_version_is_required():
    ok = [SuiteOutcome("s", True, 1.0, (T("a", "passed"),))]
    assert judge(ok, "0.5.23", "0.5.23").passed and judge(ok, "", None).passed
    v = judge(ok, "0.5.23", "0.5.24")
    assert v.reasons == ("sglang 0.5.23 is required, found 0.5.24; run it with --sglang 0.5.23",)
    assert "found not installed" in judge(ok, "0.5.23", None).reasons[0]


# ------------------------------------------------------------------ flaky record


def test_history_round_trip_and_window(tmp_path):
    path = tmp_path / "runs" / history.FILE_NAME
    history.append(path, "r1", {"a": ["passed"], "b": ["failed"], "c": ["passed"], "s": ["skipped"]}, gate="g", ts=1.0)
    history.append(path, "r2", {"a": ["failed", "passed"], "b": ["failed"], "c": ["passed"]}, ts=2.0)
    history.append(path, "r3", {"a": ["passed"], "b": ["failed"], "c": ["failed"]}, ts=3.0)
    with open(path, "a") as f:
        f.write('{"run": "killed mid-wr')  # a run killed while writing
    records = history.read(path)
    assert [r["run"] for r in records] == ["r1", "r2", "r3"] and "s" not in records[0]["tests"]
    got = [(t.nodeid, t.passed, t.attempts, t.runs, t.last) for t in history.flaky(records)]
    assert got == [("c", 2, 3, 3, "failed"), ("a", 3, 4, 3, "passed")]  # b always fails: broken, not flaky
    assert [t.nodeid for t in history.flaky(records, last=1)] == []  # r3 alone: a passed, c failed once
    assert [t.nodeid for t in history.flaky(records, last=2)] == ["c", "a"]
    assert history.read(tmp_path / "none.jsonl") == []


def test_flaky_command(tmp_path, capsys):
    from harness import cli

    path = tmp_path / history.FILE_NAME
    assert cli.main(["flaky", "--history", str(path)]) == 0
    assert "no flaky tests in the last 0 run(s)" in capsys.readouterr().out
    history.append(path, "r1", {"suites/x.py::t": ["failed", "passed"], "suites/y.py::u": ["passed"]})
    assert cli.main(["flaky", "--history", str(path), "--last", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[1].split() == ["50%", "1/2", "passed", "suites/x.py::t"]


# ------------------------------------------------------------------ reports


INFO = render.RunInfo(
    gate="g",
    run_dir="runs/x",
    git_sha="abc123",
    git_dirty=True,
    sglang_version="0.5.23",
    sglang_required="0.5.23",
    hypothesis_seed=3,
    workload_seed=4,
    wall_time=9.5,
)


def test_merged_junit_stamps_every_suite():
    a = (
        '<testsuite name="cpu" tests="2" failures="1"><testcase name="t1" classname="m"/>'
        '<testcase name="t2" classname="m">'
        '<failure message="x"/></testcase></testsuite>'
    )
    b = (
        '<testsuites><testsuite name="2-gpu-h100" tests="1" skipped="1"><properties>'
        '<property name="topology" value="old"/>'
        '</properties><testcase name="t3" classname="m"><skipped/></testcase></testsuite></testsuites>'
    )
    root = ET.fromstring(
        render.merged_junit(
            INFO,
            [
                (a, {"group": "unit/cpu", "topology": "cpu"}),
                (b, {"group": "pd/2-gpu-h100", "topology": "2-gpu-h100"}),
                ("not xml", {"group": "pd/8-gpu-h200", "topology": "8-gpu-h200"}),
            ],
        )
    )
    assert (root.get("tests"), root.get("failures"), root.get("skipped")) == ("3", "1", "1")
    suites = {
        s.get("name"): {p.get("name"): p.get("value") for p in s.iter("property")} for s in root.iter("testsuite")
    }
    assert list(suites) == ["unit/cpu", "pd/2-gpu-h100", "pd/8-gpu-h200"]
    for name, topo in (("unit/cpu", "cpu"), ("pd/2-gpu-h100", "2-gpu-h100"), ("pd/8-gpu-h200", "8-gpu-h200")):
        p = suites[name]
        assert p["topology"] == topo and p["git_sha"] == "abc123" and p["sglang_version"] == "0.5.23"
        assert p["git_dirty"] == "true" and p["hypothesis_seed"] == "3" and p["workload_seed"] == "4"
    assert suites["pd/8-gpu-h200"]["error"].startswith("unreadable JUnit")


def test_summary_and_result():
    s = SuiteOutcome("unit", True, 1.0, (T("a", "passed"), T("b", "failed", cls="accounting", msg="[page-leak] d0")))
    v = judge([s], "0.5.23", "0.5.23")
    repros = {"unit/cpu::b": "report/failures/unit-b/repro.json"}
    md = render.summary_md(INFO, v, repros)
    assert md.startswith("# Gate `g`: ❌ FAIL\n")
    assert "| unit | required | 1 | 1 | 0 | 0 | 50.0% | 100% | ❌ |" in md
    assert (
        "- `b` (unit, cpu) **accounting** after 1 run(s): [page-leak] d0 — repro: `report/failures/unit-b/repro.json`"
        in md
    )
    res = render.result_json(INFO, v, repros)
    assert res["verdict"] == "FAIL" and res["git_sha"] == "abc123" and res["seeds"] == {"hypothesis": 3, "workload": 4}
    assert res["suites"][0]["tests"][1]["repro"] == "report/failures/unit-b/repro.json"
    assert render.verdict_lines(v)[0] == "FAIL" and render.verdict_lines(v)[1].startswith(
        "  reason: unit: pass rate 50.0%"
    )


def test_environment_differences():
    rec = repro.environment({"HARNESS_FAULTS": "swa-tail", "HOME": "/x", "RAY_ADDRESS": "h:1"})
    assert rec["env"] == {"HARNESS_FAULTS": "swa-tail"}  # HOME is noise, RAY_ADDRESS differs by design
    now = {**rec, "packages": {**rec["packages"], "torch": "9.9"}, "env": {}}
    assert repro.env_differences(rec, now) == [
        f"packages.torch: {rec['packages']['torch']} → 9.9",
        "env.HARNESS_FAULTS: swa-tail → (unset)",
    ]
    assert repro.env_differences(rec, rec) == []
