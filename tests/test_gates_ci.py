"""A gate split over CI runners: ``harness gate plan`` (the matrix), ``gate run --runner`` (one
label's share) and ``gate verdict`` (the jobs' results combined). Exact output throughout."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import cli as harness_cli
from harness.gates import model, gate_plan, render, gate_runner, verdict
from harness.rerun import collector

from rerun_tree import make_repo

pytestmark = pytest.mark.est_time(8)

ROOT = Path(__file__).resolve().parent.parent

GATE = """
    name = "ci"
    [[suites]]
    name = "alloc"
    select = ["suites/test_hisparse_allocator.py"]
    [[suites]]
    name = "pd"
    select = ["suites/pd/"]
    required = false
    """


@pytest.fixture
def repo(tmp_path):
    """The rerun sample tree (cpu, 2-gpu-h100 and 8-gpu-h200 files) plus ``gates/ci.toml``."""
    root = make_repo(tmp_path / "repo")
    (root / "gates").mkdir()
    (root / "gates" / "ci.toml").write_text(textwrap.dedent(GATE))
    return root


def _entry(label: str, topologies: list[str], suites: list[str]) -> dict:
    return {"name": label, "runner": label, "artifact": f"gate-ci-{label}", "topologies": topologies, "suites": suites}


def test_plan_one_entry_per_runner_label(repo, tmp_path, capsys):
    gate = str(repo / "gates" / "ci.toml")
    out = tmp_path / "github_output"
    assert harness_cli.main(["gate", "plan", gate, "--repo-root", str(repo), "--github-output", str(out)]) == 0
    expected = {
        "include": [
            _entry("2-gpu-h100", ["2-gpu-h100"], ["pd"]),
            _entry("8-gpu-h200", ["8-gpu-h200"], ["pd"]),
            _entry("ubuntu-latest", ["cpu"], ["alloc"]),
        ]
    }
    assert capsys.readouterr().out == json.dumps(expected, indent=2) + "\n"
    assert out.read_text() == "matrix=" + json.dumps(expected, separators=(",", ":")) + "\n"
    # --simulate: the GPU groups may simulate, so they run on the cpu topology's runner
    assert harness_cli.main(["gate", "plan", gate, "--repo-root", str(repo), "--simulate"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m == {"include": [_entry("ubuntu-latest", ["cpu", "8-gpu-h200", "2-gpu-h100"], ["alloc", "pd"])]}


def test_runner_label_keeps_groups_that_may_not_simulate_on_their_own_runner(repo):
    reg = collector.collect(repo)
    entry = model.GateSuite(name="pd", select=("suites/pd/",))
    labels = {g.topology: gate_plan.runner_label(g) for g in gate_plan.entry_plan(entry, reg, simulate=True).groups}
    assert labels == {"2-gpu-h100": "ubuntu-latest", "8-gpu-h200": "ubuntu-latest"}
    labels = {g.topology: gate_plan.runner_label(g) for g in gate_plan.entry_plan(entry, reg, simulate=False).groups}
    assert labels == {"2-gpu-h100": "2-gpu-h100", "8-gpu-h200": "8-gpu-h200"}


def test_plan_bad_input_is_one_line_exit_2(repo, tmp_path, capsys):
    assert harness_cli.main(["gate", "plan", "nightly"]) == 2
    assert capsys.readouterr().err.startswith("harness: unknown gate 'nightly'; use one of: per-commit, release")
    broken = tmp_path / "broken.toml"
    broken.write_text('name = "broken"\n[[suites]]\nname = "x"\nselect = ["suites/none/"]\n')
    assert harness_cli.main(["gate", "plan", str(broken), "--repo-root", str(repo)]) == 2
    assert capsys.readouterr().err == (
        "harness: gate broken cannot be planned: 'suites/none/' holds no registered suite "
        "file with tests; fix the path or remove it\n"
    )


def test_run_with_runner_runs_only_that_labels_groups(repo, tmp_path):
    gate = model.get(repo / "gates" / "ci.toml")
    lines: list[str] = []
    opts = gate_runner.GateOptions(repo_root=repo, run_dir=tmp_path / "runs" / "cpu", runner="ubuntu-latest")
    result = gate_runner.run_gate(gate, opts, out=lines.append)
    # only alloc has a group on ubuntu-latest: pd (GPU groups, no --simulate) is left out, not failed
    assert result.exit_code == 0 and [s.outcome.name for s in result.verdict.suites] == ["alloc"]
    assert {t.group for t in result.verdict.suites[0].outcome.tests} == {"cpu"}
    saved = json.loads((opts.run_dir / "report" / "result.json").read_text())
    assert saved["passed"] is True and [s["name"] for s in saved["suites"]] == ["alloc"]
    assert not any("[pd" in line for line in lines)
    with pytest.raises(
        Exception, match=r"gate ci runs nothing on runner 'nowhere'; `harness gate plan ci` lists its runner labels"
    ):
        gate_runner.run_gate(
            gate,
            gate_runner.GateOptions(repo_root=repo, run_dir=tmp_path / "runs" / "none", runner="nowhere"),
            out=lines.append,
        )


def test_run_cli_unknown_runner_exit_2(repo, tmp_path, capsys):
    assert (
        harness_cli.main(
            [
                "gate",
                "run",
                str(repo / "gates" / "ci.toml"),
                "--repo-root",
                str(repo),
                "--run-dir",
                str(tmp_path / "r"),
                "--runner",
                "nowhere",
                "--gpus",
                "0",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err == (
        "harness: gate ci runs nothing on runner 'nowhere'; `harness gate plan ci` lists its runner labels\n"
    )


def _result(passed: bool, reasons: list[str], suites: list[str]) -> dict:
    return {
        "gate": "per-commit",
        "verdict": "PASS" if passed else "FAIL",
        "passed": passed,
        "reasons": reasons,
        "suites": [{"name": s} for s in suites],
    }


def test_judge_jobs():
    ok = _result(True, [], ["unit"])
    assert verdict.judge_jobs([("ubuntu-latest", ok)]) == (True, ())
    bad = _result(False, ["pd: suites/e2e/test_x.py::test_y [8-gpu-h200] accounting: page leak"], ["pd"])
    assert verdict.judge_jobs([("ubuntu-latest", ok), ("8-gpu-h200", bad), ("2-gpu-h100", None)]) == (
        False,
        (
            "8-gpu-h200: pd: suites/e2e/test_x.py::test_y [8-gpu-h200] accounting: page leak",
            "2-gpu-h100: no result.json; the job ended before the gate reported (see its log)",
        ),
    )
    assert verdict.judge_jobs([]) == (False, ("no runner job: the plan is empty or the plan job failed (see its log)",))
    # a result that does not say passed (truncated, another tool's file) is a failure, not a pass
    assert verdict.judge_jobs([("a", {"verdict": "PASS"})]) == (False, ("a: FAIL (no reason recorded)",))


def _write_job(reports: Path, artifact: str, result: dict, summary: str) -> None:
    d = reports / artifact / "report"
    d.mkdir(parents=True)
    (d / "result.json").write_text(json.dumps(result))
    (d / "summary.md").write_text(summary)


def test_verdict_cli_combines_the_jobs(tmp_path, capsys):
    reports = tmp_path / "reports"
    entries = [_entry("ubuntu-latest", ["cpu"], ["unit"]), _entry("8-gpu-h200", ["8-gpu-h200"], ["pd"])]
    for e in entries:
        e["artifact"] = f"gate-per-commit-{e['name']}"
    matrix = json.dumps({"include": entries})
    _write_job(
        reports, "gate-per-commit-ubuntu-latest", _result(True, [], ["unit"]), "# Gate `per-commit`: ✅ PASS\n\nrows\n"
    )
    assert harness_cli.main(["gate", "verdict", "per-commit", "--matrix", matrix, "--reports", str(reports)]) == 1
    assert capsys.readouterr().out == textwrap.dedent("""\
        # Gate `per-commit`: ❌ FAIL on 2 runner(s)

        **Why it failed**

        - 8-gpu-h200: no result.json; the job ended before the gate reported (see its log)

        | runner | verdict | suites |
        | --- | --- | --- |
        | ubuntu-latest | PASS | unit |
        | 8-gpu-h200 | no result | - |

        ## Runner `ubuntu-latest`

        ### Gate `per-commit`: ✅ PASS

        rows
        """)
    _write_job(reports, "gate-per-commit-8-gpu-h200", _result(True, [], ["pd"]), "# Gate `per-commit`: ✅ PASS\n")
    assert harness_cli.main(["gate", "verdict", "per-commit", "--matrix", matrix, "--reports", str(reports)]) == 0
    assert capsys.readouterr().out.startswith(
        "# Gate `per-commit`: ✅ PASS on 2 runner(s)\n\n| runner | verdict | suites |\n"
    )


def test_verdict_cli_no_plan_and_bad_matrix(tmp_path, capsys):
    assert harness_cli.main(["gate", "verdict", "release", "--matrix", "", "--reports", str(tmp_path)]) == 1
    assert capsys.readouterr().out == render.jobs_md(
        "release", [], False, ("no runner job: the plan is empty or the plan job failed (see its log)",)
    )
    assert harness_cli.main(["gate", "verdict", "release", "--matrix", "{not json", "--reports", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("harness: --matrix: not a matrix from `harness gate plan` (")


def test_plan_and_verdict_need_only_the_standard_library(repo, tmp_path):
    """The CI plan and verdict steps run on a bare setup-python interpreter (no site-packages: -S)."""
    gate = str(repo / "gates" / "ci.toml")
    r = subprocess.run(
        [sys.executable, "-S", "-m", "harness.cli", "gate", "plan", gate, "--repo-root", str(repo), "--simulate"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    [entry] = json.loads(r.stdout)["include"]
    r = subprocess.run(
        [
            sys.executable,
            "-S",
            "-m",
            "harness.cli",
            "gate",
            "verdict",
            gate,
            "--matrix",
            json.dumps({"include": [entry]}),
            "--reports",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and r.stdout.startswith("# Gate `ci`: ❌ FAIL on 1 runner(s)"), r.stderr
