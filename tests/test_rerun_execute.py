"""Execution end to end on a tiny sample tree (real pytest subprocesses), scheduling, and reports."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET

import pytest

from harness import report
from harness.report import junit
from harness.report.results import CaseResult, GroupResult
from harness.rerun import execute
from harness.commands import rerun as cli
from harness.rerun.plan import Group, Item, Plan
from rerun_tree import make_repo, make_upstream

pytestmark = pytest.mark.est_time(40)

HEADLINE = ["test_hisparse_allocator.py", "test_disaggregation_basic.py", "test_disaggregation_dsv4.py"]


def _run(repo, tmp_path, *argv):
    run_dir = tmp_path / "run"
    rc = cli.main(["--repo-root", str(repo), "--run-dir", str(run_dir), "--gpus", "0", "--jobs", "3", *argv])
    return rc, run_dir


def test_headline_runs_three_groups_and_writes_reports(tmp_path, capsys, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    ran = tmp_path / "ran.log"
    monkeypatch.setenv("RERUN_SAMPLE_LOG", str(ran))
    status = tmp_path / "status.md"
    rc, run_dir = _run(repo, tmp_path, "--comment-out", str(status), *HEADLINE)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert sorted(ran.read_text().split()) == sorted(
        ["alloc_extend", "release[1]", "release[2]", "basic.prealloc", "basic.transfer", "dsv4.swa_tail"]
    )
    # live progress lines and the final table
    assert "[cpu] running" in out and "[8-gpu-h200] passed" in out
    table = out[out.index("group  ") :]
    for g in ("cpu", "2-gpu-h100", "8-gpu-h200"):
        assert g in table
    # JUnit per group, merged with properties
    assert sorted(p.name for p in (run_dir / "junit").iterdir()) == ["2-gpu-h100.xml", "8-gpu-h200.xml", "cpu.xml"]
    merged = ET.parse(run_dir / "report" / "junit.xml").getroot()
    assert merged.get("tests") == "6" and merged.get("failures") == "0"
    props = {
        s.get("name"): {p.get("name"): p.get("value") for p in s.iter("property")} for s in merged.iter("testsuite")
    }
    assert props["8-gpu-h200"]["topology"] == "8-gpu-h200" and props["8-gpu-h200"]["simulated"] == "true"
    assert props["cpu"]["runner"] == "ubuntu-latest" and props["cpu"]["simulated"] == "false"
    assert props["8-gpu-h200"]["gpus"] == "simulated" and props["cpu"]["gpus"] == "no GPUs"
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert summary["ok"] is True and {g["name"] for g in summary["groups"]} == {"cpu", "2-gpu-h100", "8-gpu-h200"}
    durations = json.loads((run_dir / "report" / "durations.json").read_text())
    assert "suites/pd/test_disaggregation_basic.py::TestDisaggregationBasic::test_transfer" in durations
    # each group got the core plugin's options
    cmd = json.loads((run_dir / "groups" / "2-gpu-h100" / "command.json").read_text())
    assert cmd[cmd.index("--topology") + 1] == "2-gpu-h100" and "--simulate" in cmd
    assert f"--run-dir={run_dir / 'groups' / '2-gpu-h100'}" in cmd
    assert "--simulate" not in json.loads((run_dir / "groups" / "cpu" / "command.json").read_text())
    assert status.read_text().count("✅") == 3


def test_failure_gives_exit_1_reason_and_comment(tmp_path, capsys):
    repo = make_repo(
        tmp_path / "repo",
        {
            "suites/test_broken.py": """
        import pytest
        pytestmark = pytest.mark.topology("cpu")

        def test_ok():
            pass

        def test_wrong_balance():
            assert 3 == 4, "free pages 3 != 4 after release"

        @pytest.fixture
        def boom():
            raise RuntimeError("fixture exploded")

        def test_setup_error(boom):
            pass
        """
        },
    )
    status = tmp_path / "status.md"
    rc, run_dir = _run(repo, tmp_path, "--comment-out", str(status), "test_broken.py")
    out = capsys.readouterr().out
    assert rc == 1
    assert (
        "FAILED suites/test_broken.py::test_wrong_balance (cpu): "
        "assertion free pages 3 != 4 after release | assert 3 == 4" in out
    )
    line = status.read_text().splitlines()[-1]
    assert line.startswith("- ❌ **cpu**") and "1 passed, 2 failed" in line
    assert "test_setup_error` — error in setup: RuntimeError: fixture exploded" in line
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert summary["ok"] is False


def test_collection_error_is_a_failure_not_a_pass(tmp_path, capsys):
    repo = make_repo(
        tmp_path / "repo",
        {
            "suites/test_syntax_ok_import_bad.py": """
        import module_that_does_not_exist_anywhere

        def test_x():
            pass
        """
        },
    )
    rc, _ = _run(repo, tmp_path, "test_syntax_ok_import_bad.py")
    out = capsys.readouterr().out
    assert rc == 1 and "collection error" in out


def test_upstream_unittest_file_runs_under_pytest(tmp_path, capsys):
    up = make_upstream(
        tmp_path / "sglang",
        {
            "registered/cpu/test_light.py": """
        import unittest


        def register_cpu_ci(**kwargs):  # upstream imports this from sglang; a no-op either way
            return None


        register_cpu_ci(est_time=2, suite="stage-a-test-cpu")


        class TestLight(unittest.TestCase):
            def test_add(self):
                self.assertEqual(1 + 1, 2)

            def test_skip(self):
                self.skipTest("no accelerator here")


        if __name__ == "__main__":
            unittest.main()
        """
        },
    )
    rc, run_dir = _run(make_repo(tmp_path / "repo"), tmp_path, "--suites-dir", str(up), "test_light.py")
    assert rc == 0, capsys.readouterr().out
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    [group] = summary["groups"]
    assert group["topology"] == "cpu" and group["counts"]["passed"] == 1 and group["counts"]["skipped"] == 1
    assert {c["nodeid"] for c in group["cases"]} == {
        "registered/cpu/test_light.py::TestLight::test_add",
        "registered/cpu/test_light.py::TestLight::test_skip",
    }


def test_timeout_stops_the_group_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    repo = make_repo(
        tmp_path / "repo",
        {
            "suites/test_slow.py": """
        import os, time
        pytestmark = __import__("pytest").mark.topology("cpu")

        def test_hangs():
            open(os.environ["PID_FILE"], "w").write(str(os.getpid()))
            time.sleep(600)
        """
        },
    )
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("PID_FILE", str(pid_file))
    rc, _ = _run(repo, tmp_path, "--timeout", "12", "test_slow.py")
    out = capsys.readouterr().out
    assert rc == 1 and "timed out" in out
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# ---------------------------------------------------------------- pure parts


def _g(name, gpus, est, allow=True):
    return Group(
        topology=name,
        runner=name,
        items=(Item(f"{name}.py", f"/x/{name}.py", est, f"{name}.py"),),
        gpus=gpus,
        allow_simulation=allow,
    )


def test_simulation_decision():
    assert execute.simulation(_g("cpu", 0, 1), 0) is False
    assert execute.simulation(_g("2-gpu", 2, 1), 0) is True
    assert execute.simulation(_g("2-gpu", 2, 1), 8) is False
    assert execute.simulation(_g("8-gpu", 8, 1, allow=False), 2) is None


def test_pick_longest_first_within_gpus_and_jobs():
    a, b, c = _g("a", 8, 300), _g("b", 2, 140), _g("c", 0, 30)
    real = {"a": False, "b": False, "c": False}
    # 8 real GPUs: a takes them all; b must wait; c (no GPU) may start beside it
    assert [g.name for g in execute.pick([b, c, a], [], 8, 4, real)] == ["a", "c"]
    # jobs limit 1: only the longest
    assert [g.name for g in execute.pick([b, c, a], [], 8, 1, real)] == ["a"]
    # simulated groups need no real GPUs: all at once
    sim = {"a": True, "b": True, "c": True}
    assert [g.name for g in execute.pick([c, b, a], [], 0, 3, sim)] == ["a", "b", "c"]


def test_pick_orders_by_what_runs_here_not_by_tests_skipped_here():
    # A simulated 8-GPU group whose long tests need real servers (skipped here) runs 20 s of tests:
    # the CPU group's 100 s goes first, not after it (./dev run started its longest group last so).
    sims = (
        Item("s.py::sim", "/x/s.py::sim", 20, "s.py"),
        Item("s.py::real", "/x/s.py::real", 1500, "s.py", "sglang-server"),
    )
    gpu = Group(topology="8-gpu", runner="8-gpu", items=sims, gpus=8)
    cpu = _g("cpu", 0, 100)
    assert [g.name for g in execute.pick([gpu, cpu], [], 0, 1, {"8-gpu": True, "cpu": False})] == ["cpu"]
    # on real GPUs the real-server tests run, and the group is the longest
    assert [g.name for g in execute.pick([gpu, cpu], [], 8, 1, {"8-gpu": False, "cpu": False})] == ["8-gpu"]


def test_targets_collapse_whole_files_only():
    its = (
        Item("f.py::t1", "/x/f.py::t1", 1, "f.py"),
        Item("f.py::t2", "/x/f.py::t2", 1, "f.py"),
        Item("g.py::t1", "/x/g.py::t1", 1, "g.py"),
    )
    assert execute.targets(its, {"f.py": 2, "g.py": 3}) == ["/x/f.py", "/x/g.py::t1"]


def test_report_parse_merge_markdown_json():
    xml = (
        '<testsuites><testsuite name="pytest" tests="3" failures="1" errors="0" skipped="1" time="1.5">'
        '<testcase classname="suites.pd.test_a.TestC" name="test_ok" file="suites/pd/test_a.py" time="0.5"/>'
        '<testcase classname="suites.pd.test_a" name="test_bad[p1]" file="suites/pd/test_a.py" time="1.0">'
        '<failure message="AssertionError: x&#10;more">tb</failure></testcase>'
        '<testcase classname="suites.pd.test_a" name="test_skip" file="suites/pd/test_a.py" time="0">'
        '<skipped message="needs GPU"/></testcase></testsuite></testsuites>'
    )
    cases = junit.parse_junit(xml)
    assert [(c.nodeid, c.outcome, c.message) for c in cases] == [
        ("suites/pd/test_a.py::TestC::test_ok", "passed", ""),
        ("suites/pd/test_a.py::test_bad[p1]", "failed", "AssertionError: x"),
        ("suites/pd/test_a.py::test_skip", "skipped", "needs GPU"),
    ]
    merged = report.merge_junit(
        [(xml, {"group": "cpu", "topology": "cpu"}), ("not xml", {"group": "gpu", "topology": "8-gpu-h200"})]
    )
    root = ET.fromstring(merged.split("?>", 1)[1])
    assert root.get("tests") == "3" and root.get("failures") == "1"
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert {p.get("name"): p.get("value") for p in suites["gpu"].iter("property")}["error"].startswith(
        "unreadable JUnit"
    )
    # merging a merged file again does not duplicate properties
    again = report.merge_junit([(merged, {"group": "cpu", "topology": "cpu"})])
    cpu = next(s for s in ET.fromstring(again.split("?>", 1)[1]).iter("testsuite") if s.findall("testcase"))
    assert [p.get("name") for p in cpu.iter("property")].count("topology") == 1

    res = [
        GroupResult("cpu", "cpu", "ubuntu-latest", tuple(cases), wall_time=1.5, returncode=1),
        GroupResult("8-gpu-h200", "8-gpu-h200", "8-gpu-h200", (CaseResult("x::t", "passed", 2.0),), 3.0, 0),
    ]
    md = report.markdown(res, link="https://ci/1")
    assert (
        "| ❌ cpu | ubuntu-latest | 3 | 1 | 1 | 1 | 0 | 1.5s |" in md
        and "`suites/pd/test_a.py::test_bad[p1]` (cpu): AssertionError: x" in md
    )
    js = report.to_json(res)
    assert js["ok"] is False and js["groups"][1]["ok"] is True and js["groups"][0]["counts"]["skipped"] == 1
    assert report.durations(res) == {
        "suites/pd/test_a.py::TestC::test_ok": 0.5,
        "suites/pd/test_a.py::test_bad[p1]": 1.0,
        "x::t": 2.0,
    }
    text = report.table(res)
    assert text.splitlines()[0].split() == [
        "group",
        "runner",
        "tests",
        "passed",
        "failed",
        "skipped",
        "xfailed",
        "wall",
        "status",
    ]
    assert "FAILED" in text.splitlines()[2]


def test_report_does_not_import_ray():
    import subprocess
    import sys

    code = (
        "import sys, harness.report, harness.commands.rerun; sys.exit('ray' in sys.modules or 'sglang' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_save_durations_feeds_the_next_plan(tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    rc, _ = _run(repo, tmp_path, "--save-durations", "test_hisparse_allocator.py")
    assert rc == 0
    saved = json.loads((repo / "suites" / "durations.json").read_text())
    assert set(saved) == {
        "suites/test_hisparse_allocator.py::test_alloc_extend",
        "suites/test_hisparse_allocator.py::TestRelease::test_release_returns_pages",
    }
    capsys.readouterr()
    assert cli.main(["--repo-root", str(repo), "--dry-run", "test_hisparse_allocator.py"]) == 0
    [entry] = json.loads(capsys.readouterr().out)["include"]
    assert entry["est_time"] < 30  # measured (well under a second each) replaced the 30 s estimate


def test_joined_cluster_never_simulates():
    assert execute.simulation(_g("8-gpu", 8, 1), 0, joined=True) is False
    assert execute.simulation(_g("8-gpu", 8, 1, allow=False), 0, joined=True) is False


def test_both_fork_servers_start_side_by_side_before_a_cpu_server_group(tmp_path, monkeypatch):
    # A plan whose cpu group starts real servers: the Python fork server (the groups' pytest) and the
    # server fork server (named to the groups) start before the first group, at once. Without such a
    # group, on GPUs, or on a joined cluster nothing starts here (each group's pytest starts what it needs).
    from concurrent.futures import ThreadPoolExecutor

    from harness.engines import fork_preload
    from harness.engines.server import stack

    calls: list[str] = []
    monkeypatch.setattr(fork_preload, "python_command", lambda argv, env: calls.append("python") or (argv, env))
    monkeypatch.setattr(stack, "share_fork_server", lambda topology: calls.append(f"server {topology.name}") or True)
    real = Item("s_server.py::t", "/x/s_server.py::t", 30, "s_server.py", "sglang-server")
    sim = Item("s.py::t", "/x/s.py::t", 20, "s.py")
    cpu = Group(topology="cpu", runner="ubuntu-latest", items=(sim, real), gpus=0)
    gpu = Group(topology="2-gpu-h100", runner="2-gpu-h100", items=(sim, real), gpus=2)
    assert execute.starts_cpu_servers(cpu) and not execute.starts_cpu_servers(gpu)
    opts = execute.ExecOptions(repo_root=tmp_path, run_dir=tmp_path)
    with ThreadPoolExecutor(1) as pool:
        share = execute.prestart_fork_servers(Plan(groups=(gpu, cpu)), opts, pool)
        assert share is not None and share.result() is True
        assert sorted(calls) == ["python", "server cpu"]
        calls.clear()
        cpu_sim_only = Group(topology="cpu", runner="ubuntu-latest", items=(sim,), gpus=0)
        assert execute.prestart_fork_servers(Plan(groups=(gpu, cpu_sim_only)), opts, pool) is None
        for other in (
            execute.ExecOptions(repo_root=tmp_path, run_dir=tmp_path, gpus=8),
            execute.ExecOptions(repo_root=tmp_path, run_dir=tmp_path, ray_address="10.0.0.1:6379"),
        ):
            assert execute.prestart_fork_servers(Plan(groups=(cpu,)), other, pool) is None
    assert calls == []
