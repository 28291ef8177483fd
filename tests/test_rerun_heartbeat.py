"""The comment heartbeat while a PR's mutation run goes on: the run job's checkpoints
(harness.rerun.checkpoint), the trusted relay (harness.rerun.relay) and the workflow steps joining them.
The real mutation run through the checkpoints is tests/test_mutation.py's."""

from __future__ import annotations

import io
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import yaml

from harness.rerun import checkpoint, comment, relay
from harness.rerun.github import GitHub

ROOT = Path(__file__).resolve().parents[1]

# Writes three progress lines into the status file, each only after the test acknowledged the one before
# (a file ack-<i> beside it), so what each checkpoint sees does not depend on the machine's load; then ends
# with exit status 3.
WRITER = textwrap.dedent("""
    import pathlib, sys, time
    from harness.rerun import comment
    status = pathlib.Path(sys.argv[1])
    for i in range(1, 4):
        comment.write_note(status, "mutation", f"mutation: {i} / 3 mutants run")
        print(f"mutant {i}", flush=True)
        deadline = time.monotonic() + 120
        while not (status.parent / f"ack-{i}").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    sys.exit(3)
""")


def test_checkpoints_hand_out_each_change_of_a_background_run_and_its_exit_status(tmp_path):
    status, bg = tmp_path / "status.md", tmp_path / "bg"
    checkpoint.start(bg, [sys.executable, "-c", WRITER, str(status)], cwd=ROOT)
    seen, rounds = [], 0
    running = True
    while running:
        rounds += 1
        assert rounds < 2000, "the background run never ended"
        running, changed = checkpoint.wait(bg, status, 0.3)
        if changed:
            seen.append(comment.parse(status.read_text())["mutation"])
            (tmp_path / f"ack-{len(seen)}").touch()  # the writer goes on to its next line
    assert [line.split("mutation: ")[1].split(" mutants")[0] for line in seen] == ["1 / 3", "2 / 3", "3 / 3"], seen
    assert checkpoint.wait(bg, status, 0.3) == (False, False)  # nothing new after the end: no second upload
    assert checkpoint.finish(bg) == 3
    assert "mutant 3" in (bg / "log").read_text()


def test_a_checkpoint_without_a_started_run_is_one_line_exit_2(tmp_path, capsys):
    rc = checkpoint.main(["wait", "--dir", str(tmp_path / "none"), "--status-file", str(tmp_path / "s.md")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no started command" in err[0]


def _zip(status_text: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("status.md", status_text)
    return buf.getvalue()


class FakeRun:
    """A workflow run's artifacts and jobs, and the status comment, as the REST API shows them."""

    def __init__(self, comment_body: str):
        self.comment = comment_body
        self.artifacts: dict[str, tuple[str, bytes]] = {}  # name -> (updated_at, zip)
        self.jobs = {"cpu": "in_progress", "relay": "in_progress"}
        self.fetched: list[str] = []

    def publish(self, group: str, stamp: str, line: str) -> None:
        self.artifacts[f"progress-{group}"] = (
            stamp,
            _zip(comment.apply_lines("", {"mutation": comment.note_line("mutation", line)})),
        )

    def transport(self, method, path, body):
        if path.endswith("/artifacts?per_page=100"):
            arts = [
                {"id": i, "name": n, "updated_at": s, "expired": False}
                for i, (n, (s, _)) in enumerate(self.artifacts.items())
            ]
            arts.append({"id": 99, "name": "rerun-cpu", "updated_at": "z", "expired": False})  # not a progress artifact
            return 200, {"artifacts": arts}
        if path.endswith("/jobs?per_page=100"):
            return 200, {"jobs": [{"name": n, "status": s} for n, s in self.jobs.items()]}
        if path.startswith("/repos/org/repo/issues/comments/5"):
            if method == "PATCH":
                self.comment = body["body"]
            return 200, {"body": self.comment}
        return 404, {"message": f"no route {method} {path}"}

    def fetch(self, path):
        self.fetched.append(path)
        idx = int(path.split("/artifacts/")[1].split("/")[0])
        return list(self.artifacts.values())[idx][1]


def _mutation_line(run: FakeRun) -> str:
    return comment.parse(run.comment).get("mutation", "")


def test_relay_copies_each_new_progress_and_never_undoes_the_final_line():
    run = FakeRun(comment.apply("", [comment.GroupStatus("cpu", "ubuntu-latest", state="passed", passed=3)]))
    gh, seen = GitHub("org/repo", run.transport), {}
    assert relay.relay_once(gh, run.fetch, 5, 1, seen) is None  # nothing handed out yet
    run.publish("cpu", "t1", "mutation: 1 / 4 mutants run")
    assert "1 / 4" in relay.relay_once(gh, run.fetch, 5, 1, seen) and "1 / 4" in _mutation_line(run)
    fetched = len(run.fetched)
    assert relay.relay_once(gh, run.fetch, 5, 1, seen) is None and len(run.fetched) == fetched  # unchanged: not fetched
    run.publish("cpu", "t2", "mutation: 3 / 4 mutants run")
    relay.relay_once(gh, run.fetch, 5, 1, seen)
    assert "3 / 4" in _mutation_line(run) and "✅" in comment.parse(run.comment)["cpu"]  # the group's line kept
    # The report job writes the score; a progress artifact read after it must not take its place.
    run.comment = comment.apply_lines(
        run.comment, {"mutation": comment.note_line("mutation", "mutation score 0.75: 3 killed")}
    )
    run.publish("cpu", "t3", "mutation: 4 / 4 mutants run")
    assert relay.relay_once(gh, run.fetch, 5, 1, seen) is None
    assert "mutation score 0.75" in _mutation_line(run)


def test_relay_rounds_until_the_run_jobs_complete_and_then_one_last():
    run = FakeRun(comment.apply("", [comment.GroupStatus("cpu", "ubuntu-latest", state="running")]))
    clock, slept = [0.0], []

    def sleep(s):
        slept.append(s)
        clock[0] += s
        if len(slept) == 2:  # the job publishes its last checkpoint and ends between two rounds
            run.publish("cpu", "t9", "mutation: 4 / 4 mutants run")
            run.jobs["cpu"] = "completed"
        elif len(slept) == 1:
            run.publish("cpu", "t1", "mutation: 1 / 4 mutants run")

    n = relay.relay(
        GitHub("org/repo", run.transport),
        run.fetch,
        5,
        1,
        {"cpu"},
        every=60,
        max_s=3600,
        clock=lambda: clock[0],
        sleep=sleep,
    )
    assert slept == [60, 60] and n == 2 and "4 / 4" in _mutation_line(run)
    # Bounded: a job that never completes ends the relay at --max-s.
    run.jobs["cpu"] = "in_progress"
    clock[0], slept[:] = 0.0, [0, 0, 0]
    relay.relay(
        GitHub("org/repo", run.transport),
        run.fetch,
        5,
        1,
        {"cpu"},
        every=60,
        max_s=200,
        clock=lambda: clock[0],
        sleep=sleep,
    )
    assert slept == [0, 0, 0, 60, 60, 60, 60]


@pytest.mark.parametrize(
    "argv,why",
    [
        (["--comment-id", "5", "--run-id", "1", "--matrix", "[1"], "bad --matrix"),
        (["--comment-id", "5", "--run-id", "1", "--matrix", "{}", "--every", "0"], "must be positive"),
    ],
)
def test_relay_refuses_bad_input_in_one_line(argv, why, capsys):
    run = FakeRun("")
    assert relay.main(argv, transport=run.transport, fetch=run.fetch) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0]


def _load(name: str) -> dict:
    doc = yaml.safe_load((ROOT / "ci" / "workflows" / name).read_text())
    doc["on"] = doc.pop(True, doc.get("on"))
    return doc


@pytest.mark.parametrize("name", ["rerun-test.yml", "sglang-rerun-test.yml"])
def test_the_workflows_run_mutation_in_the_group_step_with_no_progress_upload_beside_it(name):
    """Issue 46: no process of the PR's may outlive its step into one that holds the artifact token, so the
    workflows no longer start the mutation run detached with checkpoint uploads and a relay beside it: it
    runs inside the group's step, and its score reaches the comment through the report job."""
    doc = _load(name)
    steps = doc["jobs"]["run"]["steps"]
    group = next(s for s in steps if "harness.commands.rerun" in s.get("run", ""))
    assert "--mutate-detached" not in group["run"] and "--comment-out runs/ci/status.md" in group["run"]
    assert not [s for s in steps if "harness.rerun.checkpoint" in s.get("run", "")]
    assert not [s for s in steps if str((s.get("with") or {}).get("name", "")).startswith(relay.PROGRESS_PREFIX)]
    assert "relay" not in doc["jobs"]
