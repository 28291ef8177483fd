"""The trusted side of the comment heartbeat: while the run jobs work, copy the progress they hand out
as artifacts into the status comment, at least every ``--every`` seconds.

It runs this branch's harness, never the PR's, and never replaces a final line with a progress line; it
ends once every run job has completed or after ``--max-s``. Standard library only. Its rounds:
docs/modules.md.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
import zipfile
from typing import Callable

from harness.rerun import comment
from harness.rerun.github import GitHub, GitHubError, Transport, update_lines, urllib_transport

log = logging.getLogger(__name__)

#: Name prefix of the artifacts the run jobs' checkpoints upload (``ci/workflows/*rerun-test.yml``).
PROGRESS_PREFIX = "progress-"
#: The comment line the relay keeps current (what ``harness mutate --comment-out`` writes).
LINE = "mutation"
#: A line that says the phase is over; a progress line never replaces it.
FINAL_MARK = "mutation score"
#: The file inside each progress artifact.
STATUS_NAME = "status.md"

Fetch = Callable[[str], bytes]


def urllib_fetch(api: str, token: str) -> Fetch:
    """Bytes of an API path that answers with a redirect to storage (an artifact's zip): the API call
    carries the token, the storage URL it redirects to is fetched without it (it is signed)."""

    class _NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return None

    opener = urllib.request.build_opener(_NoRedirect)

    def fetch(path: str) -> bytes:
        req = urllib.request.Request(
            api.rstrip("/") + path,
            headers={
                "Authorization": f"Bearer {token}",
                "Accept": "application/vnd.github+json",
                "X-GitHub-Api-Version": "2022-11-28",
            },
        )
        try:
            with opener.open(req, timeout=30) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            where = e.headers.get("Location") if e.code in (301, 302, 303, 307, 308) else None
            if not where:
                raise GitHubError(f"GET {path}: HTTP {e.code}") from None
        with urllib.request.urlopen(where, timeout=60) as resp:
            return resp.read()

    return fetch


def progress_artifacts(gh: GitHub, run_id: int) -> list[dict]:
    """The run's ``progress-*`` artifacts that can still be downloaded, oldest update first."""
    arts = [
        a
        for a in gh.run_artifacts(run_id)
        if str(a.get("name", "")).startswith(PROGRESS_PREFIX) and not a.get("expired")
    ]
    return sorted(arts, key=lambda a: str(a.get("updated_at") or ""))


def jobs_done(gh: GitHub, run_id: int, names: set[str]) -> bool:
    """Whether every job named in ``names`` (the matrix's groups) has completed; one not listed yet has not."""
    status = {str(j.get("name")): str(j.get("status")) for j in gh.run_jobs(run_id)}
    return all(status.get(n) == "completed" for n in names)


def status_line(zipped: bytes) -> str | None:
    """The ``mutation`` line of a progress artifact (a zip holding ``status.md``), rebuilt from its text, or None."""
    with zipfile.ZipFile(io.BytesIO(zipped)) as z:
        names = [n for n in z.namelist() if n.rsplit("/", 1)[-1] == STATUS_NAME]
        if not names:
            return None
        text = z.read(names[0]).decode("utf-8", errors="replace")
    line = comment.parse(text).get(LINE)
    # The artifact is a PR's run's output: only its escaped text is kept (comment.rerender).
    return comment.rerender(LINE, line, "", "") if line else None


def relay_once(gh: GitHub, fetch: Fetch, comment_id: int, run_id: int, seen: dict[str, str]) -> str | None:
    """One round: the newest changed progress line into the comment. ``seen`` (artifact name → its
    ``updated_at``) carries what earlier rounds read. Returns the line written, or None."""
    newest = None
    for art in progress_artifacts(gh, run_id):
        name, stamp = str(art["name"]), str(art.get("updated_at") or "")
        if seen.get(name) == stamp:
            continue
        seen[name] = stamp
        line = status_line(fetch(f"/repos/{gh.repo}/actions/artifacts/{art['id']}/zip"))
        if line:
            newest = line
    if newest is None:
        return None
    current = comment.parse(gh.get_comment(comment_id)).get(LINE, "")
    if FINAL_MARK in current and FINAL_MARK not in newest:
        return None  # the phase is over in the comment already: a late progress line must not undo it
    if current == newest:
        return None
    update_lines(gh, comment_id, {LINE: newest})
    return newest


def relay(
    gh: GitHub,
    fetch: Fetch,
    comment_id: int,
    run_id: int,
    names: set[str],
    *,
    every: float,
    max_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Rounds every ``every`` seconds until the named jobs have completed (then one last round) or
    ``max_s`` passed. Returns the number of lines written."""
    seen: dict[str, str] = {}
    written = 0
    deadline = clock() + max_s
    while True:
        done = jobs_done(gh, run_id, names)
        if relay_once(gh, fetch, comment_id, run_id, seen) is not None:
            written += 1
        if done or clock() >= deadline:
            return written
        sleep(every)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m harness.rerun.relay",
        description="copy the run jobs' progress artifacts into the status comment",
    )
    p.add_argument("--comment-id", type=int, required=True)
    p.add_argument("--run-id", type=int, required=True, help="the workflow run (github.run_id)")
    p.add_argument("--matrix", required=True, help="the plan's matrix (JSON): the run jobs to wait for")
    p.add_argument("--every", type=float, default=60.0, help="seconds between rounds (default 60)")
    p.add_argument("--max-s", type=float, default=3600.0, help="give up after this many seconds (default 3600)")
    return p


def main(argv: list[str] | None = None, transport: Transport | None = None, fetch: Fetch | None = None) -> int:
    """Entry point. Errors: one line on stderr, exit 1 (API) or 2 (usage)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.every <= 0 or args.max_s <= 0:
        print("relay: --every and --max-s must be positive seconds", file=sys.stderr)
        return 2
    try:
        names = {str(e["name"]) for e in json.loads(args.matrix).get("include", [])}
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError) as e:
        print(f"relay: bad --matrix ({e.__class__.__name__}: {e}); pass the plan's matrix JSON", file=sys.stderr)
        return 2
    repo = os.environ.get("GITHUB_REPOSITORY", "")
    if transport is None or fetch is None:
        token = os.environ.get("GITHUB_TOKEN", "")
        if not repo or not token:
            print("relay: GITHUB_REPOSITORY and GITHUB_TOKEN must be set (run inside a workflow)", file=sys.stderr)
            return 2
        api = os.environ.get("GITHUB_API_URL", "https://api.github.com")
        transport, fetch = transport or urllib_transport(api, token), fetch or urllib_fetch(api, token)
    try:
        n = relay(
            GitHub(repo=repo, transport=transport),
            fetch,
            args.comment_id,
            args.run_id,
            names,
            every=args.every,
            max_s=args.max_s,
        )
    except (GitHubError, zipfile.BadZipFile) as e:
        print(f"relay: {e}", file=sys.stderr)
        return 1
    print(f"relay: {n} progress line(s) written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
