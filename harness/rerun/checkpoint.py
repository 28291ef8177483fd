"""The run job's side of the comment heartbeat: a long phase (the ``--mutate`` run) goes on in the
background while the job's later steps hand its status file out as an artifact, one checkpoint at a time.

Commands ``start``, ``wait`` and ``finish`` (``python -m harness.rerun.checkpoint``). Why: the job holds a
read-only token and only a step can upload an artifact, never while another step runs. Standard library
only. The commands, the steps and the files under ``DIR``: docs/modules.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from harness.rerun.github import github_output
from harness.runs import pid_alive

#: Seconds between looks while a checkpoint waits.
POLL_S = 1.0


def start(run: Path, argv: list[str], cwd: Path | None = None) -> int:
    """Start ``argv`` in the background under a supervisor that records its exit status; returns its pid.

    The supervisor (this module's ``supervise``) runs in a session of its own, so the step that started
    it can end while it runs; it writes ``rc`` when the command ends.
    """
    if not argv:
        raise ValueError("start needs a command after --")
    run.mkdir(parents=True, exist_ok=True)
    for name in ("rc", "offset", "seen"):
        (run / name).unlink(missing_ok=True)
    with open(run / "log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "harness.rerun.checkpoint", "supervise", "--dir", str(run), "--", *argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
        )
    (run / "pid").write_text(f"{proc.pid}\n", encoding="utf-8")
    return proc.pid


def supervise(run: Path, argv: list[str]) -> int:
    """Run ``argv`` to its end and write its exit status to ``rc`` (written whole by a rename)."""
    try:
        code = subprocess.run(argv).returncode
    except OSError as e:
        print(f"checkpoint: cannot start {argv[0]}: {e.strerror}", flush=True)
        code = 127
    tmp = run / "rc.tmp"
    tmp.write_text(f"{code}\n", encoding="utf-8")
    tmp.replace(run / "rc")
    return code


def exit_status(run: Path) -> int | None:
    """The command's exit status, or None while it runs."""
    try:
        return int((run / "rc").read_text(encoding="utf-8").strip())
    except FileNotFoundError:
        return None


def _print_new_log(run: Path) -> None:
    offset_file = run / "offset"
    offset = int(offset_file.read_text(encoding="utf-8")) if offset_file.exists() else 0
    with open(run / "log", "rb") as f:
        f.seek(offset)
        data = f.read()
    if data:
        sys.stdout.write(data.decode("utf-8", errors="replace"))
        sys.stdout.flush()
    offset_file.write_text(str(offset + len(data)), encoding="utf-8")


def _alive(run: Path) -> bool:
    """Whether the supervisor still runs (it may have been killed before it could write ``rc``)."""
    try:
        pid = int((run / "pid").read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return False
    if not pid_alive(pid):
        return False
    # A child of this process that has ended but not been reaped is still "there" for kill(0).
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:  # not our child: kill(0) said enough
        return True


def wait(run: Path, status_file: Path, max_s: float, *, clock=time.monotonic, sleep=time.sleep) -> tuple[bool, bool]:
    """One checkpoint: wait until the command ended or ``max_s`` passed.

    Returns:
        (running, changed): whether the command still runs, and whether the status file's text differs
        from what the last checkpoint handed out (the text is then remembered as handed out).
    """
    if not (run / "log").exists():
        raise ValueError(f"{run} holds no started command; run `start --dir {run} -- COMMAND` first")
    deadline = clock() + max_s
    while exit_status(run) is None and _alive(run) and clock() < deadline:
        sleep(POLL_S)
    _print_new_log(run)
    running = exit_status(run) is None and _alive(run)
    text = status_file.read_text(encoding="utf-8") if status_file.is_file() else ""
    seen = run / "seen"
    changed = bool(text) and (not seen.exists() or seen.read_text(encoding="utf-8") != text)
    if changed:
        seen.write_text(text, encoding="utf-8")
    return running, changed


def finish(run: Path, *, sleep=time.sleep) -> int:
    """Wait for the command, print the rest of its output, and return its exit status (1 when its
    supervisor died without recording one)."""
    while exit_status(run) is None and _alive(run):
        sleep(POLL_S)
    _print_new_log(run)
    code = exit_status(run)
    if code is None:
        print(f"checkpoint: the command started in {run} ended without an exit status (killed?)", file=sys.stderr)
        return 1
    return code


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m harness.rerun.checkpoint",
        description="the run job's side of the "
        "comment heartbeat: a command in the background, handed out at checkpoints",
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("start", "supervise", "wait", "finish"):
        c = sub.add_parser(name)
        c.add_argument("--dir", type=Path, required=True)
        if name == "wait":
            c.add_argument("--status-file", type=Path, required=True)
            c.add_argument("--max-s", type=float, default=100.0)
        if name in ("start", "supervise"):
            c.add_argument("cmd", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point. A bad argument or a missing start: one line on stderr, exit 2."""
    args = build_parser().parse_args(argv)
    cmd = list(getattr(args, "cmd", []))
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    try:
        if args.command == "start":
            print(f"checkpoint: started {' '.join(cmd)} (pid {start(args.dir, cmd)}; output: {args.dir / 'log'})")
            return 0
        if args.command == "supervise":
            return supervise(args.dir, cmd)
        if args.command == "wait":
            if args.max_s <= 0:
                raise ValueError(f"--max-s {args.max_s:g}: give a positive number of seconds")
            running, changed = wait(args.dir, args.status_file, args.max_s)
            github_output(running=str(running).lower(), changed=str(changed).lower())
            return 0
        return finish(args.dir)
    except ValueError as e:
        print(f"checkpoint: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
