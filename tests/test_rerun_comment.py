"""Status comment (idempotent per-group lines), the permission rule, and the GitHub side on a fake API."""

from __future__ import annotations

import json

import pytest

from harness.report.results import CaseResult, GroupResult
from harness.rerun import comment, github
from harness.commands import rerun as cli
from harness.rerun.comment import GroupStatus
from harness.rerun.permission import may_rerun

Q = [
    GroupStatus("cpu", "ubuntu-latest"),
    GroupStatus("2-gpu-h100", "2-gpu-h100"),
    GroupStatus("8-gpu-h200", "8-gpu-h200"),
]


def test_new_comment_has_header_and_one_line_per_group():
    body = comment.apply("", Q)
    lines = body.splitlines()
    assert comment.STATUS_MARKER in lines[0]
    group_lines = [ln for ln in lines if "rerun-test:group=" in ln]
    assert len(group_lines) == 3 and all(ln.startswith("- ⏳") for ln in group_lines)
    assert all("[logs]({run_url})" in ln for ln in group_lines)


def test_update_is_idempotent_and_local():
    body = comment.apply("", Q)
    upd = [GroupStatus("2-gpu-h100", "2-gpu-h100", state="running", passed=1)]
    once = comment.apply(body, upd)
    assert comment.apply(once, upd) == once
    before, after = comment.parse(body), comment.parse(once)
    assert before["cpu"] == after["cpu"] and before["8-gpu-h200"] == after["8-gpu-h200"]
    assert "🔄" in after["2-gpu-h100"]
    assert list(after) == ["cpu", "2-gpu-h100", "8-gpu-h200"]  # order kept


def test_all_states_and_failures_with_reasons():
    res = GroupResult(
        "cpu",
        "cpu",
        "ubuntu-latest",
        cases=(
            CaseResult("suites/a.py::test_ok", "passed"),
            CaseResult("suites/a.py::test_bad", "failed", message="AssertionError: 3 != 4"),
            CaseResult("suites/a.py::test_err", "error", message="error in setup: RuntimeError: boom"),
            CaseResult("suites/a.py::test_skip", "skipped", message="needs GPU"),
        ),
        returncode=1,
    )
    line = comment.render_line(comment.from_result(res, link="https://ci/run/1"))
    assert line.startswith("- ❌ **cpu**") and "1 passed, 2 failed, 1 skipped" in line
    assert "`suites/a.py::test_bad` — AssertionError: 3 != 4" in line and "test_err" in line
    assert "[logs](https://ci/run/1)" in line and line.endswith(comment.group_marker("cpu"))
    ok = GroupResult("cpu", "cpu", "ubuntu-latest", cases=(CaseResult("x::t", "passed"),), returncode=0)
    assert comment.render_line(comment.from_result(ok)).startswith("- ✅")
    for state, icon in comment.ICONS.items():
        assert comment.render_line(GroupStatus("g", "r", state=state)).startswith(f"- {icon}")


def test_hostile_reason_cannot_fake_a_marker_or_break_the_line():
    s = GroupStatus(
        "cpu",
        "ubuntu-latest",
        state="failed",
        failed=1,
        failures=(("suites/a.py::t", "boom\n- ✅ **cpu** <!-- rerun-test:group=8-gpu-h200 -->"),),
    )
    body = comment.apply(comment.apply("", Q), [s])
    parsed = comment.parse(body)
    assert "⏳" in parsed["8-gpu-h200"]  # untouched
    assert parsed["cpu"].count("<!--") == 1
    assert comment.apply(body, [s]) == body


def test_duplicated_line_from_a_race_collapses():
    body = comment.apply("", Q)
    dup = body + comment.render_line(Q[0]) + "\n"
    fixed = comment.apply(dup, [GroupStatus("cpu", "ubuntu-latest", state="passed")])
    assert sum("group=cpu " in ln for ln in fixed.splitlines()) == 1


def test_unknown_state_refused():
    with pytest.raises(ValueError):
        GroupStatus("cpu", "r", state="done")


# ---------------------------------------------------------------- permission rule


@pytest.mark.parametrize(
    "commenter, author, perm, fork, allowed",
    [
        ("alice", "alice", "read", False, True),  # author, branch in repo
        ("alice", "alice", "none", True, False),  # author of a fork PR without write
        ("alice", "alice", "write", True, True),  # fork PR author with write
        ("bob", "alice", "write", False, True),
        ("bob", "alice", "maintain", True, True),
        ("bob", "alice", "admin", True, True),
        ("bob", "alice", "triage", False, False),
        ("bob", "alice", "read", False, False),
        ("mallory", "alice", "none", True, False),
        ("Alice", "alice", "read", False, True),  # logins are case-insensitive
    ],
)
def test_permission_rule(commenter, author, perm, fork, allowed):
    d = may_rerun(commenter, author, perm, fork)
    assert d.allowed is allowed and d.reason


# ---------------------------------------------------------------- GitHub side on a fake API


class FakeGitHub:
    """An in-memory stand-in for the few REST endpoints the bot uses."""

    def __init__(self, repo="org/repo", perms=None, pr_author="alice", head_repo="org/repo"):
        self.repo, self.perms = repo, perms or {}
        self.pr = {
            "user": {"login": pr_author},
            "head": {"repo": {"full_name": head_repo}, "sha": "c0ffee" * 6 + "abcd"},
        }
        self.comments: dict[int, str] = {}
        self.dispatched: list[dict] = []
        self.calls: list[tuple[str, str]] = []
        self.interfere: str | None = None  # a line another job writes between our read and write

    def __call__(self, method, path, body):
        self.calls.append((method, path))
        base = f"/repos/{self.repo}"
        if method == "GET" and "/collaborators/" in path:
            user = path.split("/collaborators/")[1].split("/")[0]
            return (200, {"permission": self.perms[user]}) if user in self.perms else (404, {"message": "Not Found"})
        if method == "GET" and path.startswith(f"{base}/pulls/"):
            return 200, self.pr
        if method == "POST" and path.endswith("/comments"):
            cid = 100 + len(self.comments)
            self.comments[cid] = body["body"]
            return 201, {"id": cid}
        if path.startswith(f"{base}/issues/comments/"):
            cid = int(path.rsplit("/", 1)[1])
            if method == "GET":
                return 200, {"body": self.comments[cid]}
            if self.interfere:
                body_now = comment.apply_lines(body["body"], {"cpu": self.interfere})
                self.interfere = None
                self.comments[cid] = body_now
                return 200, {}
            self.comments[cid] = body["body"]
            return 200, {}
        if method == "POST" and path.endswith("/dispatches"):
            self.dispatched.append(body)
            return 204, None
        return 404, {"message": f"no route {method} {path}"}


def _event(tmp_path, commenter="bob", body="/rerun-test test_a.py\nthanks"):
    ev = {"issue": {"number": 7, "pull_request": {}}, "comment": {"user": {"login": commenter}, "body": body}}
    p = tmp_path / "event.json"
    p.write_text(json.dumps(ev))
    return p


def test_check_allows_writer_and_writes_outputs(tmp_path, monkeypatch, capsys):
    out = tmp_path / "gh_out"
    monkeypatch.setenv("GITHUB_OUTPUT", str(out))
    monkeypatch.setenv("GITHUB_REPOSITORY", "org/repo")
    fake = FakeGitHub(perms={"bob": "write"})
    rc = github.main(["check", "--event", str(_event(tmp_path)), "--body-out", str(tmp_path / "c.txt")], transport=fake)
    assert rc == 0
    assert "allowed=true" in out.read_text() and "pr=7" in out.read_text()
    assert f"sha={fake.pr['head']['sha']}\n" in out.read_text()  # later jobs check out this commit, not the branch
    assert (tmp_path / "c.txt").read_text().startswith("/rerun-test test_a.py")


def test_check_refuses_fork_author_without_write(tmp_path, monkeypatch):
    out = tmp_path / "gh_out"
    monkeypatch.setenv("GITHUB_OUTPUT", str(out))
    monkeypatch.setenv("GITHUB_REPOSITORY", "org/repo")
    fake = FakeGitHub(perms={}, pr_author="eve", head_repo="eve/repo")
    refusal = tmp_path / "refusal.md"
    assert (
        github.main(["check", "--event", str(_event(tmp_path, "eve")), "--refusal-out", str(refusal)], transport=fake)
        == 0
    )
    assert "allowed=false" in out.read_text()
    assert "fork PR" in refusal.read_text()


def test_update_edits_only_its_line_and_survives_a_race(tmp_path, monkeypatch):
    monkeypatch.setenv("GITHUB_REPOSITORY", "org/repo")
    monkeypatch.setattr(github.time, "sleep", lambda s: None)
    fake = FakeGitHub()
    cid = github.GitHub("org/repo", fake).create_comment(7, comment.apply("", Q))
    status = tmp_path / "status.md"
    status.write_text(comment.apply("", [GroupStatus("2-gpu-h100", "2-gpu-h100", state="passed", passed=2)]))
    other = comment.render_line(GroupStatus("cpu", "ubuntu-latest", state="running"))
    fake.interfere = other  # another job edits the cpu line at the same moment
    matrix = json.dumps({"include": [{"name": g.name, "runner": g.runner} for g in Q]})
    argv = ["update", "--comment-id", str(cid), "--matrix", matrix, "--queued", "--status-file", str(status)]
    assert github.main(argv, transport=fake) == 0
    lines = comment.parse(fake.comments[cid])
    assert "✅" in lines["2-gpu-h100"] and lines["cpu"] == other and "⏳" in lines["8-gpu-h200"]
    before = fake.comments[cid]
    assert github.main(argv, transport=fake) == 0
    assert fake.comments[cid] == before  # idempotent
    assert fake.calls[-2:] == [("GET", f"/repos/org/repo/issues/comments/{cid}")] * 2  # no PATCH when nothing changes


def test_update_after_the_runs_closes_out_groups_that_left_no_result(tmp_path, monkeypatch):
    """The report job: every job's status file in one update; a group whose job died (no file, or
    its line still running) is marked failed with a note, never left queued."""
    monkeypatch.setenv("GITHUB_REPOSITORY", "org/repo")
    fake = FakeGitHub()
    cid = github.GitHub("org/repo", fake).create_comment(7, comment.apply("", Q))
    cpu, h100 = tmp_path / "cpu" / "status.md", tmp_path / "h100" / "status.md"
    for f, st in (
        (cpu, GroupStatus("cpu", "ubuntu-latest", state="passed", passed=3)),
        (h100, GroupStatus("2-gpu-h100", "2-gpu-h100", state="running", passed=1)),
    ):
        f.parent.mkdir()
        f.write_text(comment.apply("", [st]))
    matrix = json.dumps({"include": [{"name": g.name, "runner": g.runner} for g in Q]})
    assert (
        github.main(
            [
                "update",
                "--comment-id",
                str(cid),
                "--matrix",
                matrix,
                "--link",
                "https://ci/9",
                "--status-file",
                str(cpu),
                "--status-file",
                str(h100),
                "--status-file",
                str(tmp_path / "h200" / "status.md"),
            ],
            transport=fake,
        )
        == 0
    )
    lines = comment.parse(fake.comments[cid])
    assert comment.state_of(lines["cpu"]) == "passed" and "3 passed" in lines["cpu"]
    for name in ("2-gpu-h100", "8-gpu-h200"):
        assert comment.state_of(lines[name]) == "failed", lines[name]
        assert "the job ended before it reported a result" in lines[name] and "https://ci/9" in lines[name]


def test_update_needs_the_matrix_whose_groups_it_writes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GITHUB_REPOSITORY", "org/repo")
    assert github.main(["update", "--comment-id", "1"], transport=FakeGitHub()) == 2
    assert "update needs --matrix JSON: only the matrix's own groups are written" in capsys.readouterr().err


def test_dispatch(tmp_path, monkeypatch):
    monkeypatch.setenv("GITHUB_REPOSITORY", "org/repo")
    fake = FakeGitHub()
    spec = tmp_path / "spec.txt"
    spec.write_text("test_a.py test_b.py\n")
    assert (
        github.main(
            [
                "dispatch",
                "--workflow",
                "rerun-test.yml",
                "--ref",
                "main",
                "--input",
                "pr=7",
                "--input",
                "sha=abc",
                "--input-file",
                f"spec={spec}",
            ],
            transport=fake,
        )
        == 0
    )
    assert fake.dispatched == [{"ref": "main", "inputs": {"pr": "7", "sha": "abc", "spec": "test_a.py test_b.py"}}]


def test_parse_only_writes_the_specs_as_a_step_output(tmp_path, capsys):
    out = tmp_path / "gh_out"
    body = tmp_path / "comment.txt"
    body.write_text("/rerun-test test_a.py suites/b/test_b.py::TestC::test_d\nthanks\n")
    assert cli.main(["--parse-only", "--comment-file", str(body), "--github-output", str(out)]) == 0
    assert out.read_text() == "specs=test_a.py suites/b/test_b.py::TestC::test_d\n"


def test_api_error_is_one_line_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GITHUB_REPOSITORY", "org/repo")
    forbidden = lambda method, path, body: (403, {"message": "Forbidden"})  # noqa: E731
    rc = github.main(["comment", "--pr", "7", "--body-file", str(_event(tmp_path))], transport=forbidden)
    assert rc == 1
    assert capsys.readouterr().err.strip() == "github: POST /repos/org/repo/issues/7/comments: HTTP 403 Forbidden"


def test_missing_status_file_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GITHUB_REPOSITORY", "org/repo")
    matrix = json.dumps({"include": [{"name": "cpu", "runner": "ubuntu-latest"}]})
    assert (
        github.main(
            ["update", "--comment-id", "1", "--matrix", matrix, "--queued", "--status-file", str(tmp_path / "nope")],
            transport=FakeGitHub(),
        )
        == 2
    )
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_missing_token_outside_a_workflow(monkeypatch, capsys):
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)
    assert github.main(["dispatch", "--workflow", "w.yml", "--ref", "main"]) == 2


# ---------------------------------------------------------------- what a PR's run writes is data (issue 46)

HOSTILE = (
    "- ✅ **cpu** (`evil-runner`): passed — 3 passed, 0 failed, 0 skipped · "
    "[logs](https://evil.example/x) · "
    "[report](https://evil.example#artifacts) `x` · hi @admin see [here](https://evil.example) <img src=x> · "
    "failing: `suites/a.py::t` — boom **bold** @org/team; and 12 more · extra " + comment.group_marker("cpu")
)


def test_status_lines_are_rerendered_from_parsed_fields_for_the_matrix_groups_only():
    """A run job's status file (the PR's code wrote it): each line is rebuilt from its state, counts,
    failures and one note, with the matrix's runner label and the trusted link; markdown and mentions in its
    text are escaped; a group the matrix does not hold, and a line that does not parse, are dropped."""
    foreign = comment.render_line(GroupStatus("8-gpu-h200", "x", state="passed", passed=1))
    garbage = "- ❌ **2-gpu-h100** garbage " + comment.group_marker("2-gpu-h100")
    text = "\n".join(
        [
            comment.header(),
            HOSTILE,
            foreign,
            garbage,
            "- 📏 mutation: 3 / 9 mutants run @admin " + comment.group_marker("mutation"),
        ]
    )
    matrix = {"include": [{"name": "cpu", "runner": "ubuntu-latest"}, {"name": "2-gpu-h100", "runner": "2-gpu-h100"}]}
    lines = github.final_lines([text], matrix, "https://ci/run/9")
    assert set(lines) == {"cpu", "2-gpu-h100", "mutation"}  # 8-gpu-h200 is no group of this matrix
    cpu = lines["cpu"]
    assert cpu.startswith(
        "- ✅ **cpu** (`ubuntu-latest`): passed — 3 passed, 0 failed, 0 skipped · [logs](https://ci/run/9)"
    )
    assert "evil" not in cpu.split("· hi")[0]  # its runner, logs link and report link are the matrix's and ours
    assert "\\[here\\]\\(https://evil.example\\) \\<img src=x\\>" in cpu  # no link, no HTML
    assert "@\u2060admin" in cpu and "@admin" not in cpu and "\\*\\*bold\\*\\*" in cpu and "and 12 more" in cpu
    assert "extra" not in cpu and cpu.endswith(comment.group_marker("cpu"))
    assert comment.state_of(lines["2-gpu-h100"]) == "failed" and "ended before it reported" in lines["2-gpu-h100"]
    assert lines["mutation"] == comment.note_line("mutation", "mutation: 3 / 9 mutants run @\u2060admin")
    # the lines the harness itself renders come back unchanged (nothing to escape in them)
    plain = comment.render_line(
        comment.GroupStatus(
            "cpu",
            "ubuntu-latest",
            state="failed",
            passed=1,
            failed=1,
            link="https://ci/run/9",
            report=comment.report_path("cpu"),
            failures=(("suites/a.py::t", "AssertionError: 3 != 4"),),
        )
    )
    assert github.final_lines([plain], matrix, "https://ci/run/9")["cpu"] == plain


def test_a_push_after_the_comment_refuses_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GITHUB_REPOSITORY", "org/repo")
    fake = FakeGitHub()
    approved = fake.pr["head"]["sha"]
    assert github.main(["verify", "--pr", "7", "--sha", approved], transport=fake) == 0
    fake.pr["head"]["sha"] = "f" * 40  # the fork pushed after /rerun-test
    assert github.main(["verify", "--pr", "7", "--sha", approved], transport=fake) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"github: not run: the PR's head is now ffffffffffff, not {approved[:12]} approved by the "
        "/rerun-test comment (a push after it); comment /rerun-test again to run the new head"
    )


def test_a_failed_step_posts_its_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("GITHUB_REPOSITORY", "org/repo")
    fake = FakeGitHub()
    err = tmp_path / "error.txt"
    err.write_text("github: GET /repos/org/repo/pulls/7: HTTP 502 `oops` @admin\n")
    assert (
        github.main(
            [
                "comment",
                "--pr",
                "7",
                "--body-file",
                str(err),
                "--failed",
                "the permission check",
                "--link",
                "https://ci/run/9",
            ],
            transport=fake,
        )
        == 0
    )
    assert list(fake.comments.values()) == [
        "rerun-test: the permission check failed; the run is not going ahead ([logs](https://ci/run/9)).\n\n"
        "```\ngithub: GET /repos/org/repo/pulls/7: HTTP 502 'oops' @admin\n```\n"
    ]
    assert (
        github.main(
            [
                "comment",
                "--pr",
                "7",
                "--body-file",
                str(tmp_path / "none"),
                "--failed",
                "the dispatch",
                "--link",
                "https://ci/run/9",
            ],
            transport=fake,
        )
        == 0
    )
    assert list(fake.comments.values())[-1] == (
        "rerun-test: the dispatch failed; the run is not going ahead ([logs](https://ci/run/9)).\n"
    )
