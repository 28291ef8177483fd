"""The kill matrix (``harness.faultcheck.kill_matrix``) and ``harness faults``.

The matrix logic is tested on hand-written JUnit XML and on tiny pytest projects in ``tmp_path``
whose tests, when a given fault is injected, write its marker and fail with (or without) its
evidence, so these tests never import sglang. The real catalog over the real suites is what
``harness faults check`` runs in CI (and ``tests/test_fault_patches.py`` runs one patch for real).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness import faults
from harness import faultcheck

pytestmark = pytest.mark.est_time(45)

#: The upstream fixes the catalog must cover (issues 8 and 14), each fault with the issue it mirrors.
REQUIRED_FAULTS = (
    "swa-tail-unaligned",
    "swa-tail-short",
    "prealloc-no-swa-evict",
    "release-leaks-swa",
    "swa-full-length",
    "decode-reserve-unaligned",
    "hisparse-budget-swa",
    "decode-skips-swa-evict",
)
UPSTREAM = ("#35286", "#35396", "#35265", "#40309", "#30408", "#24036")

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5">
<testcase classname="suites.unit.test_a" name="test_ok" file="suites/unit/test_a.py" line="3" time="0.1"/>
<testcase classname="suites.unit.test_a" name="test_bad[p1]" file="suites/unit/test_a.py" line="7" time="0.1">
  <failure message="AssertionError: ledger after prealloc&#10;second line">trace</failure></testcase>
<testcase classname="suites.unit.test_b.TestPools" name="test_leak" file="suites/unit/test_b.py" line="9" time="0.1">
  <error message="fixture broke">trace</error></testcase>
<testcase classname="suites.unit.test_b" name="test_gpu" file="suites/unit/test_b.py" line="20" time="0">
  <skipped type="pytest.skip" message="no GPU">skip</skipped></testcase>
<testcase classname="" name="suites.unit.test_c" time="0"><error message="collection failure">trace</error></testcase>
</testsuite></testsuites>
"""


def _run(
    label: str,
    outcomes: dict[str, str],
    returncode: int = 1,
    texts: dict[str, str] | None = None,
    fired: tuple[str, ...] = ("f",),
) -> faultcheck.SuiteRun:
    texts = texts or {}
    cases = tuple(
        faultcheck.TestOutcome(
            test_id=t,
            file=t.split("::")[0],
            outcome=o,
            text=texts.get(t, "E   [page-leak] d0: pool 'swa' ..." if o == "failed" else ""),
        )
        for t, o in outcomes.items()
    )
    return faultcheck.SuiteRun(
        label=label,
        suites=(),
        returncode=returncode,
        outcomes=cases,
        wall_s=1.0,
        junit=Path("j.xml"),
        log=Path("l.log"),
        fired=frozenset(fired),
    )


EVIDENCE = ("[page-leak]",)


# ---------------------------------------------------------------------------- JUnit and cells


def test_parse_junit_reads_ids_files_and_outcomes(tmp_path: Path):
    path = tmp_path / "r.xml"
    path.write_text(JUNIT)

    got = {o.test_id: o for o in faultcheck.parse_junit(path, root=tmp_path)}

    assert {t: o.outcome for t, o in got.items()} == {
        "suites/unit/test_a.py::test_ok": "passed",
        "suites/unit/test_a.py::test_bad[p1]": "failed",
        "suites/unit/test_b.py::TestPools::test_leak": "error",
        "suites/unit/test_b.py::test_gpu": "skipped",
        "suites.unit.test_c": "error",
    }
    assert got["suites/unit/test_a.py::test_bad[p1]"].message == "AssertionError: ledger after prealloc"
    assert got["suites/unit/test_b.py::TestPools::test_leak"].file == "suites/unit/test_b.py"


def test_parse_junit_of_a_killed_run_is_empty(tmp_path: Path):
    assert faultcheck.parse_junit(tmp_path / "missing.xml") == ()
    (tmp_path / "cut.xml").write_text("<testsuites><testsuite>")
    assert faultcheck.parse_junit(tmp_path / "cut.xml") == ()


def test_cells_count_only_tests_that_passed_clean():
    clean = _run("clean", {"s/a.py::t1": "passed", "s/a.py::t2": "skipped", "s/b.py::t3": "passed"}, 0)
    run = _run("f", {"s/a.py::t1": "failed", "s/a.py::t2": "error", "s/b.py::t3": "passed"})

    cells = faultcheck.build_cells("f", ("s/a.py", "s/b.py::t3"), clean, run, EVIDENCE)

    assert cells == (
        faultcheck.Cell("f", "s/a.py", faultcheck.CAUGHT, ("s/a.py::t1",)),
        faultcheck.Cell("f", "s/b.py", faultcheck.MISSED),
    )
    assert faultcheck.verdict("f", cells, run).status == faultcheck.CAUGHT


def test_a_directory_suite_owns_the_files_under_it():
    clean = _run("clean", {"s/unit/x/a.py::t": "passed"}, 0)
    run = _run("f", {"s/unit/x/a.py::t": "failed"})
    assert faultcheck.build_cells("f", ("s/unit",), clean, run, EVIDENCE)[0].status == faultcheck.CAUGHT
    assert faultcheck.build_cells("f", ("s/un",), clean, run, EVIDENCE)[0].status == faultcheck.NOT_APPLICABLE


def test_a_failure_without_the_evidence_is_broken_not_caught():
    clean = _run("clean", {"s/a.py::t": "passed", "s/a.py::u": "passed"}, 0)
    # sglang's own assert, a TypeError of stale code: a failure, but not the evidence the fault names
    run = _run(
        "f",
        {"s/a.py::t": "failed", "s/a.py::u": "passed"},
        texts={"s/a.py::t": "E   AssertionError: swa_evicted_seqlen % page_size == 0"},
    )

    [cell] = faultcheck.build_cells("f", ("s/a.py",), clean, run, EVIDENCE)

    assert cell.status == faultcheck.BROKEN and "failed without the evidence" in cell.reason
    assert faultcheck.verdict("f", [cell], run).status == faultcheck.BROKEN


def test_an_error_outside_the_test_body_is_broken_even_with_the_evidence():
    clean = _run("clean", {"s/a.py::t": "passed"}, 0)
    run = _run("f", {"s/a.py::t": "error"}, texts={"s/a.py::t": "E   [page-leak] in teardown"})
    [cell] = faultcheck.build_cells("f", ("s/a.py",), clean, run, EVIDENCE)
    assert cell.status == faultcheck.BROKEN and "outside the test body" in cell.reason


def test_a_catch_by_one_suite_wins_over_a_broken_one():
    clean = _run("clean", {"s/a.py::t": "passed", "s/b.py::t": "passed"}, 0)
    run = _run("f", {"s/a.py::t": "failed", "s/b.py::t": "failed"}, texts={"s/b.py::t": "E   TypeError"})
    cells = faultcheck.build_cells("f", ("s/a.py", "s/b.py"), clean, run, EVIDENCE)
    assert [c.status for c in cells] == [faultcheck.CAUGHT, faultcheck.BROKEN]
    assert faultcheck.verdict("f", cells, run).status == faultcheck.CAUGHT


def test_a_fault_whose_code_never_ran_is_broken():
    clean = _run("clean", {"s/a.py::t": "passed"}, 0)
    run = _run("f", {"s/a.py::t": "failed"}, fired=())
    cells = faultcheck.build_cells("f", ("s/a.py",), clean, run, EVIDENCE)
    got = faultcheck.verdict("f", cells, run)
    assert got.status == faultcheck.BROKEN and "never ran" in got.reason


def test_all_skipped_is_not_applicable_and_a_missed_fault_fails_the_check():
    clean = _run("clean", {"s/gpu.py::t": "skipped", "s/a.py::t": "passed"}, 0)
    run = _run("f", {"s/gpu.py::t": "skipped", "s/a.py::t": "passed"})
    cells = faultcheck.build_cells("f", ("s/gpu.py", "s/a.py"), clean, run, EVIDENCE)
    assert [c.status for c in cells] == [faultcheck.NOT_APPLICABLE, faultcheck.MISSED]
    v = faultcheck.verdict("f", cells, run)
    assert v.status == faultcheck.MISSED
    assert not faultcheck.Matrix(clean=clean, runs={"f": run}, cells=cells, verdicts=(v,)).ok
    assert "| f | missed | n/a | missed |" in faultcheck.table(
        faultcheck.Matrix(clean=clean, cells=cells, verdicts=(v,))
    )


def test_a_run_that_did_not_finish_is_broken_not_caught():
    clean = _run("clean", {"s/a.py::t": "passed"}, 0)
    run = _run("f", {"s/a.py::t": "error"}, returncode=2)  # e.g. a collection error

    cells = faultcheck.build_cells("f", ("s/a.py",), clean, run, EVIDENCE)

    assert cells[0].status == faultcheck.BROKEN
    assert faultcheck.verdict("f", cells, run).status == faultcheck.BROKEN


def test_a_patch_that_does_not_apply_is_said_and_not_counted():
    clean = _run("clean", {"s/a.py::t": "passed"}, 0)
    caught = faultcheck.Verdict("g", faultcheck.CAUGHT)
    skipped = faultcheck.Verdict("f", faultcheck.NOT_APPLIED, "patch does not apply: decode.py: hunk 1 ...")
    assert faultcheck.Matrix(clean=clean, verdicts=(caught, skipped)).ok
    assert not faultcheck.Matrix(clean=clean, verdicts=(skipped,)).ok  # nothing counted: no evidence at all


# ---------------------------------------------------------------------------- catalog


def test_catalog_covers_the_upstream_fixes_with_evidence_and_selections():
    known = faults.catalog()
    for name in REQUIRED_FAULTS:
        fault = known[name]
        assert fault.description and "\n" not in fault.description
        assert "sglang#" in fault.upstream
        assert fault.is_patch, f"{name}: sglang faults are source patches"
        assert fault.evidence and fault.suites, f"{name} must name its evidence and the suites carrying it"
        assert all((faultcheck.REPO_ROOT / faultcheck.suite_file(t)).exists() for t in fault.suites), fault.suites
    covered = " ".join(f.upstream for f in known.values())
    assert all(issue in covered for issue in UPSTREAM)
    assert not known["corrupt-kv-page"].is_patch  # the harness's own transfer keeps its runtime wrapper


def test_every_accounting_suite_module_exists():
    assert all((faultcheck.REPO_ROOT / s).is_file() for s in faultcheck.ACCOUNTING_SUITES)


# ---------------------------------------------------------------------------- subprocess runs


CATCHER = """
import os

def test_prealloc():
    if "corrupt-kv-page" in os.environ.get("HARNESS_FAULTS", ""):
        open(os.environ["HARNESS_FAULT_FIRED"], "a").write("corrupt-kv-page\\n")  # as the fault would
        raise AssertionError("KVCorruption in request r0: full buffer 0 position 3")

def test_unrelated():
    pass
"""


def _project(tmp_path: Path, body: str = CATCHER) -> Path:
    root = tmp_path / "proj"
    (root / "suites").mkdir(parents=True)
    (root / "suites" / "test_catcher.py").write_text(body)
    return root


def test_check_catches_a_fault_and_reports_a_miss(tmp_path: Path):
    root = _project(tmp_path)

    result = faultcheck.check(
        ["corrupt-kv-page", "decode-reserve-unaligned"],
        suites=("suites/test_catcher.py",),
        out_dir=tmp_path / "out",
        jobs=2,
        timeout_s=300,
        root=root,
    )

    assert result.clean.passed and len(result.clean.outcomes) == 2
    # decode-reserve-unaligned's patch goes on the import path, but nothing here imports sglang
    assert [(v.fault, v.status) for v in result.verdicts] == [
        ("corrupt-kv-page", faultcheck.CAUGHT),
        ("decode-reserve-unaligned", faultcheck.BROKEN),
    ]
    assert "never ran" in result.verdicts[1].reason
    caught = result.cells[0]
    assert caught.tests == ("suites/test_catcher.py::test_prealloc",)
    assert not result.ok
    assert (tmp_path / "out" / "junit" / "corrupt-kv-page.xml").is_file()
    text = faultcheck.render(result)
    assert "corrupt-kv-page" in text and "1/2 faults caught" in text
    data = faultcheck.to_dict(result)
    assert data["ok"] is False and data["faults"][0]["suites"][0]["tests"] == ["suites/test_catcher.py::test_prealloc"]
    assert data["faults"][0]["fired"] is True
    # the run's HTML page: the fault × suite table, then each run's tests
    page = faultcheck.write_page(result, tmp_path / "out", root).read_text()
    assert "faults check: FAIL" in page and "decode-reserve-unaligned: broken (its broken code never ran" in page
    assert "<th>suites/test_catcher.py</th>" in page and "<td>caught (1)</td>" in page
    assert "Tests of corrupt-kv-page" in page and 'href="../workers/corrupt-kv-page.log"' in page


def test_check_stops_when_the_clean_run_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # A fault named in the caller's env must not reach the clean run either.
    monkeypatch.setenv(faults.ENV_VAR, "corrupt-kv-page")
    root = _project(tmp_path, CATCHER + "\ndef test_broken_anyway():\n    assert False\n")

    result = faultcheck.check(
        ["corrupt-kv-page"], suites=("suites",), out_dir=tmp_path / "out", timeout_s=120, root=root
    )

    assert not result.clean.passed and result.runs == {} and not result.ok
    assert set(result.clean.failing()) == {"suites/test_catcher.py::test_broken_anyway"}
    assert "clean run must pass first" in faultcheck.render(result)


SKIPPED_CLEAN_FIRST = """
import os
import pytest

FAULT = "corrupt-kv-page" in os.environ.get("HARNESS_FAULTS", "")

def test_skipped_clean():
    if not FAULT:
        pytest.skip("only under the fault")
    raise AssertionError("KVCorruption in a test the clean run skipped")

def test_catches():
    if FAULT:
        open(os.environ["HARNESS_FAULT_FIRED"], "a").write("corrupt-kv-page\\n")
        raise AssertionError("KVCorruption in request r0: full buffer 0 position 3")
"""


def test_a_run_stopped_at_a_catch_the_clean_run_does_not_count_runs_again_whole(tmp_path: Path):
    # The first failure with the evidence is a test the clean run skipped: it is not counted, so the run
    # that stopped there decides nothing, and the fault runs again with every test (the second catches).
    root = _project(tmp_path, SKIPPED_CLEAN_FIRST)
    result = faultcheck.check(
        ["corrupt-kv-page"], suites=("suites/test_catcher.py",), out_dir=tmp_path / "out", root=root
    )
    assert [(v.fault, v.status) for v in result.verdicts] == [("corrupt-kv-page", faultcheck.CAUGHT)]
    assert [c.tests for c in result.cells] == [("suites/test_catcher.py::test_catches",)]
    assert not result.runs["corrupt-kv-page"].stop_at_catch  # the whole run's result


def test_clean_run_taken_from_an_earlier_junit_report(tmp_path: Path):
    """--clean-junit: the clean results come from the test run's report; the faults still run."""
    root = _project(tmp_path)
    earlier = faultcheck.run_suites("earlier", ("suites",), tmp_path / "earlier", root=root)
    assert earlier.passed

    result = faultcheck.check(
        ["corrupt-kv-page"],
        suites=("suites/test_catcher.py",),
        out_dir=tmp_path / "out",
        timeout_s=120,
        root=root,
        clean_junit=earlier.junit,
    )

    assert result.clean.passed and result.clean.wall_s == 0 and len(result.clean.outcomes) == 2
    assert not (tmp_path / "out" / "junit" / "clean.xml").exists(), "the clean run ran again"
    assert [(v.fault, v.status) for v in result.verdicts] == [("corrupt-kv-page", faultcheck.CAUGHT)]
    # A report that does not cover a targeted suite is no clean run.
    (root / "suites" / "test_other.py").write_text("def test_x():\n    pass\n")
    uncovered = faultcheck.check(
        ["corrupt-kv-page"],
        suites=("suites/test_other.py",),
        out_dir=tmp_path / "o2",
        timeout_s=120,
        root=root,
        clean_junit=earlier.junit,
    )
    assert not uncovered.clean.passed and uncovered.runs == {}


def test_fault_runs_go_ahead_while_the_clean_report_is_still_being_written(tmp_path: Path):
    """--wait-for: the test run writing the clean report runs beside the check; the fault runs do
    not wait for it, and the report is read once it has exited."""
    root = _project(tmp_path)
    junit = tmp_path / "tests.xml"
    fault_junit = tmp_path / "out" / "junit" / "corrupt-kv-page.xml"
    # The "test run": writes its report once the fault run has written its own (at most a minute: a
    # check that waited for this process before its fault runs would get the report late, and fail below).
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time\n"
            "end = time.monotonic() + 60\n"
            f"while not os.path.exists({str(fault_junit)!r}) and time.monotonic() < end:\n"
            "    time.sleep(0.1)\n"
            "sys.exit(__import__('pytest').main(['suites', '-q', '-p', 'no:cacheprovider', "
            f"'--junitxml={junit}', '-o', 'junit_family=xunit1']))",
        ],
        cwd=root,
    )
    try:
        result = faultcheck.check(
            ["corrupt-kv-page"],
            suites=("suites/test_catcher.py",),
            out_dir=tmp_path / "out",
            timeout_s=120,
            root=root,
            clean_junit=junit,
            clean_writer=writer.pid,
        )
        assert writer.wait(5) == 0
    finally:
        writer.kill()
    assert result.clean.passed and len(result.clean.outcomes) == 2
    assert [(v.fault, v.status) for v in result.verdicts] == [("corrupt-kv-page", faultcheck.CAUGHT)]
    assert fault_junit.stat().st_mtime < junit.stat().st_mtime, "the fault run waited for the clean report"
    # A writer that exits without a report fails the clean run (the faults ran, but are not judged).
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    missing = faultcheck.check(
        ["corrupt-kv-page"],
        suites=("suites/test_catcher.py",),
        out_dir=tmp_path / "o2",
        timeout_s=120,
        root=root,
        clean_junit=tmp_path / "never.xml",
        clean_writer=gone.pid,
    )
    assert not missing.clean.passed and missing.runs == {} and not missing.ok


def test_a_run_past_its_limit_is_killed_and_broken(tmp_path: Path):
    root = _project(tmp_path, "import time\n\ndef test_slow():\n    time.sleep(60)\n")

    run = faultcheck.run_suites("slow", ("suites",), tmp_path / "out", timeout_s=3, root=root)

    assert not run.ran and run.wall_s < 30


# ---------------------------------------------------------------------------- CLI


def _harness(*args: str) -> subprocess.CompletedProcess:
    # Through main() as the console script does (``-m harness.cli`` would make a second UsageError class).
    code = "import sys; from harness.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, cwd=faultcheck.REPO_ROOT
    )


def test_cli_list_names_every_fault_and_its_upstream_issue():
    out = _harness("faults", "list")
    assert out.returncode == 0, out.stderr
    for name in REQUIRED_FAULTS:
        assert name in out.stdout
    assert "sglang#40309" in out.stdout and "sglang#35265" in out.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (("--fault", "no-such-fault"), "unknown fault 'no-such-fault'"),
        (("--suite", "suites/nowhere"), "suite 'suites/nowhere' not found"),
        (("--jobs", "0"), "--jobs must be >= 1"),
        (("--clean-junit", "no/such.xml"), "--clean-junit no/such.xml: no such file"),
        (("--all", "--suite", "suites/unit"), "--all and --suite exclude each other"),
        (("--wait-for", "123"), "--wait-for PID needs --clean-junit XML"),
        (("--clean-junit", "x.xml", "--wait-for", "0"), "--wait-for takes the pid of the process writing the report"),
        (
            ("--clean-junit", "x.xml", "--wait-for", "4194304"),
            "--wait-for 4194304: no such process, and no report at x.xml",
        ),
    ],
)
def test_cli_check_bad_input_is_one_line_and_exit_2(args, says):
    out = _harness("faults", "check", *args)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and says in out.stderr


def test_clean_run_of_two_suite_groups_runs_both_and_merges(tmp_path: Path):
    root = _project(tmp_path)
    (root / "other").mkdir()
    (root / "other" / "test_more.py").write_text("def test_more():\n    pass\n")

    clean = faultcheck.run_clean(
        ("suites/test_catcher.py", "other"), tmp_path / "out", jobs=2, timeout_s=120, root=root
    )

    assert clean.passed and clean.label == faultcheck.CLEAN
    assert {o.test_id for o in clean.outcomes} == {
        "suites/test_catcher.py::test_prealloc",
        "suites/test_catcher.py::test_unrelated",
        "other/test_more.py::test_more",
    }
    assert len(list((tmp_path / "out" / "junit").glob("clean-*.xml"))) == 2

    (root / "other" / "test_more.py").write_text("def test_more():\n    assert False\n")
    clean = faultcheck.run_clean(
        ("suites/test_catcher.py", "other"), tmp_path / "out", jobs=2, timeout_s=120, root=root
    )
    assert not clean.passed and set(clean.failing()) == {"other/test_more.py::test_more"}


def test_fault_runs_are_handed_out_longest_first():
    # The catalog's runs in the order the check hands them to its workers: by their measured length,
    # longest first (a long run handed out last finishes alone). Catalog order, or real-server runs
    # first by their count of server selections (the order before), fails this.
    plan = {name: faultcheck.targets_for(name) for name in faults.catalog()}
    order = faultcheck.submission_order(plan)
    est = [faults.get(name).est_s for name in order]
    assert all(e > 0 for e in est), "every catalog fault carries its measured run length (est_s)"
    assert est == sorted(est, reverse=True), list(zip(order, est))
    # Runs of no known length (selections other than the catalog's: --suite) go real-server runs first.
    other = {name: ("suites/x_server.py",) if i % 2 else ("suites/x.py",) for i, name in enumerate(plan)}
    unknown = faultcheck.submission_order(other)
    servers = [name for name in other if other[name][0].endswith("_server.py")]
    assert unknown == servers + [name for name in other if name not in servers]


def test_runs_without_servers_fill_the_cores_while_the_shared_server_fork_server_starts():
    # The check starts one server fork server for every run's servers; until it serves, the `jobs`
    # longest runs without servers go, then every other run in submission order.
    # Submission order alone (server runs first, each waiting for the fork server) fails this.
    plan = {name: faultcheck.targets_for(name) for name in faults.catalog()}
    order = faultcheck.start_order(plan, 2)
    submitted = faultcheck.submission_order(plan)
    without = [n for n in submitted if not faultcheck.starts_servers_any(plan[n])]
    assert sorted(order) == sorted(plan) and len(without) > 2
    assert order[:2] == without[:2]
    assert order[2:] == [n for n in submitted if n not in without[:2]]


def test_the_runs_start_in_start_order_at_most_jobs_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # What check() does with the order: each run starts when a slot frees, first handed out first.
    # The runs here are stand-ins for the pytest subprocesses (check's scheduling is under test, not
    # pytest); each takes a little while so that slots free one at a time. A pool of jobs + 1 threads
    # behind a semaphore (the check before) started the first-handed-out runs last: this fails then.
    from harness.faultcheck import kill_matrix

    names = [n for n in faults.catalog() if n not in kill_matrix.NEEDS][:8]
    events: list[tuple[str, str]] = []
    lock = threading.Lock()

    def fake_run(label, suites, out_dir, *, fault=None, timeout_s=0.0, root=None, stop_at_catch=False):
        with lock:
            events.append(("start", label))
        time.sleep(0.05 + 0.01 * (len(label) % 3))
        with lock:
            events.append(("end", label))
        ran = (faultcheck.TestOutcome(test_id=f"{suites[0]}::test_x", file=suites[0], outcome="passed"),)
        return faultcheck.SuiteRun(
            label=label,
            suites=tuple(suites),
            returncode=0,
            outcomes=ran,
            wall_s=0.0,
            junit=Path("j.xml"),
            log=Path("l.log"),
        )

    monkeypatch.setattr(kill_matrix, "run_suites", fake_run)
    suites = ("suites/unit/disaggregation/test_decode_reservation.py",)
    faultcheck.check(names, suites=suites, out_dir=tmp_path / "out", jobs=2, root=tmp_path)
    started = [label for kind, label in events if kind == "start" and label != faultcheck.CLEAN]
    expected = faultcheck.start_order({n: suites for n in names}, 2)
    assert sorted(started) == sorted(expected)
    # Two runs taken off the queue together may note their starts in either order: one place either
    # way. The semaphore started the third run handed out last of eight.
    late = {n: started.index(n) - expected.index(n) for n in expected if abs(started.index(n) - expected.index(n)) > 1}
    assert not late, f"runs started out of order (places late): {late}; started {started}"
    running = most = 0
    for kind, label in events:
        if label != faultcheck.CLEAN:
            running += 1 if kind == "start" else -1
            most = max(most, running)
    assert most == 2, f"{most} runs at once with jobs=2"
