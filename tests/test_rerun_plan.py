"""Planning: groups per topology/runner, the --dry-run matrix, sharding balance, upstream trees."""

from __future__ import annotations

import json
import random

import pytest

from harness.rerun import collector, plan
from harness.commands import rerun as cli
from harness.commands import rerun_args
from harness.rerun.spec_resolve import resolve
from harness.rerun.spec_grammar import parse_specs
from rerun_tree import make_repo, make_upstream

HEADLINE = "/rerun-test test_hisparse_allocator.py test_disaggregation_basic.py test_disaggregation_dsv4.py"


def _dry(capsys, *argv):
    assert cli.main(["--dry-run", *argv]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_headline_dry_run_three_runner_labels(tmp_path, capsys):
    repo = make_repo(tmp_path)
    m = _dry(capsys, "--repo-root", str(repo), HEADLINE)
    by_runner = {e["runner"]: e for e in m["include"]}
    assert set(by_runner) == {"ubuntu-latest", "2-gpu-h100", "8-gpu-h200"}
    assert by_runner["ubuntu-latest"]["topology"] == "cpu"
    assert by_runner["ubuntu-latest"]["specs"] == ["suites/test_hisparse_allocator.py"]
    assert by_runner["2-gpu-h100"]["specs"] == ["suites/pd/test_disaggregation_basic.py"]
    assert by_runner["2-gpu-h100"]["est_time"] == 140 and by_runner["2-gpu-h100"]["gpus"] == 2
    assert by_runner["8-gpu-h200"]["shards"] == 1
    # longest first
    assert [e["est_time"] for e in m["include"]] == sorted((e["est_time"] for e in m["include"]), reverse=True)
    assert not (repo / "runs").exists()  # a dry run runs nothing


def test_dry_run_github_output_and_queued_comment(tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    out, status = tmp_path / "gh_output", tmp_path / "status.md"
    m = _dry(capsys, "--repo-root", str(repo), "--github-output", str(out), "--comment-out", str(status), HEADLINE)
    line = out.read_text().strip()
    assert line.startswith("matrix=") and json.loads(line[len("matrix=") :]) == m
    body = status.read_text()
    assert body.count("⏳") == 3 and "rerun-test:group=8-gpu-h200" in body


def test_test_in_several_topologies_is_in_each_group(tmp_path, capsys):
    repo = make_repo(
        tmp_path,
        {
            "suites/test_both.py": """
        import pytest

        @pytest.mark.topology("cpu", "2-gpu-h100")
        def test_everywhere():
            pass
        """
        },
    )
    m = _dry(capsys, "--repo-root", str(repo), "test_both.py")
    assert {e["topology"] for e in m["include"]} == {"cpu", "2-gpu-h100"}


def test_mixed_file_is_split_by_test(tmp_path, capsys):
    repo = make_repo(
        tmp_path,
        {
            "suites/test_mixed.py": """
        import pytest

        @pytest.mark.topology("cpu")
        def test_c():
            pass

        @pytest.mark.topology("8-gpu-h200")
        def test_g():
            pass
        """
        },
    )
    m = {e["topology"]: e["specs"] for e in _dry(capsys, "--repo-root", str(repo), "test_mixed.py")["include"]}
    assert m == {"cpu": ["suites/test_mixed.py::test_c"], "8-gpu-h200": ["suites/test_mixed.py::test_g"]}


def test_unknown_topology_names_the_file(tmp_path, capsys):
    repo = make_repo(
        tmp_path,
        {
            "suites/test_nowhere.py": """
        import pytest
        pytestmark = pytest.mark.topology("3-gpu-tpu")

        def test_x():
            pass
        """
        },
    )
    assert cli.main(["--dry-run", "--repo-root", str(repo), "test_nowhere.py"]) == 2
    err = capsys.readouterr().err
    assert "suites/test_nowhere.py" in err and "unknown topology '3-gpu-tpu'" in err


def test_upstream_tree_planned_on_mapped_runners(tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    up = make_upstream(tmp_path / "sglang")
    m = _dry(
        capsys,
        "--repo-root",
        str(repo),
        "--suites-dir",
        str(up),
        "test_cpu_utils.py",
        "test_pd_large.py",
        "registered/pd/test_deepep.py::TestDeepEP.test_mmlu",
    )
    got = {e["runner"]: e["specs"] for e in m["include"]}
    assert got == {
        "ubuntu-latest": ["registered/cpu/test_cpu_utils.py"],
        "2-gpu-h100": ["registered/pd/test_pd_large.py"],
        "8-gpu-h200": ["registered/pd/test_deepep.py::TestDeepEP::test_mmlu"],
    }
    assert all(e["suites_dirs"] == [str(up)] for e in m["include"])


def test_default_plan_is_every_suite(tmp_path, capsys):
    repo = make_repo(tmp_path)
    m = _dry(capsys, "--repo-root", str(repo))
    specs = [s for e in m["include"] for s in e["specs"]]
    assert "suites/pd/test_disaggregation_dsv4.py" in specs and "suites/a/test_dup.py" in specs


def test_empty_repo_default_run_is_not_an_error(tmp_path, capsys):
    (tmp_path / "suites").mkdir()
    assert cli.main(["--repo-root", str(tmp_path)]) == 0
    assert "nothing to run" in capsys.readouterr().err


# ---------------------------------------------------------------- sharding


def _items(weights):
    return tuple(
        plan.Item(nodeid=f"f.py::t{i}", target=f"/x/f.py::t{i}", est_time=w, file_rel="f.py")
        for i, w in enumerate(weights)
    )


@pytest.mark.parametrize("seed, n_items, shards", [(0, 40, 4), (1, 25, 3), (2, 60, 8), (3, 12, 2)])
def test_sharding_balance_within_1_2_of_ideal(seed, n_items, shards):
    rng = random.Random(seed)
    weights = [round(rng.lognormvariate(3, 1), 1) for _ in range(n_items)]
    items = _items(weights)
    parts = [plan.shard(items, shards, i) for i in range(shards)]
    assert sorted(i.nodeid for p in parts for i in p) == sorted(i.nodeid for i in items)  # each exactly once
    loads = [sum(i.est_time for i in p) for p in parts]
    ideal = max(sum(weights) / shards, max(weights))
    assert max(loads) <= 1.2 * ideal, (loads, ideal)
    for p in parts:  # longest first inside a shard
        assert [i.est_time for i in p] == sorted((i.est_time for i in p), reverse=True)


def test_shard_index_out_of_range():
    with pytest.raises(plan.PlanError):
        plan.shard(_items([1, 2]), 2, 2)


def test_cli_shards_partition_a_group(tmp_path, capsys):
    repo = make_repo(
        tmp_path,
        {
            f"suites/many/test_m{i}.py": f"""
        import pytest
        pytestmark = [pytest.mark.topology("cpu"), pytest.mark.est_time({10 * (i + 1)})]

        def test_x():
            pass
        """
            for i in range(7)
        },
    )
    seen = []
    for k in range(3):
        m = _dry(
            capsys,
            "--repo-root",
            str(repo),
            "--shards",
            "3",
            "--shard-index",
            str(k),
            *[f"test_m{i}.py" for i in range(7)],
        )
        [entry] = m["include"]
        assert entry["name"] == f"cpu-{k + 1}of3" and entry["shards"] == 3 and entry["shard_index"] == k
        seen += entry["specs"]
    assert sorted(seen) == sorted(f"suites/many/test_m{i}.py" for i in range(7))


def test_max_shard_time_splits_long_groups(tmp_path):
    reg = collector.collect(make_repo(tmp_path))
    sels = resolve(parse_specs(["test_disaggregation_basic.py"]), reg)
    p = plan.make_plan(sels, max_shard_time=100)
    assert [g.name for g in p.groups] == ["2-gpu-h100-1of2", "2-gpu-h100-2of2"]


def test_plan_entry_reruns_exactly_that_entry(tmp_path, capsys):
    repo = make_repo(tmp_path)
    m = _dry(capsys, "--repo-root", str(repo), HEADLINE)
    entry = next(e for e in m["include"] if e["topology"] == "2-gpu-h100")
    again = _dry(capsys, "--repo-root", str(repo), "--plan-entry", json.dumps(entry))
    assert again["include"] == [entry]


def test_plan_entry_spec_is_validated_again(tmp_path, capsys):
    repo = make_repo(tmp_path)
    entry = {"name": "cpu", "runner": "ubuntu-latest", "topology": "cpu", "specs": ["test_a.py;id"]}
    assert cli.main(["--repo-root", str(repo), "--plan-entry", json.dumps(entry)]) == 2
    assert "shell metacharacter" in capsys.readouterr().err


def test_dry_run_pairs_files_and_engine_narrows(capsys):
    """rerun-test on the repository's own suites: the basic PD file brings the CPU server-stack suites
    into the cpu group; --engine sim leaves them out; --engine sglang-server keeps only them."""
    import json

    from harness.commands.rerun import main

    def groups(*args):
        assert main(["--dry-run", *args, "test_disaggregation_basic.py"]) == 0
        out = capsys.readouterr()
        return {e["topology"]: e["specs"] for e in json.loads(out.out)["include"]}, out.err

    both, err = groups()
    assert both == {
        "2-gpu-h100": ["suites/disaggregation/test_disaggregation_basic.py"],
        "cpu": [
            "suites/disaggregation/test_disaggregation_basic_server.py",
            "suites/disaggregation/test_disaggregation_swa_server.py",
        ],
    }
    assert "also running suites/disaggregation/test_disaggregation_basic_server.py" in err
    assert groups("--engine", "sim") == ({"2-gpu-h100": ["suites/disaggregation/test_disaggregation_basic.py"]}, "")
    assert groups("--engine", "sglang-server")[0] == {"cpu": both["cpu"]}


def test_the_plan_estimates_only_what_can_run_here(tmp_path):
    from harness.rerun import execute

    def item(name: str, est: float, engine: str = "sim") -> plan.Item:
        return plan.Item(
            nodeid=f"suites/{name}.py::t",
            target=f"/x/{name}.py::t",
            est_time=est,
            file_rel=f"suites/{name}.py",
            engine=engine,
        )

    gpu = plan.Group(
        "8-gpu-h200", "8-gpu-h200", (item("test_dsv4", 10), item("test_dsv4_server", 1500, "sglang-server")), gpus=8
    )
    cpu = plan.Group("cpu", "ubuntu-latest", (item("test_basic_server", 20, "sglang-server"),))
    real_only = plan.Group("2-node", "2-node", (item("test_node", 30),), gpus=16, allow_simulation=False)
    opts = execute.ExecOptions(repo_root=tmp_path, run_dir=tmp_path, gpus=0)
    lines = cli.plan_lines(plan.Plan((gpu, cpu, real_only)), opts, "0 real GPU(s)", 2)
    assert lines[0] == (
        "rerun-test: 3 group(s), est 30s here (1530s of tests that cannot run here left out), "
        "0 real GPU(s), up to 2 at once"
    )
    by_group = {ln.split()[0]: ln for ln in lines[1:] if not ln.startswith("    ")}
    assert (
        "2 test(s) est 10s (simulated; 1 test(s) need real GPUs, skipped here, est 1500s left out)"
        in by_group["8-gpu-h200"]
    )
    assert "1 test(s) est 20s (no GPUs)" in by_group["cpu"]  # a real server on CPU runs here
    assert "est 0s (cannot run here; 1 test(s) cannot run here, est 30s left out)" in by_group["2-node"]
    assert lines[2] == "    test_dsv4.py, test_dsv4_server.py"  # what it will run: the files of each group


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--jobs", "0", "test_x.py"], "--jobs 0: must be ≥ 1"),
        (["--gpus", "-1", "test_x.py"], "--gpus -1: must be ≥ 0"),
        (["--timeout", "0", "test_x.py"], "--timeout 0: must be > 0"),
        # before: accepted, and the group then never timed out
        (
            ["--timeout", "nan", "test_x.py"],
            "--timeout nan: must be a finite number of seconds above 0 and at most 86400",
        ),
        (["--timeout", "1e9", "test_x.py"], "--timeout 1e+09: must be a finite number of seconds"),
        (["--dry-run", "--max-shard-time", "inf", "test_x.py"], "--max-shard-time inf: must be a finite number"),
    ],
)
def test_bad_numbers_are_refused_in_one_line(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rerun-test: ") and message in err and "\n" not in err


def test_every_command_answers_version(capsys):
    from harness import cli as harness_cli

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("rerun-test 0.1.0 (pd-harness, commit ")
    for argv in (["--version"], ["runs", "--version"], ["topology", "show", "--version"], ["gate", "run", "--version"]):
        with pytest.raises(SystemExit) as done:
            harness_cli.main(argv)
        assert done.value.code == 0 and capsys.readouterr().out.startswith("harness 0.1.0 (pd-harness, commit "), argv


def test_comment_options_travel_from_the_comment_to_each_group(tmp_path, capsys):
    """`/rerun-test --changed=REV …`: --parse-only keeps the option in the line the workflow plans
    from, the --dry-run matrix carries it in every entry, and --plan-entry turns it on for the run."""
    repo = make_repo(tmp_path)
    body = tmp_path / "comment.txt"
    body.write_text(
        "/rerun-test test_hisparse_allocator.py --changed=origin/main --mutate test_disaggregation_basic.py\n"
    )
    assert cli.main(["--repo-root", str(repo), "--parse-only", "--comment-file", str(body)]) == 0
    line = capsys.readouterr().out.strip()
    assert line == "--mutate --changed=origin/main test_hisparse_allocator.py test_disaggregation_basic.py"
    m = _dry(capsys, "--repo-root", str(repo), f"/rerun-test {line}")
    assert {(e["coverage"], e["changed"], e["mutate"]) for e in m["include"]} == {(True, "origin/main", True)}
    plain = _dry(capsys, "--repo-root", str(repo), HEADLINE)
    assert {(e["coverage"], e["changed"], e["mutate"]) for e in plain["include"]} == {(False, "", False)}
    args = cli.build_parser().parse_args(
        ["--sglang", "sglang/python", "--comment-out", "runs/ci/status.md", "--plan-entry", json.dumps(m["include"][0])]
    )
    rerun_args.specs_of(args)
    assert (args.coverage, args.changed, args.mutate) == (True, "origin/main", True)
    # The mutation run after the groups: the same target and base, its line in the same status file.
    argv = cli.mutate_command(args, tmp_path / "run")
    assert argv[1:4] == ["-m", "harness.cli", "mutate"]
    flags = dict(zip(argv[4::2], argv[5::2]))
    assert flags == {
        "--run-dir": str(tmp_path / "run" / "mutation"),
        "--limit": str(cli.MUTATE_LIMIT),
        "--sglang": "sglang/python",
        "--changed": "origin/main",
        "--comment-out": "runs/ci/status.md",
    }
    args = cli.build_parser().parse_args(["--plan-entry", json.dumps(plain["include"][0])])
    rerun_args.specs_of(args)
    assert (args.coverage, args.changed, args.mutate) == (False, None, False)


@pytest.mark.parametrize(
    "token, why",
    [
        ("--mutants", "not an option of /rerun-test"),
        ("--changed", "not an option of /rerun-test"),
        ("--changed=$(id)", "REV must be a git revision"),
    ],
)
def test_a_comment_option_it_does_not_know_is_one_line_and_exit_2(tmp_path, capsys, token, why):
    repo = make_repo(tmp_path)
    assert cli.main(["--repo-root", str(repo), "--parse-only", f"/rerun-test {token} test_a.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert why in err and len(err.splitlines()) == 1
