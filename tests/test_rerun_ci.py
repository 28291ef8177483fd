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


def _runs(doc: dict):
    for job_name, job in doc["jobs"].items():
        for step in job["steps"]:
            if "run" in step:
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
    assert args[0] in ("python", ".venv/bin/python") and args[1] == "-m", f"YAML may only call python -m harness.…: {args}"
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
    return [(p.name, m.group(1), m.group(2)) for p in WORKFLOWS for ln in p.read_text().splitlines()
            if (m := _USES_RE.match(ln))]


def test_actions_are_pinned_to_one_commit_each_with_its_version():
    """A full commit SHA (a tag can be moved under us) with its `# vX.Y.Z`, the same pin everywhere."""
    seen: dict[str, str] = {}
    uses = _uses_lines()
    assert len(uses) >= 20
    for name, ref, rest in uses:
        assert _PINNED_RE.match(ref), f"{name}: {ref} is not pinned to a full commit SHA"
        assert _VERSION_COMMENT_RE.match(rest), f"{name}: {ref} needs a '# vX.Y.Z' comment, has {rest!r}"
        action = ref.split("@")[0]
        assert seen.setdefault(action, ref + rest) == ref + rest, f"{name}: {action} pinned differently across workflows"


def _steps(path: Path):
    for job_name, job in _load(path)["jobs"].items():
        for step in job["steps"]:
            yield job_name, job, step


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_checkouts_do_not_persist_credentials(path):
    checkouts = [s for _, _, s in _steps(path) if s.get("uses", "").startswith("actions/checkout@")]
    assert checkouts and all(s["with"]["persist-credentials"] is False for s in checkouts)


_TRUSTED_REFS = {None, "${{ env.HARNESS_REF }}"}  # the workflow's own ref, or the pinned harness
_TOKEN_RE = re.compile(r"github\.token|secrets\.")


def _writes(job: dict) -> bool:
    return any(v == "write" for v in (job.get("permissions") or {}).values())


def _untrusted_checkout(job: dict) -> bool:
    """The job checks out a PR's head (or any ref but its own and the pinned harness)."""
    return any(s.get("uses", "").startswith("actions/checkout@") and (s.get("with") or {}).get("ref") not in _TRUSTED_REFS
               for s in job["steps"])


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
            refs = [(s.get("with") or {}).get("ref") for s in job["steps"] if s.get("uses", "").startswith("actions/checkout@")]
            assert all(r in _TRUSTED_REFS for r in refs), f"{path.name}:{name} holds a write token and checks out {refs}"
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
        assert any("needs.check.outputs.allowed == 'true'" in c for c in conds), f"{name}: no permission check before PR code"
        assert not any("always()" in c or "cancelled()" in c for c in conds), f"{name}: runs even when the check refused"
    if path.name == "slash-command.yml":  # no PR code at all here: it only dispatches rerun-test.yml
        assert not any(_untrusted_checkout(j) for j in jobs.values())


def test_sglang_variant_pins_the_harness_and_runs_the_prs_sglang():
    doc = _load(ROOT / "ci" / "workflows" / "sglang-rerun-test.yml")
    assert doc["on"] == {"issue_comment": {"types": ["created"]}}
    assert re.fullmatch(r"[0-9a-f]{40}", doc["env"]["HARNESS_REF"]), "pin the harness to a full commit SHA"
    jobs = doc["jobs"]
    for name, job in jobs.items():
        harness = [s for s in job["steps"] if s.get("uses", "").startswith("actions/checkout@") and "path" not in s["with"]]
        assert harness and all(s["with"]["ref"] == "${{ env.HARNESS_REF }}" and s["with"]["repository"] ==
                               "${{ env.HARNESS_REPOSITORY }}" for s in harness), name
    pr = [s for _, _, s in _steps(ROOT / "ci" / "workflows" / "sglang-rerun-test.yml") if (s.get("with") or {}).get("path") == "sglang"]
    assert [s["with"]["ref"] for s in pr] == ["${{ needs.check.outputs.sha }}"]  # the commit the check saw, once
    run_cmds = [s["run"] for s in jobs["run"]["steps"] if "run" in s]
    assert any("--sglang sglang/python --plan-entry \"$ENTRY\"" in c for c in run_cmds)
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
    assert run["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    assert run["runs-on"] == "${{ matrix.runner }}"
    assert run["env"]["ENTRY"] == "${{ toJSON(matrix) }}"
    cmds = [s["run"] for s in run["steps"] if "run" in s]
    assert any("--plan-entry" in c and "--comment-out runs/ci/status.md" in c for c in cmds)
    # the results reach the comment through the report job, which closes out groups that left none
    report = doc["jobs"]["report"]
    assert set(report["needs"]) == {"plan", "run"} and "!cancelled()" in report["if"]
    update = next(s["run"] for s in report["steps"] if "github update" in s.get("run", ""))
    assert '--matrix "$MATRIX"' in update and update.endswith("--status-file results/*/status.md")


def test_bot_side_needs_only_the_standard_library(tmp_path):
    """The workflows call these with a bare setup-python interpreter: no site-packages (-S)."""
    import subprocess
    import sys

    from rerun_tree import make_repo

    repo = make_repo(tmp_path / "repo")
    plan = subprocess.run([sys.executable, "-S", "-m", "harness.commands.rerun", "--dry-run", "--repo-root", str(repo),
                           "/rerun-test test_hisparse_allocator.py test_disaggregation_dsv4.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert {e["runner"] for e in __import__("json").loads(plan.stdout)["include"]} == {"ubuntu-latest", "8-gpu-h200"}
    for argv in (["harness.rerun.github", "--help"], ["harness.rerun.relay", "--help"],
                 ["harness.commands.rerun", "--parse-only", "test_a.py"]):
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
    assert run["strategy"] == {"fail-fast": False, "matrix": "${{ fromJSON(needs.plan.outputs.matrix) }}"}
    assert run["runs-on"] == "${{ matrix.runner }}" and run["env"]["RUNNER_LABEL"] == "${{ matrix.runner }}"
    from harness.engines.server import modelmap

    # every model a real-server suite may need reaches the gate from a repository variable
    assert {k: v for k, v in run["env"].items() if k.startswith("HARNESS_MODEL_")} == {
        modelmap.env_var(n): "${{ vars.%s }}" % modelmap.env_var(n) for n in modelmap.NAMES}
    cmds = [s["run"] for s in run["steps"] if "run" in s]
    assert cmds[0] == "./dev install"
    gate_runs = [c for c in cmds if "harness.cli gate run" in c]
    assert len(gate_runs) == 2 and all('--runner "$RUNNER_LABEL" --run-dir "runs/$ARTIFACT"' in c for c in gate_runs)
    # the plan and the run of one workflow run agree on --simulate (the same rule places the groups)
    for step in [s for s in plan["steps"] + run["steps"] if "gate plan" in s.get("run", "") or "gate run" in s.get("run", "")]:
        assert ("--simulate" in step["run"]) == (step["if"] == "env.SIMULATE == 'true'"), step
    summary = next(s for s in run["steps"] if "gate verdict" in s.get("run", ""))
    assert summary["if"] == "always()" and summary["run"].endswith('>> "$GITHUB_STEP_SUMMARY"')
    upload = next(s for s in run["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["if"] == "always()"
    assert upload["with"]["name"] == "${{ matrix.artifact }}" and upload["with"]["path"] == "runs/${{ matrix.artifact }}"
    assert set(verdict["needs"]) == {"plan", "run"} and verdict["if"] == "${{ !cancelled() }}"
    download = next(s for s in verdict["steps"] if s.get("uses", "").startswith("actions/download-artifact"))
    assert download["with"] == {"pattern": "gate-*", "path": "reports"}
    final = verdict["steps"][-1]["run"]
    assert final.startswith('python -m harness.cli gate verdict "$GATE" --matrix "$MATRIX" --reports reports')
    assert verdict["env"]["MATRIX"] == "${{ needs.plan.outputs.matrix }}"
