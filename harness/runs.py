"""Runs a person can find: what each run under ``runs/`` was, ``runs/latest``, and how many are kept.

Every command that makes a run directory records it with :func:`record` (a ``run.json``); when a run ends,
``runs/latest`` points at it and the runs beyond the newest :data:`DEFAULT_KEEP` are removed (:func:`prune`,
``HARNESS_KEEP_RUNS``). ``harness runs`` lists them (:func:`scan`). Stdlib only: the bot side reads it on a
bare interpreter. What is recorded and what is never removed: docs/modules.md.

>>> import tempfile
>>> base = Path(tempfile.mkdtemp()) / "runs"
>>> with record(base / "20261201-120000-1", ["rerun-test", "suites/a.py"], target="sglang 0.5.23") as run:
...     run.finish("passed", report=base / "20261201-120000-1" / "report" / "index.html")
>>> [(r.name, r.state, r.command) for r in scan(base)], os.readlink(base / LATEST)
([('20261201-120000-1', 'passed', 'rerun-test suites/a.py')], '20261201-120000-1')
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

from harness.rundir import DEFAULT_BASE

RUN_FILE = "run.json"
LATEST = "latest"
#: Runs kept under ``runs/`` by default (the newest; see the module docstring for what is never removed).
DEFAULT_KEEP = 30
KEEP_ENV = "HARNESS_KEEP_RUNS"
#: Directories under ``runs/`` that are never removed, whatever their age.
PROTECTED = ("ci", LATEST)
#: A directory without ``run.json`` this recent may still be being written.
UNRECORDED_GRACE_S = 3600.0
#: The file that marks a runs base the harness created: only there are directories without ``run.json``
#: ever removed, and only there does a run that ends prune its siblings (a folder merely named ``runs``
#: may hold a person's own directories).
BASE_MARKER = ".pd-harness-runs"
STATES = ("running", "passed", "failed", "error")


@dataclass(frozen=True)
class RunInfo:
    """One run as ``run.json`` records it (a directory without one is ``unknown``, dated by its mtime).

    Attributes:
        path: the run directory.
        started: when it started (epoch seconds); ``ended``: when it ended (None: running or unknown).
        command: the command line, as typed.
        target: the sglang target's label (``""``: none selected).
        state: one of :data:`STATES`, or ``unknown``.
        report: the report's path (``""``: none written).
        pid, host: the process that ran it (to tell a live run from one that died).
        source: the run or bundle it reran (``rerun-test --from``), if any.
    """

    path: Path
    started: float
    command: str = ""
    target: str = ""
    state: str = "unknown"
    report: str = ""
    ended: float | None = None
    pid: int = 0
    host: str = ""
    source: str = ""

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def recorded(self) -> bool:
        return (self.path / RUN_FILE).is_file()

    def alive(self) -> bool:
        """Still in progress: recorded as running by a process of this host that is still there."""
        if self.state != "running":
            return False
        if self.host and self.host != socket.gethostname():
            return True  # another machine's run on a shared disk: not ours to judge
        return pid_alive(self.pid)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` is there (one of another user counts: it exists)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def keep_count(env: dict[str, str] | None = None) -> int:
    """N, the runs kept: ``HARNESS_KEEP_RUNS`` (a whole number ≥ 0; 0 keeps all), else :data:`DEFAULT_KEEP`.

    Raises:
        ValueError: the variable is set to something else (one line: what, and what to set).
    """
    value = (os.environ if env is None else env).get(KEEP_ENV, "").strip()
    if not value:
        return DEFAULT_KEEP
    if not value.isdigit():
        raise ValueError(f"{KEEP_ENV}={value!r}: not a whole number; set it to the number of runs to keep (0: all)")
    return int(value)


class Recording:
    """A run being recorded: :meth:`finish` says how it ended, :meth:`end` closes it (see :func:`record`,
    or :func:`begin` for a run whose start and end are in different places)."""

    def __init__(self, info: RunInfo, base: Path | None = None):
        self.info = info
        self.base = base
        self._ended = False

    def end(self, state: str = "passed", report: str | Path | None = None) -> None:
        """Finish the run as ``state`` unless it already said how it ended, then point ``latest`` at it
        and apply the retention."""
        if not self._ended:
            self.finish(state, report)
        if self.info.path.exists():
            _ended(self.info.path, self.base)

    def finish(self, state: str, report: str | Path | None = None) -> None:
        """Record how the run ended (``passed`` / ``failed`` / ``error``) and its report."""
        if state not in STATES[1:]:
            raise ValueError(f"unknown run state {state!r}; use one of {', '.join(STATES[1:])}")
        self.info = RunInfo(
            **{
                **asdict(self.info),
                "state": state,
                "ended": time.time(),
                "report": str(report) if report else self.info.report,
            }
        )
        _write(self.info)
        self._ended = True


@contextmanager
def record(
    run_dir: str | Path,
    command: Sequence[str],
    *,
    target: str = "",
    source: str = "",
    base: Path | None = None,
    refused: tuple[type[BaseException], ...] = (),
) -> Iterator[Recording]:
    """Record a run in ``run_dir`` (created) while the block runs; when it ends, point ``latest`` at it
    and apply the retention (both only for a run directly under ``base``, default the directory's parent
    when that is ``runs/``).

    The block calls :meth:`Recording.finish`; a block that leaves without it is recorded ``error``
    (an exception, Ctrl-C) or ``passed`` (it returned).

    Args:
        run_dir: the run's directory.
        command: the command line (``sys.argv``-like).
        target: the sglang target's label.
        source: what the run reruns (a repro bundle), if anything.
        refused: exceptions that mean the run was refused before it started (bad input): the block
            raising one leaves no run directory behind (when this call made it).
        base: the runs directory the run belongs to (``latest`` and retention); default: the run
            directory's parent if it is named ``runs``, else none (a run elsewhere is only recorded).
    """
    made = not Path(run_dir).exists()
    rec = begin(run_dir, command, target=target, source=source, base=base)
    try:
        yield rec
    except refused:
        if made:  # refused before it started: nothing of it stays
            shutil.rmtree(rec.info.path, ignore_errors=True)
            raise
        rec.end("error")
        raise
    except BaseException:
        rec.end("error")
        raise
    rec.end("passed")


def begin(
    run_dir: str | Path, command: Sequence[str], *, target: str = "", source: str = "", base: Path | None = None
) -> Recording:
    """Start recording a run in ``run_dir`` (created): ``run.json`` says it is running. The caller
    ends it with :meth:`Recording.end` (see :func:`record` for the arguments)."""
    root = Path(run_dir).resolve()
    made_base = not root.parent.exists()
    root.mkdir(parents=True, exist_ok=True)
    if (
        made_base
        or root.parent == Path(DEFAULT_BASE).resolve()
        or (base is not None and Path(base).resolve() == root.parent)
    ):
        mark_base(root.parent)
    words = [Path(command[0]).name, *command[1:]] if command else []
    rec = Recording(
        RunInfo(
            path=root,
            started=time.time(),
            command=shlex.join(words),
            target=target,
            state="running",
            pid=os.getpid(),
            host=socket.gethostname(),
            source=str(source),
        ),
        base,
    )
    _write(rec.info)
    return rec


def mark_base(base: Path) -> None:
    """Mark ``base`` as a runs base the harness owns (:data:`BASE_MARKER`)."""
    marker = Path(base) / BASE_MARKER
    if not marker.is_file():
        marker.write_text("runs of pd-harness: retention may remove old runs here\n", encoding="utf-8")


def is_marked(base: Path) -> bool:
    """Whether the harness owns ``base``: it holds :data:`BASE_MARKER`, or it is the repository's own ``runs/``
    (which may predate the marker)."""
    return (Path(base) / BASE_MARKER).is_file() or Path(base).resolve() == Path(DEFAULT_BASE).resolve()


def _ended(root: Path, base: Path | None) -> None:
    """A run ended: ``latest`` points at it and the retention applies (for a run directly under a base the
    harness owns: one it was given, or one holding :data:`BASE_MARKER`)."""
    runs_base = Path(base).resolve() if base is not None else (root.parent if is_marked(root.parent) else None)
    if runs_base is None or root.parent != runs_base:
        return
    point_latest(runs_base, root)
    try:
        prune(runs_base, keep_count())
    except (ValueError, OSError):
        pass  # retention is housekeeping: a bad setting is said by `harness runs`; it never fails a run


def _write(info: RunInfo) -> None:
    data = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(info).items() if k != "path"}
    tmp = info.path / f".{RUN_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, info.path / RUN_FILE)


def read(run_dir: Path) -> RunInfo:
    """The run in ``run_dir``: its ``run.json``, or ``unknown`` dated by the directory's mtime."""
    run_dir = Path(run_dir)
    try:
        data = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
        fields = {k: data[k] for k in RunInfo.__dataclass_fields__ if k in data and k != "path"}
        return RunInfo(path=run_dir, **fields)
    except (OSError, ValueError, TypeError):
        try:
            mtime = run_dir.stat().st_mtime
        except OSError:
            mtime = 0.0
        report = run_dir / "report" / "index.html"
        return RunInfo(path=run_dir, started=mtime, report=str(report) if report.is_file() else "")


def point_latest(base: Path, run_dir: Path) -> Path:
    """Point ``<base>/latest`` at ``run_dir`` (a relative link, swapped in with one rename, so a reader
    never sees it missing)."""
    link = Path(base) / LATEST
    tmp = Path(base) / f".{LATEST}.{os.getpid()}"
    target = os.path.relpath(run_dir, base)
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)
    return link


def scan(base: Path = DEFAULT_BASE) -> list[RunInfo]:
    """The runs under ``base``, newest first (``latest`` and hidden entries left out)."""
    base = Path(base)
    if not base.is_dir():
        return []
    runs = [
        read(p)
        for p in base.iterdir()
        if p.is_dir() and not p.is_symlink() and not p.name.startswith(".") and p.name != LATEST
    ]
    return sorted(runs, key=lambda r: (r.started, r.name), reverse=True)


def kept_because(run: RunInfo, runs: Sequence[RunInfo], now: float | None = None) -> str:
    """Why retention never removes ``run`` (``""``: it may be removed when it is old enough)."""
    now = time.time() if now is None else now
    if run.name in PROTECTED:
        return f"runs/{run.name} is never removed"
    if run.alive():
        return "in progress"
    latest = run.path.parent / LATEST
    if latest.is_symlink() and latest.resolve() == run.path.resolve():
        return "runs/latest points at it"
    if not run.recorded and not is_marked(run.path.parent):
        return "not recorded, in a folder the harness did not create"
    if not run.recorded and now - run.started < UNRECORDED_GRACE_S:
        return "not recorded and changed in the last hour"
    if next(run.path.glob("**/repro.json"), None) is not None:
        return "holds a repro bundle"
    for other in runs:
        if other.source and other.path != run.path and _inside(Path(other.source), run.path):
            return f"{other.name} reran it"
    return ""


def _inside(path: Path, directory: Path) -> bool:
    try:
        path.resolve().relative_to(directory.resolve())
    except ValueError:
        return False
    return True


def prune(base: Path, keep: int) -> list[Path]:
    """Remove the runs under ``base`` beyond the newest ``keep`` (0: keep all), except those
    :func:`kept_because` names; returns what was removed."""
    if keep <= 0:
        return []
    runs = scan(base)
    removed = []
    for run in runs[keep:]:
        if kept_because(run, runs):
            continue
        shutil.rmtree(run.path, ignore_errors=True)
        removed.append(run.path)
    return removed
