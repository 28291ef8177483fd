"""The workflows in ci/: they parse, only call Python under harness/ (plus ./dev install), every
module, sub-command and option they use exists, and they keep the safety rules the linters in
``.ci/run`` cannot see (who holds a write token, what runs before the permission check)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from harness import cli as harness_cli
from harness.rerun import checkpoint, github, relay
from harness.commands import rerun as cli

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((ROOT / "ci" / "workflows").glob("*.yml"))
REDIRECTS = {">", ">>", "2>", "2>>", "<", "|"}


def _load(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text())
    if True in doc:  # YAML 1.1 reads the key `on` as boolean True
        doc["on"] = doc.pop(True)
    return doc


#: The step that ends what a PR's code left running (inline shell: the one step that is no harness call).
END_STEP = "End every process the PR's code left running (the steps below hold a token)"


def _runs(doc: dict):
    for job_name, job in doc["jobs"].items():
        for step in job["steps"]:
            if "run" in step and step.get("name") != END_STEP:
                yield job_name, step


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _check_command(tokens: list[str]) -> None:
    args: list[str] = []
    skip = False
    for t in tokens:
        if skip:
            skip = False
            continue
        if t in REDIRECTS:
            skip = True
            continue
        args.append(t)
    if args[:2] == ["./dev", "install"]:
        assert (ROOT / "dev").is_file() and "install)" in (ROOT / "dev").read_text()
        return
    assert args[0] in ("python", ".venv/bin/python") and args[1] == "-m", (
        f"YAML may only call python -m harness.…: {args}"
    )
    module = args[2]
    assert module.startswith("harness.") and importlib.util.find_spec(module) is not None, module
    rest = args[3:]
    if module == "harness.commands.rerun":
        parser = cli.build_parser()
    elif module in ("harness.rerun.github", "harness.rerun.checkpoint"):
        subs = _subparsers((github if module.endswith("github") else checkpoint).build_parser())
        assert rest[0] in subs, f"unknown sub-command {rest[0]!r}"
        parser, rest = subs[rest[0]], rest[1:]
    elif module == "harness.rerun.relay":
        parser = relay.build_parser()
    elif module == "harness.cli":  # `harness COMMAND ACTION ...`: walk the sub-commands to the leaf parser
        parser = harness_cli.build_parser()
        while subs := _subparsers(parser):
            assert rest and rest[0] in subs, f"harness: unknown sub-command in {args} (choose from {sorted(subs)})"
            parser, rest = subs[rest[0]], rest[1:]
    else:
        pytest.fail(f"no check for module {module}")
    known = _options(parser)
    for t in rest:
        if t.startswith("--"):
            assert t.split("=", 1)[0] in known, f"{module}: unknown option {t}"


def test_there_are_four_workflows():
    assert {p.name for p in WORKFLOWS} == {"slash-command.yml", "rerun-test.yml", "gates.yml", "sglang-rerun-test.yml"}


def test_command_check_catches_unknown_sub_commands_and_options():
    """The check itself can fail: a wrong action or option in a workflow is caught."""
    _check_command(shlex.split('python -m harness.cli gate plan "$GATE" --simulate --github-output "$GITHUB_OUTPUT"'))
    with pytest.raises(AssertionError, match="unknown sub-command"):
        _check_command(shlex.split('python -m harness.cli gate matrix "$GATE"'))
    with pytest.raises(AssertionError, match="unknown option --github-matrix"):
        _check_command(shlex.split('python -m harness.cli gate plan "$GATE" --github-matrix'))
    with pytest.raises(AssertionError, match="YAML may only call"):
        _check_command(shlex.split("cat runs/report/summary.md"))


# The sglang-repo variant runs `rerun-test --sglang PATH`: its commands are checked like the others'.
@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_every_command_exists(path):
    doc = _load(path)
    n = 0
    for _, step in _runs(doc):
        script = step["run"].strip()
        assert "${{" not in script, f"{step.get('name')}: pass values through env:, never ${{{{ }}}} in run (injection)"
        for line in script.splitlines():
            _check_command(shlex.split(line))
            n += 1
    assert n >= 3


_USES_RE = re.compile(r"^\s*(?:- )?uses: (\S+)(.*)$")
_PINNED_RE = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")
_VERSION_COMMENT_RE = re.compile(r"^ # v\d+\.\d+\.\d+$")


def _uses_lines() -> list[tuple[str, str, str]]:
    """(file, action@ref, rest of the line) for every `uses:` in every workflow (YAML drops comments)."""
    return [
        (p.name, m.group(1), m.group(2))
        for p in WORKFLOWS
        for ln in p.read_text().splitlines()
        if (m := _USES_RE.match(ln))
    ]


def test_actions_are_pinned_to_one_commit_each_with_its_version():
    """A full commit SHA (a tag can be moved under us) with its `# vX.Y.Z`, the same pin everywhere."""
    seen: dict[str, str] = {}
    uses = _uses_lines()
    assert len(uses) >= 20
    for name, ref, rest in uses:
        assert _PINNED_RE.match(ref), f"{name}: {ref} is not pinned to a full commit SHA"
        assert _VERSION_COMMENT_RE.match(rest), f"{name}: {ref} needs a '# vX.Y.Z' comment, has {rest!r}"
        action = ref.split("@")[0]
        assert seen.setdefault(action, ref + rest) == ref + rest, (
            f"{name}: {action} pinned differently across workflows"
        )


def _steps(path: Path):
    for job_name, job in _load(path)["jobs"].items():
        for step in job["steps"]:
            yield job_name, job, step


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_checkouts_do_not_persist_credentials(path):
    checkouts = [s for _, _, s in _steps(path) if s.get("uses", "").startswith("actions/checkout@")]
    assert checkouts and all(s["with"]["persist-credentials"] is False for s in checkouts)


DEFAULT_BRANCH = "${{ github.event.repository.default_branch }}"
_TRUSTED_REFS = {None, "${{ env.HARNESS_REF }}", DEFAULT_BRANCH}  # the workflow's own ref, the pinned harness, main
_TOKEN_RE = re.compile(r"github\.token|secrets\.")


def _writes(job: dict) -> bool:
    return any(v == "write" for v in (job.get("permissions") or {}).values())


def _untrusted_checkout(job: dict) -> bool:
    """The job checks out a PR's head (or any ref but its own and the pinned harness)."""
    return any(
        s.get("uses", "").startswith("actions/checkout@") and (s.get("with") or {}).get("ref") not in _TRUSTED_REFS
        for s in job["steps"]
    )


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_permissions_per_job_and_no_write_token_near_pr_code(path):
    doc = _load(path)
    assert doc["permissions"] == {}, "no workflow-level permissions: each job states its own"
    for name, job in doc["jobs"].items():
        assert "permissions" in job, f"{path.name}:{name} states no permissions"
        if _untrusted_checkout(job) or "pull_request" in doc["on"]:  # on pull_request every job runs PR code
            assert not _writes(job), f"{path.name}:{name} runs PR code with a write token"
            assert not _TOKEN_RE.search(json.dumps(job)), f"{path.name}:{name} runs PR code and reads a token"
        if _writes(job):
            refs = [
                (s.get("with") or {}).get("ref")
                for s in job["steps"]
                if s.get("uses", "").startswith("actions/checkout@")
            ]
            assert all(r in _TRUSTED_REFS for r in refs), (
                f"{path.name}:{name} holds a write token and checks out {refs}"
            )
    assert "env" not in doc or not _TOKEN_RE.search(json.dumps(doc["env"])), "no token in the workflow-level env"


def test_safety_rules_catch_a_write_token_beside_pr_code():
    """The rules above can fail: a PR checkout in a job that writes, or a token in its env."""
    doc = _load(ROOT / "ci" / "workflows" / "rerun-test.yml")
    run = doc["jobs"]["run"]
    assert _untrusted_checkout(run) and not _writes(run)
    assert _writes({"permissions": {"contents": "read", "issues": "write"}})
    assert _TOKEN_RE.search(json.dumps({"env": {"GITHUB_TOKEN": "${{ github.token }}"}}))
    assert not _untrusted_checkout(doc["jobs"]["report"])


def _needs(job: dict) -> list[str]:
    n = job.get("needs", [])
    return [n] if isinstance(n, str) else list(n)


@pytest.mark.parametrize("path", [p for p in WORKFLOWS if "issue_comment" in _load(p)["on"]], ids=lambda p: p.name)
def test_issue_comment_runs_pr_code_only_after_the_permission_check(path):
    """On issue_comment, a job with PR code needs the check's `allowed` on its needs chain, and no
    `always()`/`!cancelled()` on that chain (either would run it after a refusal skipped the chain)."""
    jobs = _load(path)["jobs"]
    for name, job in jobs.items():
        if not _untrusted_checkout(job):
            continue
        chain, todo = [], [name]
        while todo:
            j = todo.pop()
            chain.append(j)
            todo += [n for n in _needs(jobs[j]) if n not in chain]
        conds = [str(jobs[j].get("if", "")) for j in chain]
        assert any("needs.check.outputs.allowed == 'true'" in c for c in conds), (
            f"{name}: no permission check before PR code"
        )
        assert not any("always()" in c or "cancelled()" in c for c in conds), (
            f"{name}: runs even when the check refused"
        )
    if path.name == "slash-command.yml":  # no PR code at all here: it only dispatches rerun-test.yml
        assert not any(_untrusted_checkout(j) for j in jobs.values())


def test_sglang_variant_pins_the_harness_and_runs_the_prs_sglang():
    doc = _load(ROOT / "ci" / "workflows" / "sglang-rerun-test.yml")
    assert doc["on"] == {"issue_comment": {"types": ["created"]}}
    assert re.fullmatch(r"[0-9a-f]{40}", doc["env"]["HARNESS_REF"]), "pin the harness to a full commit SHA"
    jobs = doc["jobs"]
    for name, job in jobs.items():
        harness = [
            s for s in job["steps"] if s.get("uses", "").startswith("actions/checkout@") and "path" not in s["with"]
        ]
        assert harness and all(
            s["with"]["ref"] == "${{ env.HARNESS_REF }}" and s["with"]["repository"] == "${{ env.HARNESS_REPOSITORY }}"
            for s in harness
        ), name
    pr = [
        s
        for _, _, s in _steps(ROOT / "ci" / "workflows" / "sglang-rerun-test.yml")
        if (s.get("with") or {}).get("path") == "sglang"
    ]
    assert [s["with"]["ref"] for s in pr] == ["${{ needs.check.outputs.sha }}"]  # the commit the check saw, once
    run_cmds = [s["run"] for s in jobs["run"]["steps"] if "run" in s]
    assert any('--sglang sglang/python --plan-entry "$ENTRY"' in c for c in run_cmds)
    assert jobs["plan"]["if"] == "needs.check.outputs.allowed == 'true' && needs.check.outputs.specs != ''"
    assert "--github-output" in next(s["run"] for s in jobs["check"]["steps"] if s.get("id") == "parse")


def test_slash_command_checks_permission_before_dispatch():
    doc = _load(ROOT / "ci" / "workflows" / "slash-command.yml")
    assert doc["on"] == {"issue_comment": {"types": ["created"]}}
    [job] = doc["jobs"].values()
    assert "startsWith(github.event.comment.body, '/rerun-test')" in job["if"]
    runs = [s["run"] for s in job["steps"] if "run" in s]
    check = next(i for i, r in enumerate(runs) if "harness.rerun.github check" in r)
    dispatch = next(i for i, r in enumerate(runs) if "harness.rerun.github dispatch" in r)
    parse = next(i for i, r in enumerate(runs) if "--parse-only" in r)
    assert check < parse < dispatch
    step = next(s for s in job["steps"] if "dispatch" in s.get("run", ""))
    assert step["if"] == "steps.check.outputs.allowed == 'true'"
    assert "rerun-test.yml" in step["run"] and '--input "sha=$SHA"' in step["run"]
    assert step["env"]["SHA"] == "${{ steps.check.outputs.sha }}"


def test_rerun_matrix_comes_from_dry_run_and_runs_on_runner_label():
    doc = _load(ROOT / "ci" / "workflows" / "rerun-test.yml")
    assert set(doc["on"]["workflow_dispatch"]["inputs"]) == {"spec", "pr", "sha", "comment_id"}
    plan, run = doc["jobs"]["plan"], doc["jobs"]["run"]
    for job in (plan, run):  # the PR's code: the commit the slash command checked
        assert job["steps"][0]["with"]["ref"] == "${{ inputs.sha }}"
    plan_cmd = next(s["run"] for s in plan["steps"] if s.get("id") == "plan")
    assert "harness.commands.rerun --dry-run --github-output" in plan_cmd
    assert plan["outputs"]["matrix"] == "${{ steps.plan.outputs.matrix }}"
    # the plan's matrix reaches the run jobs only through the runners job (labels from ci/runners.json)
    assert run["strategy"]["matrix"] == "${{ fromJSON(needs.runners.outputs.matrix) }}"
    assert run["runs-on"] == "${{ matrix.runner }}"
    assert run["env"]["ENTRY"] == "${{ toJSON(matrix) }}"
    cmds = [s["run"] for s in run["steps"] if "run" in s]
    assert any("--plan-entry" in c and "--comment-out runs/ci/status.md" in c for c in cmds)
    # the results reach the comment through the report job, which closes out groups that left none
    report = doc["jobs"]["report"]
    assert set(report["needs"]) == {"runners", "run"} and "!cancelled()" in report["if"]
    update = next(s["run"] for s in report["steps"] if "github update" in s.get("run", ""))
    assert '--matrix "$MATRIX"' in update and update.endswith("--status-file results/*/status.md")


def test_bot_side_needs_only_the_standard_library(tmp_path):
    """The workflows call these with a bare setup-python interpreter: no site-packages (-S)."""
    import subprocess
    import sys

    from rerun_tree import make_repo

    repo = make_repo(tmp_path / "repo")
    plan = subprocess.run(
        [
            sys.executable,
            "-S",
            "-m",
            "harness.commands.rerun",
            "--dry-run",
            "--repo-root",
            str(repo),
            "/rerun-test test_hisparse_allocator.py test_disaggregation_dsv4.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.returncode == 0, plan.stderr
    assert {e["runner"] for e in __import__("json").loads(plan.stdout)["include"]} == {"ubuntu-latest", "8-gpu-h200"}
    for argv in (
        ["harness.rerun.github", "--help"],
        ["harness.rerun.relay", "--help"],
        ["harness.commands.rerun", "--parse-only", "test_a.py"],
    ):
        r = subprocess.run([sys.executable, "-S", "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr


def test_gates_workflow_triggers_matrix_and_verdict():
    doc = _load(ROOT / "ci" / "workflows" / "gates.yml")
    on = doc["on"]
    assert on["push"] == {"branches": ["main"], "tags": ["v*"]} and "pull_request" in on
    inputs = on["workflow_dispatch"]["inputs"]
    assert inputs["gate"]["default"] == "release" and not inputs["ref"]["required"]
    # per-commit on branches and PRs, release on tags and by hand (the gate name input)
    assert doc["env"]["GATE"] == "${{ inputs.gate || (github.ref_type == 'tag' && 'release') || 'per-commit' }}"
    # a new push cancels the previous per-commit run of its ref; release runs get their own group
    assert doc["concurrency"]["cancel-in-progress"] is True
    assert "github.ref ||" in doc["concurrency"]["group"] and "github.run_id" in doc["concurrency"]["group"]
    plan, run, verdict = doc["jobs"]["plan"], doc["jobs"]["run"], doc["jobs"]["verdict"]
    plan_cmds = {s["id"]: s["run"] for s in plan["steps"] if "run" in s}
    assert all("harness.cli gate plan" in c and '--github-output "$GITHUB_OUTPUT"' in c for c in plan_cmds.values())
    assert plan["outputs"]["matrix"] == "${{ " + " || ".join(f"steps.{i}.outputs.matrix" for i in plan_cmds) + " }}"
    assert run["strategy"] == {"fail-fast": False, "matrix": "${{ fromJSON(needs.runners.outputs.matrix) }}"}
    assert run["runs-on"] == FORK_RUNS_ON and run["env"]["RUNNER_LABEL"] == "${{ matrix.runner }}"
    from harness.engines.server import modelmap

    # every model a real-server suite may need reaches the gate from a repository variable
    assert {k: v for k, v in run["env"].items() if k.startswith("HARNESS_MODEL_")} == {
        modelmap.env_var(n): "${{ vars.%s }}" % modelmap.env_var(n) for n in modelmap.NAMES
    }
    cmds = [s["run"] for s in run["steps"] if "run" in s]
    assert cmds[0] == "./dev install"
    gate_runs = [c for c in cmds if "harness.cli gate run" in c]
    assert len(gate_runs) == 2 and all('--runner "$RUNNER_LABEL" --run-dir "runs/$ARTIFACT"' in c for c in gate_runs)
    # the plan and the run of one workflow run agree on --simulate (the same rule places the groups)
    for step in [
        s for s in plan["steps"] + run["steps"] if "gate plan" in s.get("run", "") or "gate run" in s.get("run", "")
    ]:
        assert ("--simulate" in step["run"]) == (step["if"] == "env.SIMULATE == 'true'"), step
    summary = next(s for s in run["steps"] if "gate verdict" in s.get("run", ""))
    assert summary["if"] == "always()" and summary["run"].endswith('>> "$GITHUB_STEP_SUMMARY"')
    upload = next(s for s in run["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["if"] == "always()"
    assert (
        upload["with"]["name"] == "${{ matrix.artifact }}" and upload["with"]["path"] == "runs/${{ matrix.artifact }}"
    )
    assert set(verdict["needs"]) == {"runners", "run"} and verdict["if"] == "${{ !cancelled() }}"
    download = next(s for s in verdict["steps"] if s.get("uses", "").startswith("actions/download-artifact"))
    assert download["with"] == {"pattern": "gate-*", "path": "reports"}
    final = verdict["steps"][-1]["run"]
    assert final.startswith('python -m harness.cli gate verdict "$GATE" --matrix "$MATRIX" --reports reports')
    assert verdict["env"]["MATRIX"] == "${{ needs.runners.outputs.matrix }}"


# ---------------------------------------------------------------- the bot runs what was approved, where it may run
# (issue 46): each rule below fails on the workflows of 2cc470a.

FORK = "github.event_name == 'pull_request' && github.event.pull_request.head.repo.full_name != github.repository"
FORK_RUNS_ON = "${{ " + FORK + " && 'ubuntu-latest' || matrix.runner }}"
_MATRIX_RE = re.compile(r"^\$\{\{ fromJSON\(needs\.(\w+)\.outputs\.matrix\) \}\}$")
_OUTPUT_RE = re.compile(r"steps\.(\w+)\.outputs\.matrix")


def _checkout_refs(job: dict) -> list:
    return [(s.get("with") or {}).get("ref") for s in job["steps"] if s.get("uses", "").startswith("actions/checkout@")]


def _placement_violations(doc: dict) -> list[str]:
    """Every job whose runs-on reads its matrix must take that matrix from a job that runs only trusted code
    (it checks out the default branch or the pinned harness explicitly) and sets it from the allow-list
    (`harness.rerun.github runners --allow ci/runners.json`)."""
    bad = []
    for name, job in doc["jobs"].items():
        if "matrix." not in str(job.get("runs-on", "")):
            continue
        m = _MATRIX_RE.match(str((job.get("strategy") or {}).get("matrix", "")))
        if not m:
            bad.append(f"{name}: its matrix is no job's output")
            continue
        src = doc["jobs"][m.group(1)]
        refs = _checkout_refs(src)
        if not refs or not all(r in (DEFAULT_BRANCH, "${{ env.HARNESS_REF }}") for r in refs):
            bad.append(f"{name}: its matrix comes from {m.group(1)}, which checks out {refs}, not only trusted code")
        steps = {s.get("id"): s for s in src["steps"]}
        for sid in _OUTPUT_RE.findall(src["outputs"]["matrix"]):
            run = steps[sid]["run"]
            if "harness.rerun.github runners" not in run or "--allow ci/runners.json" not in run:
                bad.append(f"{name}: its labels come from {m.group(1)}.{sid}, not from the allow-list")
    return bad


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_runs_on_labels_come_only_from_trusted_code(path):
    assert _placement_violations(_load(path)) == []


def test_runs_on_rule_catches_a_matrix_from_the_plan_job():
    """The rule can fail: the shape of 2cc470a (run's matrix straight from the plan job that ran PR code)."""
    doc = _load(ROOT / "ci" / "workflows" / "rerun-test.yml")
    doc["jobs"]["run"]["strategy"]["matrix"] = "${{ fromJSON(needs.plan.outputs.matrix) }}"
    assert _placement_violations(doc) == [
        "run: its matrix comes from plan, which checks out ['${{ inputs.sha }}'], not only trusted code",
        "run: its labels come from plan.plan, not from the allow-list",
    ]


def test_runner_allow_list_is_the_default_branch_topologies():
    from harness import topology
    from harness.rerun import runners

    allow = runners.load_allow_list(ROOT / "ci" / "runners.json")
    assert allow == {n: topology.get(n).runner for n in topology.names()}
    entry = {"name": "8-gpu-h200", "topology": "8-gpu-h200", "specs": ["a.py"]}
    # the PR's label is never used: the allow-list's is
    assert runners.pin({"include": [{**entry, "runner": "some-other-runner"}]}, allow) == {
        "include": [{**entry, "runner": "8-gpu-h200"}]
    }
    for bad, why in [
        ({**entry, "topology": "my-new-topology"}, "is not in the default branch's ci/runners.json"),
        ({**entry, "name": "x; rm -rf /"}, "is not a plain name"),
        ({"include": "x"}, "is not"),
    ]:
        with pytest.raises(runners.RunnerError, match=re.escape(why)):
            runners.pin(bad if "include" in bad else {"include": [bad]}, allow)


def test_a_fork_pull_request_gets_the_cpu_runner_only():
    from harness.rerun import runners

    doc = _load(ROOT / "ci" / "workflows" / "gates.yml")
    assert doc["env"]["FORK"] == "${{ " + FORK + " }}"
    assert doc["jobs"]["run"]["runs-on"] == FORK_RUNS_ON  # whatever the matrix says
    pins = {s["id"]: s for s in doc["jobs"]["runners"]["steps"] if "run" in s}
    assert pins["pin_fork"]["if"] == "env.FORK == 'true'" and pins["pin_fork"]["run"].endswith("--cpu-only")
    assert pins["pin"]["if"] == "env.FORK != 'true'" and "--cpu-only" not in pins["pin"]["run"]
    allow = runners.load_allow_list(ROOT / "ci" / "runners.json")
    simulated = {
        "name": "ubuntu-latest",
        "runner": "ubuntu-latest",
        "artifact": "gate-x-ubuntu-latest",
        "topologies": ["cpu", "8-gpu-h200"],
    }
    assert runners.pin({"include": [simulated]}, allow, cpu_only=True) == {"include": [simulated]}
    gpu = {**simulated, "name": "8-gpu-h200", "runner": "8-gpu-h200", "topologies": ["8-gpu-h200"]}
    with pytest.raises(runners.RunnerError, match="a pull request from a fork runs on 'ubuntu-latest' only"):
        runners.pin({"include": [gpu]}, allow, cpu_only=True)


def test_the_approved_commit_runs_and_a_push_after_the_comment_refuses():
    doc = _load(ROOT / "ci" / "workflows" / "rerun-test.yml")
    jobs = doc["jobs"]
    verify = next(s for s in jobs["verify"]["steps"] if "run" in s)
    assert verify["run"].startswith('python -m harness.rerun.github verify --pr "$PR" --sha "$SHA"')
    assert verify["env"]["SHA"] == "${{ inputs.sha }}" and not _untrusted_checkout(jobs["verify"])
    assert jobs["plan"]["needs"] == "verify"  # nothing of the PR's runs before the head is checked
    for name, job in jobs.items():  # every checkout of the PR's code is the approved commit
        refs = set(_checkout_refs(job))
        assert refs - _TRUSTED_REFS <= {"${{ inputs.sha }}"}, name
    said = next(s for s in jobs["queue"]["steps"] if s.get("if") == "env.VERIFIED == 'failure'")
    assert "--body-file reply/verify.txt --failed" in said["run"]
    sg = _load(ROOT / "ci" / "workflows" / "sglang-rerun-test.yml")["jobs"]["plan"]["steps"]
    runs = [s for s in sg if "run" in s]
    assert "github verify" in runs[0]["run"] and runs[0]["env"]["SHA"] == "${{ needs.check.outputs.sha }}"


def _pr_code_runs(path: Path, job: dict) -> bool:
    return _untrusted_checkout(job) or "pull_request" in _load(path)["on"]


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_pr_processes_are_ended_before_any_step_that_holds_a_token(path):
    """In a job that runs the PR's code, every action after the first PR step (an upload holds the artifact
    token) comes after the step that ends the PR's leftovers, with no PR step between; none detaches."""
    doc = _load(path)
    for name, job in doc["jobs"].items():
        if not _pr_code_runs(path, job):
            continue
        pr_started = ended = False
        for step in job["steps"]:
            if step.get("name") == END_STEP:
                assert step["if"] == "always()" and step["shell"] == "sh", name
                ended = True
            elif "run" in step and (pr_started or step.get("id") != "check"):
                pr_started, ended = True, False
                assert "--mutate-detached" not in step["run"] and "checkpoint" not in step["run"], name
            elif "uses" in step and pr_started:
                assert ended, f"{path.name}:{name}: {step['uses']} runs after the PR's code with no end step between"
    ends = [s["run"] for p in WORKFLOWS for _, _, s in _steps(p) if s.get("name") == END_STEP]
    assert len(ends) >= 4 and len(set(ends)) == 1  # one script, the same everywhere


def test_end_step_kills_a_daemon_the_pr_left(tmp_path):
    """The end step's script, in a PID namespace of its own: a daemon that left its session is gone after it."""
    import shutil
    import subprocess

    if (
        not shutil.which("unshare")
        or subprocess.run(
            ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "true"], capture_output=True
        ).returncode
    ):
        pytest.skip("no unprivileged PID namespace here")
    script = next(
        s["run"] for _, _, s in _steps(ROOT / "ci" / "workflows" / "rerun-test.yml") if s.get("name") == END_STEP
    )
    (tmp_path / "end.sh").write_text(script)
    (tmp_path / "daemon.sh").write_text("while :; do sleep 1; done\n")
    runner = (
        "sleep 1; setsid sh daemon.sh & sleep 1; sh -e end.sh; echo rc=$?; "
        "ps -e -o args= | grep -c '^sh daemon.sh$' || true"
    )
    r = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "sh", "-c", runner],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout.splitlines() == ["ending 2 process(es) the PR's code left running", "rc=0", "0"], r


@pytest.mark.parametrize("path", [p for p in WORKFLOWS if "rerun-test" in p.name], ids=lambda p: p.name)
def test_status_lines_are_rerendered_for_the_matrix_groups_only(path):
    """Every status comment update takes the placed matrix (its groups only, lines rebuilt from parsed fields);
    an error text a job wrote is posted only through --failed (escaped, in a code block)."""
    doc = _load(path)
    for name, step in _runs(doc):
        run = step["run"]
        if "harness.rerun.github update" in run:
            assert '--matrix "$MATRIX"' in run, name
            matrix = {**doc["jobs"][name].get("env", {}), **step.get("env", {})}["MATRIX"]
            assert matrix in ("${{ needs.runners.outputs.matrix }}", "${{ needs.plan.outputs.matrix }}"), name
            if matrix.endswith("plan.outputs.matrix }}"):  # the sglang variant's plan runs the pinned harness
                assert not _untrusted_checkout(doc["jobs"]["plan"])
        if "harness.rerun.github comment" in run and re.search(r"(error|verify|runners|failure)\.txt", run):
            assert "--failed" in run, f"{name}: {run}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_each_workflow_has_a_concurrency_group(path):
    doc = _load(path)
    group = doc["concurrency"]["group"]
    assert "${{" in group
    if "issue_comment" in doc["on"]:  # other comments never share (and so never replace) a waiting rerun
        assert "github.event.issue.number" in group and "github.event.comment.id" in group
        assert doc["concurrency"]["cancel-in-progress"] is False
    if path.name == "rerun-test.yml":
        assert group == "rerun-test-pr-${{ inputs.pr }}" and doc["concurrency"]["cancel-in-progress"] is False


def test_a_failed_check_or_dispatch_posts_its_reason():
    [job] = _load(ROOT / "ci" / "workflows" / "slash-command.yml")["jobs"].values()
    steps = job["steps"]
    last = steps[-1]
    assert last["if"] == "failure() && steps.parse.outcome != 'failure'"
    assert "harness.rerun.github comment" in last["run"] and "--body-file failure.txt --failed" in last["run"]
    assert last["env"]["PR"] == "${{ github.event.issue.number }}"  # known even when the check itself failed
    for s in steps:
        if re.search(r"github (check|dispatch|comment --pr \"\$PR\" --body-file (refusal|status))", s.get("run", "")):
            assert s["run"].rstrip().endswith("2>> failure.txt"), s["name"]
    sg = _load(ROOT / "ci" / "workflows" / "sglang-rerun-test.yml")["jobs"]
    assert sg["announce"]["if"] == "${{ !cancelled() && needs.check.result != 'skipped' }}"
    check_failed = next(s for s in sg["announce"]["steps"] if s.get("if") == "env.CHECKED == 'failure'")
    assert "--body-file reply/reply-failure.txt --failed" in check_failed["run"]
    queue = _load(ROOT / "ci" / "workflows" / "rerun-test.yml")["jobs"]["queue"]
    posted = {s["if"] for s in queue["steps"] if "--failed" in s.get("run", "")}
    assert posted == {"env.VERIFIED == 'failure'", "env.PLANNED == 'failure'", "env.PLACED == 'failure'"}
