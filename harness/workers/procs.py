"""The harness's own processes: a registry on disk, so a run killed with SIGKILL is cleaned up by the next.

Every process the harness starts that could outlive its owner is recorded in :data:`REGISTRY_DIR` with its
pid, start time and owner; :func:`reap_stale` kills the entries whose owner is gone, and nothing else.
Linux only. Detail: docs/modules.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from harness.clock import Deadline

log = logging.getLogger(__name__)

#: The harness's per-user state on this machine (the process registry, the port leases): a directory of mode
#: 0700 that :func:`private_dir` checks before anything in it is read or trusted.
STATE_DIR = Path(tempfile.gettempdir()) / f"pd-harness-{os.getuid()}"
#: One directory per user on this machine (``$HARNESS_PROCS_DIR`` overrides it, for tests); entries
#: are ``<owner pid>-<kind>-<pid>.json``.
REGISTRY_DIR = Path(os.environ.get("HARNESS_PROCS_DIR") or STATE_DIR / "procs")
#: Where a ``dir`` entry may point: a directory the harness made in the system temp directory with one of these
#: prefixes (a Ray temp dir, :func:`harness.cluster.cluster`'s ``ph-``). Anything else is never removed.
DIR_PREFIXES = ("ph-",)


class StateError(RuntimeError):
    """The harness's per-user state on this machine cannot be used: one line, naming what and the fix."""


class UnsafeDirError(StateError):
    """The harness's state directory is not this user's own: one line, naming it and the fix."""


def private_dir(path: Path) -> Path:
    """``path`` as a directory only this user can write, created with mode 0700 when missing.

    One owned by another user, a symlink, or one others can write is refused (someone could plant entries that
    steer the cleanup, or hold the lease lock); one of ours that others can only read, or that only our own group
    can write (an older harness's mkdir under umask 002), is narrowed to 0700.

    Raises:
        UnsafeDirError: one line naming the directory, what is wrong and the fix.
    """
    path = Path(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        private_dir(path.parent)
        return private_dir(path)
    st = os.lstat(path)
    fix = "remove it, or point TMPDIR at a directory of your own"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirError(f"{path}: not a directory (a symlink or a file) where the harness keeps its state; {fix}")
    if st.st_uid != os.getuid():
        raise UnsafeDirError(f"{path}: owned by uid {st.st_uid}, not by you (uid {os.getuid()}); {fix}")
    if st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != os.getgid()):
        raise UnsafeDirError(f"{path}: others can write it (mode {stat.S_IMODE(st.st_mode):o}); {fix}")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def registry_dir() -> Path:
    """:data:`REGISTRY_DIR`, checked (:func:`private_dir`; its parent too when it is the default)."""
    if REGISTRY_DIR == STATE_DIR / "procs":
        private_dir(STATE_DIR)
    return private_dir(REGISTRY_DIR)


def dir_allowed(path: str | Path) -> bool:
    """Whether a ``dir`` entry names a directory the harness made (:data:`DIR_PREFIXES` in the temp directory).

    >>> dir_allowed(Path(tempfile.gettempdir()) / "ph-abc123")
    True
    >>> dir_allowed("/home/me/data"), dir_allowed("/tmp/ph-x/..")
    (False, False)
    """
    p = Path(os.path.normpath(path))
    parents = {Path(os.path.normpath(tempfile.gettempdir())), Path("/tmp")}
    return p.parent in parents and p.name.startswith(DIR_PREFIXES) and p.name not in ("", "..")


#: Environment variable that names the run's owner (``pid:start``) to processes started for it.
OWNER_ENV = "HARNESS_OWNER"


@dataclass(frozen=True)
class Entry:
    """One registered process (``kind`` "pid"), process group ("pgid") or directory ("dir")."""

    kind: str
    pid: int
    start: float
    owner: int
    owner_start: float
    label: str = ""
    path: str = ""


#: Clock ticks per second of ``/proc/PID/stat``'s times.
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def start_time(pid: int) -> float | None:
    """When ``pid`` started, in seconds after boot, or None when it does not exist or is a zombie.

    With the pid it names one process: a later process that reuses the pid has another start time.
    It is the kernel's start tick (``/proc/PID/stat``), not psutil's ``create_time()``: that adds the
    boot time the wall clock implies *now*, which moves when the clock is stepped, so a process read
    before a step and after it looked like two processes, and :func:`reap_stale` then took every live
    run's owner for dead (seen here: a test run's Ray temp dirs removed under its live clusters).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # no such process (or not ours to read)
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) ": the command may hold spaces
    if fields[0] in (b"Z", b"X"):  # a zombie, or dead
        return None
    return int(fields[19]) / _CLOCK_TICKS


def alive(pid: int, start: float | None = None) -> bool:
    """True if ``pid`` runs (not a zombie) and, when given, was started at ``start``."""
    st = start_time(pid)
    return st is not None and (start is None or st == start)


def _live() -> Iterator[tuple[int, int, int, int]]:
    """(pid, ppid, pgid, sid) of every live (non-zombie) process."""
    import psutil

    for proc in psutil.process_iter(["ppid", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            yield proc.pid, proc.info["ppid"], os.getpgid(proc.pid), os.getsid(proc.pid)
        except (ProcessLookupError, PermissionError):
            continue  # gone since it was listed


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is ``pgid``."""
    return [pid for pid, _, group, _ in _live() if group == pgid]


def session_members(sid: int) -> list[int]:
    """Live (non-zombie) pids whose session is ``sid``.

    A ``ray start`` node started in its own session keeps every process of that node in it: Ray's
    worker processes take process groups of their own, but never leave the session.
    """
    return [pid for pid, _, _, session in _live() if session == sid]


def descendants(pid: int) -> list[int]:
    """Live (non-zombie) pids below ``pid`` in the process tree (children, grandchildren, ...)."""
    import psutil

    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for proc in below:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return out


def owner() -> tuple[int, float]:
    """The owner of processes started from here: ``$HARNESS_OWNER`` if set, else this process."""
    env = os.environ.get(OWNER_ENV)
    if env:
        pid, start = env.split(":")
        return int(pid), float(start)
    return os.getpid(), start_time(os.getpid()) or 0


def claim() -> None:
    """Make this process the owner of everything started from here on (the Ray driver, pytest)."""
    os.environ[OWNER_ENV] = f"{os.getpid()}:{start_time(os.getpid()) or 0}"


def owner_env() -> dict[str, str]:
    """Environment that makes processes started elsewhere (Ray actors) register under our owner."""
    pid, start = owner()
    return {OWNER_ENV: f"{pid}:{start}"}


def register(pid: int, *, kind: str = "pid", label: str = "", path: str | Path = "") -> Path | None:
    """Record a process (``kind="pid"``), a process group (``"pgid"``) or a directory (``"dir"``).

    Args:
        pid: the process id, or the group id for ``"pgid"``; for ``"dir"`` the owner's pid.
        kind: what to clean up if the owner dies.
        label: a human name for logs.
        path: the directory, for ``kind="dir"``.

    Returns:
        The registry file, or None when ``pid`` is already gone.
    """
    own, own_start = owner()
    st = start_time(pid) if kind != "dir" else 0
    if st is None:
        return None
    if kind == "dir" and not dir_allowed(path):
        raise ValueError(f"{path}: not a directory the harness made in the temp directory ({', '.join(DIR_PREFIXES)}*)")
    entry = Entry(kind=kind, pid=pid, start=st, owner=own, owner_start=own_start, label=label, path=str(path))
    f = registry_dir() / f"{own}-{kind}-{pid}.json"
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(entry)))
    tmp.replace(f)
    return f


def unregister(pid: int, *, kind: str = "pid") -> None:
    """Forget a registered process (it was stopped cleanly)."""
    own, _ = owner()
    (REGISTRY_DIR / f"{own}-{kind}-{pid}.json").unlink(missing_ok=True)


def entries() -> list[Entry]:
    """All registry entries (any owner)."""
    out = []
    for f in sorted(registry_dir().glob("*.json")):
        try:
            out.append(Entry(**json.loads(f.read_text())))
        except (OSError, ValueError, TypeError):
            f.unlink(missing_ok=True)
    return out


def _file(e: Entry) -> Path:
    return REGISTRY_DIR / f"{e.owner}-{e.kind}-{e.pid}.json"


def kill_entry(e: Entry) -> bool:
    """SIGKILL what ``e`` names if it is still the same process (or remove its directory).

    Returns:
        True if something was killed or removed.
    """
    if e.kind == "dir":
        if not dir_allowed(e.path):
            log.warning(
                "refused to remove %s: a registry entry may name only the harness's own temp directories", e.path
            )
            return False
        if e.path and Path(e.path).is_dir() and not Path(e.path).is_symlink():
            shutil.rmtree(e.path, ignore_errors=True)
            return True
        return False
    if e.kind == "pgid":
        # The leader may be gone while members live on; kill the group if any member is left.
        if alive(e.pid, e.start) or group_members(e.pid):
            try:
                os.killpg(e.pid, signal.SIGKILL)
                return True
            except ProcessLookupError:
                return False
        return False
    if alive(e.pid, e.start):
        try:
            os.kill(e.pid, signal.SIGKILL)
            return True
        except ProcessLookupError:
            return False
    return False


def reap_stale() -> list[Entry]:
    """Kill everything registered by owners that are no longer running; remove their entries.

    Returns:
        The entries that still had something to kill.
    """
    killed = []
    for e in entries():
        if alive(e.owner, e.owner_start):
            continue
        if kill_entry(e):
            killed.append(e)
            log.warning("reaped stale %s %d (%s) of dead owner %d", e.kind, e.pid, e.label, e.owner)
        _file(e).unlink(missing_ok=True)
    return killed


def wait_gone(pids: list[int], timeout: float, starts: Mapping[int, float] | None = None) -> list[int]:
    """Wait until none of ``pids`` runs; return those still running at the deadline.

    ``starts`` (pid -> start time, :func:`start_time`) tells a process apart from a later one that
    reused its pid: that one does not count as running.
    """
    starts = starts or {}
    deadline = Deadline(timeout)
    left = [p for p in pids if alive(p, starts.get(p))]
    while left and not deadline.expired():
        deadline.sleep(0.05)
        left = [p for p in left if alive(p, starts.get(p))]
    return left


#: Seconds an interrupted command has to stop what it started (a rerun-test stops its groups and their
#: servers) before its process group is killed.
INTERRUPT_GRACE_S = 60.0


def run_logged(
    cmd: Sequence[str], *, cwd: str | Path, env: Mapping[str, str], log: Path, timeout_s: float | None
) -> tuple[int, bool]:
    """Run ``cmd`` in a session of its own, stdout and stderr into ``log``; past ``timeout_s`` kill
    its whole process group (it and everything it started, nothing else). Interrupted (``^C`` reaches
    only this process: the command has a session of its own), hand the interrupt on to the command,
    give it :data:`INTERRUPT_GRACE_S` to stop, kill its group, and re-raise.

    Returns:
        ``(exit status, timed out)``; a killed run's status is ``-SIGKILL``.
    """
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            list(cmd), cwd=cwd, env=dict(env), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return -signal.SIGKILL, True
        except BaseException:
            for sig, grace_s in ((signal.SIGINT, INTERRUPT_GRACE_S), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=grace_s)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
            raise
