"""The GitHub side of the rerun bot, called by the workflows in ``ci/`` (stdlib only: no installs).

Commands ``check``, ``comment``, ``update`` and ``dispatch``; all HTTP goes through one :class:`GitHub`
object that tests replace with a fake. Jobs that run a PR's code hold a read-only token; only these
writes, run from trusted code, change anything. The commands and outputs: docs/modules.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from harness.rerun import comment, runners
from harness.rerun.permission import Decision, may_rerun

log = logging.getLogger(__name__)

Transport = Callable[[str, str, dict | None], tuple[int, object]]
UPDATE_ATTEMPTS = 5


class GitHubError(RuntimeError):
    """An API call failed. One line with the method, path and status."""


def urllib_transport(api: str, token: str) -> Transport:
    """The real transport: ``(method, path, json body) -> (status, parsed JSON or None)``."""

    def call(method: str, path: str, body: dict | None) -> tuple[int, object]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            api.rstrip("/") + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {token}",
                "Accept": "application/vnd.github+json",
                "X-GitHub-Api-Version": "2022-11-28",
                "Content-Type": "application/json",
            },
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                raw = resp.read()
                return resp.status, (json.loads(raw) if raw else None)
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw) if raw else None
            except json.JSONDecodeError:
                return e.code, None

    return call


@dataclass(frozen=True)
class GitHub:
    """The few REST calls the bot needs, on one repository."""

    repo: str
    transport: Transport

    def _call(self, method: str, path: str, body: dict | None = None, ok: tuple[int, ...] = (200,)) -> object:
        status, data = self.transport(method, path, body)
        if status not in ok:
            msg = data.get("message", "") if isinstance(data, dict) else ""
            raise GitHubError(f"{method} {path}: HTTP {status} {msg}".strip())
        return data

    def permission(self, user: str) -> str:
        """The user's permission on the repository (``admin``/``maintain``/``write``/``triage``/``read``/``none``)."""
        status, data = self.transport("GET", f"/repos/{self.repo}/collaborators/{user}/permission", None)
        if status == 404:  # not a collaborator
            return "none"
        if status != 200 or not isinstance(data, dict):
            raise GitHubError(f"GET permission of {user}: HTTP {status}")
        # role_name distinguishes maintain from write; permission folds it into write.
        return str(data.get("role_name") or data.get("permission") or "none")

    def pull(self, number: int) -> dict:
        return self._call("GET", f"/repos/{self.repo}/pulls/{number}")  # type: ignore[return-value]

    def create_comment(self, number: int, body: str) -> int:
        data = self._call("POST", f"/repos/{self.repo}/issues/{number}/comments", {"body": body}, ok=(201,))
        return int(data["id"])  # type: ignore[index]

    def get_comment(self, comment_id: int) -> str:
        data = self._call("GET", f"/repos/{self.repo}/issues/comments/{comment_id}")
        return str(data.get("body") or "")  # type: ignore[union-attr]

    def edit_comment(self, comment_id: int, body: str) -> None:
        self._call("PATCH", f"/repos/{self.repo}/issues/comments/{comment_id}", {"body": body})

    def run_artifacts(self, run_id: int) -> list[dict]:
        """The artifacts a workflow run has uploaded so far (its jobs may still be running)."""
        data = self._call("GET", f"/repos/{self.repo}/actions/runs/{run_id}/artifacts?per_page=100")
        return list((data or {}).get("artifacts", []))  # type: ignore[union-attr]

    def run_jobs(self, run_id: int) -> list[dict]:
        """The jobs of a workflow run with their ``name`` and ``status`` (queued / in_progress / completed)."""
        data = self._call("GET", f"/repos/{self.repo}/actions/runs/{run_id}/jobs?per_page=100")
        return list((data or {}).get("jobs", []))  # type: ignore[union-attr]

    def dispatch(self, workflow: str, ref: str, inputs: dict[str, str]) -> None:
        self._call(
            "POST",
            f"/repos/{self.repo}/actions/workflows/{workflow}/dispatches",
            {"ref": ref, "inputs": inputs},
            ok=(204,),
        )


def decide(gh: GitHub, event: dict) -> tuple[Decision, int, str]:
    """Apply the permission rule to an ``issue_comment`` event.

    Returns:
        (decision, PR number, the PR's head commit SHA now). Later jobs check out that SHA, not the
        PR branch, so a push after the check cannot slip unchecked code into the run.

    Raises:
        GitHubError: the event is not a comment on a pull request, or an API call failed.
    """
    issue = event.get("issue") or {}
    if "pull_request" not in issue:
        raise GitHubError("the comment is not on a pull request")
    number = int(issue["number"])
    commenter = event["comment"]["user"]["login"]
    pr = gh.pull(number)
    head_repo = ((pr.get("head") or {}).get("repo") or {}).get("full_name")
    is_fork = head_repo != gh.repo
    sha = str((pr.get("head") or {}).get("sha") or "")
    return may_rerun(commenter, pr["user"]["login"], gh.permission(commenter), is_fork), number, sha


def update_lines(gh: GitHub, comment_id: int, lines: dict[str, str]) -> str:
    """Read-modify-write the status comment until our group lines are in it (parallel jobs race).

    Args:
        gh: the API.
        comment_id: the status comment.
        lines: group name → rendered line (:func:`comment.render_line`).

    Returns:
        The body as written.

    Raises:
        GitHubError: still not in after :data:`UPDATE_ATTEMPTS` tries.
    """
    for attempt in range(UPDATE_ATTEMPTS):
        body = gh.get_comment(comment_id)
        new = comment.apply_lines(body, lines)
        if new != body:
            gh.edit_comment(comment_id, new)
        # Another job may have written between our read and write; check our lines survived.
        now = comment.parse(gh.get_comment(comment_id))
        if all(now.get(name) == line for name, line in lines.items()):
            return new
        time.sleep(0.5 * (attempt + 1))
    raise GitHubError(f"comment {comment_id}: lines for {', '.join(lines)} lost to concurrent edits")


def _entries(matrix: dict | None) -> list[dict]:
    return [e for e in (matrix or {}).get("include", []) if isinstance(e, dict)]


def final_lines(
    status_texts: list[str], matrix: dict | None, link: str = comment.LINK_PLACEHOLDER, *, close_out: bool = True
) -> dict[str, str]:
    """The group lines to write from the run jobs' status files, for the matrix's own groups only.

    A status file is a run job's output (the PR's code): each of its lines is rebuilt from parsed fields
    (:func:`comment.rerender`: the matrix's runner label, ``link``, escaped text); a line of a group the
    matrix does not hold, or one that does not parse, is dropped. The note lines (:data:`comment.NOTE_LINES`)
    pass the same way.

    Args:
        status_texts: the ``--comment-out`` files the jobs left (their artifacts).
        matrix: the plan's matrix as the trusted side placed it (:mod:`harness.rerun.runners`).
        link: the logs link of every line (the workflow run).
        close_out: after the runs: a group whose line is missing or not final (queued, running: its job
            died before reporting) gets a failed line saying so. Before them (False): only the lines found.

    Returns:
        Group name → rendered line.
    """
    labels = {str(e.get("name")): str(e.get("runner", "")) for e in _entries(matrix)}
    found: dict[str, str] = {}
    for text in status_texts:
        found.update(comment.parse(text))
    lines: dict[str, str] = {}
    for name, line in found.items():
        if name in labels:
            new = comment.rerender(name, line, labels[name], link)
        elif name in comment.NOTE_LINES:
            new = comment.rerender(name, line, "", link)
        else:
            continue
        if new is not None:
            lines[name] = new
    for name, runner in labels.items():
        state = comment.state_of(lines.get(name, ""))
        if close_out and state not in ("passed", "failed"):
            lines[name] = comment.render_line(
                comment.GroupStatus(
                    name=name,
                    runner=runner,
                    state="failed",
                    link=link,
                    note="the job ended before it reported a result; see its log",
                )
            )
    return lines


def verify_head(gh: GitHub, number: int, sha: str) -> None:
    """The PR's head is still ``sha``, the commit approved when ``/rerun-test`` was checked.

    Raises:
        GitHubError: a push moved the head after the comment (one line saying so and what to do).
    """
    head = str(((gh.pull(number).get("head") or {}).get("sha")) or "")
    if not sha or head != sha:
        raise GitHubError(
            f"not run: the PR's head is now {head[:12] or 'unknown'}, not {sha[:12] or 'unknown'} "
            f"approved by the /rerun-test comment (a push after it); comment /rerun-test again "
            f"to run the new head"
        )


def failure_body(what: str, text: str, link: str) -> str:
    """The reply when a step failed: what failed, and its error text (a PR's run may have written it) in
    a code block, backticks removed, at most 40 lines."""
    lines = [ln.replace("`", "'")[:300] for ln in text.strip().splitlines()[:40]]
    body = f"rerun-test: {what} failed; the run is not going ahead ([logs]({link}))."
    return body + ("\n\n```\n" + "\n".join(lines) + "\n```\n" if lines else "\n")


def github_output(**values: object) -> None:
    """Print ``key=value`` lines, and append them to ``$GITHUB_OUTPUT`` when set (a step's outputs)."""
    target = os.environ.get("GITHUB_OUTPUT")
    for k, v in values.items():
        print(f"{k}={v}")
        if target:
            with open(target, "a", encoding="utf-8") as f:
                f.write(f"{k}={v}\n")


def comment_id(value: str) -> int | None:
    """A comment id option: a number, or empty (a step output that was never set)."""
    return int(value) if value.strip() else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.rerun.github", description="GitHub side of the rerun bot")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="permission check for an issue_comment event")
    c.add_argument("--event", type=Path, required=True)
    c.add_argument("--body-out", type=Path, help="write the comment body here (input to rerun-test --comment-file)")
    c.add_argument("--refusal-out", type=Path, help="when refused, write the reply explaining why here")
    c = sub.add_parser("comment", help="create or replace the status comment")
    c.add_argument("--pr", type=int, required=True)
    c.add_argument("--body-file", type=Path, required=True)
    c.add_argument("--comment-id", type=comment_id, help="edit this comment (empty: post a new one)")
    c.add_argument(
        "--failed",
        metavar="WHAT",
        help="the body file is the error of WHAT (a step that failed): "
        "post it as the reason, escaped; a missing file says to see the log",
    )
    c.add_argument("--link", default=comment.LINK_PLACEHOLDER, help="the workflow run (with --failed)")
    c = sub.add_parser("update", help="write the matrix's group lines, rebuilt from --comment-out files")
    c.add_argument("--comment-id", type=int, required=True)
    c.add_argument(
        "--status-file",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="a --comment-out file (repeatable); with --queued it must exist, after the runs a "
        "missing file is a job that left none",
    )
    c.add_argument("--matrix", help="the matrix as the trusted side placed it (JSON): only its groups are written")
    c.add_argument(
        "--queued",
        action="store_true",
        help="before the runs: write only the lines found (default: a group without a final line is "
        "closed out as failed)",
    )
    c.add_argument("--link", default=comment.LINK_PLACEHOLDER, help="the logs link of every line (the workflow run)")
    c = sub.add_parser("verify", help="the PR's head is still the approved commit (a push after /rerun-test refuses)")
    c.add_argument("--pr", type=int, required=True)
    c.add_argument("--sha", required=True, help="the commit the /rerun-test check approved")
    c = sub.add_parser("runners", help="place a plan's matrix on the runners of the allow-list (trusted code only)")
    c.add_argument("--matrix", required=True, help="the plan's matrix (JSON), as the plan printed it")
    c.add_argument("--allow", type=Path, required=True, help="the default branch's ci/runners.json")
    c.add_argument("--cpu-only", action="store_true", help="every group on the CPU runner (a fork's pull request)")
    c = sub.add_parser("dispatch", help="start a workflow_dispatch run")
    c.add_argument("--workflow", required=True)
    c.add_argument("--ref", required=True)
    c.add_argument("--input", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument(
        "--input-file", action="append", default=[], metavar="KEY=FILE", help="an input read from a file (first line)"
    )
    return p


def run(args: argparse.Namespace, gh: GitHub) -> int:
    """Execute one sub-command against ``gh``. Returns the exit code."""
    if args.command == "check":
        event = json.loads(args.event.read_text(encoding="utf-8"))
        decision, number, sha = decide(gh, event)
        if args.body_out:
            args.body_out.write_text(event["comment"]["body"], encoding="utf-8")
        if args.refusal_out and not decision.allowed:
            args.refusal_out.write_text(f"rerun-test: not run: {decision.reason}.\n", encoding="utf-8")
        github_output(allowed=str(decision.allowed).lower(), reason=decision.reason, pr=number, sha=sha)
        return 0
    if args.command == "comment":
        if args.failed:
            text = args.body_file.read_text(encoding="utf-8", errors="replace") if args.body_file.is_file() else ""
            body = failure_body(args.failed, text, args.link)
        else:
            body = args.body_file.read_text(encoding="utf-8")
        if args.comment_id:
            gh.edit_comment(args.comment_id, body)
            github_output(comment_id=args.comment_id)
        else:
            github_output(comment_id=gh.create_comment(args.pr, body))
        return 0
    if args.command == "update":
        if not args.matrix:
            raise ValueError("update needs --matrix JSON: only the matrix's own groups are written")
        # After the runs, a job that died left no file: its group is closed out, not an error.
        texts = [
            f.read_text(encoding="utf-8", errors="replace") for f in args.status_file if args.queued or f.is_file()
        ]
        lines = final_lines(texts, json.loads(args.matrix), args.link, close_out=not args.queued)
        if lines:
            update_lines(gh, args.comment_id, lines)
        return 0
    if args.command == "verify":
        verify_head(gh, args.pr, args.sha)
        print(f"the PR's head is the approved commit {args.sha}")
        return 0
    if args.command == "runners":
        matrix = runners.pin(json.loads(args.matrix), runners.load_allow_list(args.allow), cpu_only=args.cpu_only)
        github_output(matrix=json.dumps(matrix, separators=(",", ":")))
        return 0
    if args.command == "dispatch":
        inputs = dict(kv.split("=", 1) for kv in args.input)
        for kv in args.input_file:
            key, _, path = kv.partition("=")
            text = Path(path).read_text(encoding="utf-8").splitlines()
            inputs[key] = text[0].strip() if text else ""
        gh.dispatch(args.workflow, args.ref, inputs)
        return 0
    raise AssertionError(args.command)


def main(argv: list[str] | None = None, transport: Transport | None = None) -> int:
    """Entry point. Errors: one line on stderr, exit 1 (API) or 2 (usage)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    repo = os.environ.get("GITHUB_REPOSITORY", "")
    if transport is None:
        token = os.environ.get("GITHUB_TOKEN", "")
        if not repo or not token:
            print("github: GITHUB_REPOSITORY and GITHUB_TOKEN must be set (run inside a workflow)", file=sys.stderr)
            return 2
        transport = urllib_transport(os.environ.get("GITHUB_API_URL", "https://api.github.com"), token)
    try:
        return run(args, GitHub(repo=repo, transport=transport))
    except GitHubError as e:
        print(f"github: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"github: cannot read {e.filename}: {e.strerror}; pass an existing file", file=sys.stderr)
        return 2
    except runners.RunnerError as e:
        print(f"github: {e}", file=sys.stderr)
        return 1
    except (json.JSONDecodeError, KeyError, ValueError) as e:
        print(
            f"github: bad input ({e.__class__.__name__}: {e}); pass the event/entry JSON the workflow provides",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
