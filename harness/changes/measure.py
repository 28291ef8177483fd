"""One run's measurement of the target's ``sglang/`` lines, in every process the run starts.

coverage.py starts itself in every interpreter whose environment names a configuration, so every process
of the run is measured from its first line (forks and ``os._exit`` included; fork servers are off). Lines
carry ``<group>|<test>`` or ``<group>`` as their context; the data is combined and mapped back to the
target's files. How, and why symlinks need mapping: docs/modules.md.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: coverage.py's start-up variable (read by its ``.pth`` in every interpreter of the venv).
START_ENV = "COVERAGE_PROCESS_START"
#: Set (to the measurement's directory) in every process of a measured run.
DIR_ENV = "HARNESS_COVERAGE_DIR"
#: The one fork-start switch (:mod:`harness.workers.forkserver.policy`); named here, not imported: this
#: layer sits below the workers.
FORK_OFF = {"HARNESS_FORK_START": "0"}
PLUGIN = "harness.changes.startmark"
_PID = re.compile(r"\.pid(\d+)\.")


def running() -> Any:
    """This process's running coverage.py measurement in a measured run (``None`` otherwise)."""
    if not os.environ.get(DIR_ENV):
        return None
    try:
        import coverage
    except ImportError:
        return None
    return coverage.Coverage.current()


def save_running(partial: bool = False) -> None:
    """Save this process's measurement now, when it runs one (a process about to be killed without a
    chance to save: a Ray actor before ``ray.kill``, a server's scheduler, which its parent SIGKILLs).
    Saving again later adds to the same data file.

    Args:
        partial: the process goes on running after this save and may be killed before the next one (a
            scheduler saves at each cache flush): it is reported as partly measured, so what it ran after
            its last save reads as unknown, not as not executed.
    """
    cov = running()
    if cov is not None:
        cov.save()
        if partial:
            procs = Path(os.environ[DIR_ENV]) / "procs"
            procs.mkdir(parents=True, exist_ok=True)
            (procs / f"{os.getpid()}.partial").touch()


def trace_this_thread() -> None:
    """Measure the calling thread too, in a measured run, when Python's ``threading`` did not start it.

    coverage.py measures the threads ``threading`` starts through the hook it gives each new thread
    (``threading.settrace``); a thread started by native code never runs that hook. A Ray actor with
    concurrency groups runs its methods on such threads, so a rank's sglang calls there went unmeasured.
    This installs the same hook on the calling thread (``threading.gettrace``), as a ``threading``
    thread's bootstrap does: what the thread calls from here on is measured."""
    if not os.environ.get(DIR_ENV) or sys.gettrace() is not None:
        return
    hook = threading.gettrace()
    if hook is not None:
        sys.settrace(hook)


def _quiet_warnings() -> str:
    # A Ray worker or a server helper that never imports sglang is normal here, not a warning.
    return "module-not-imported, no-data-collected, module-not-measured, module-not-python"


@dataclass(frozen=True)
class Process:
    """One process the measurement started in."""

    pid: int
    argv: tuple[str, ...]
    measured: bool
    #: It saved early and went on running (:func:`save_running` ``partial``): what it ran after its last
    #: save is unknown.
    partial: bool = False

    def what(self) -> str:
        """A short name: ``python -m sglang.launch_server``, ``default_worker.py``, ``pytest``."""
        argv = list(self.argv)
        if "-m" in argv[:2] and len(argv) > argv.index("-m") + 1:
            return f"python -m {argv[argv.index('-m') + 1]}"
        first = Path(argv[0]).name if argv and argv[0] else "python"
        return {"-c": "python -c …"}.get(first, first)


@dataclass
class Combined:
    """The measurement read back: what ran, per file of the target (``sglang/...``) and per context."""

    #: ``sglang/...`` -> line -> the contexts that executed it.
    lines: dict[str, dict[int, set[str]]] = field(default_factory=dict)
    #: ``sglang/...`` -> the executable lines (coverage.py's statements) of the target's file.
    statements: dict[str, set[int]] = field(default_factory=dict)
    processes: list[Process] = field(default_factory=list)

    @property
    def unmeasured(self) -> list[Process]:
        """Processes that started measuring and left no data (killed by SIGKILL, or died hard)."""
        return [p for p in self.processes if not p.measured]

    @property
    def partial(self) -> list[Process]:
        """Processes measured up to their last early save only (a server's scheduler)."""
        return [p for p in self.processes if p.measured and p.partial]


class Measurement:
    """The measurement of one run under ``out`` (``<run>/coverage``): configurations, data, processes.

    Args:
        out: the directory (created).
        root: the target's tree (the directory holding ``sglang/``); measured files map onto it.
    """

    def __init__(self, out: Path, root: Path) -> None:
        self.out, self.root = Path(out), Path(root).resolve()
        self.data_dir, self.procs_dir = self.out / "data", self.out / "procs"

    def rcfile(self, context: str) -> Path:
        """Write (and return) the configuration of the processes of ``context`` (a group's name)."""
        if not re.fullmatch(r"[\w.\-]+", context):
            raise ValueError(f"coverage context {context!r}: use letters, digits, '.', '-' or '_'")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        rc = self.out / "rc" / f"{context}.ini"
        rc.parent.mkdir(parents=True, exist_ok=True)
        rc.write_text(
            "[run]\n"
            f"data_file = {self.data_dir / '.coverage'}\n"
            "parallel = true\n"
            "source_pkgs = sglang\n"
            "sigterm = true\n"
            "patch = fork, _exit\n"
            f"context = {context}\n"
            f"plugins = {PLUGIN}\n"
            f"disable_warnings = {_quiet_warnings()}\n"
            f"\n[{PLUGIN}]\n"
            f"dir = {self.procs_dir}\n",
            encoding="utf-8",
        )
        return rc

    def env(self, context: str) -> dict[str, str]:
        """The variables a process of ``context`` (and everything it starts) is measured with."""
        return {START_ENV: str(self.rcfile(context)), DIR_ENV: str(self.out), **FORK_OFF}

    def _combine_rc(self) -> Path:
        rc = self.out / "rc" / "combine.ini"
        rc.parent.mkdir(parents=True, exist_ok=True)
        rc.write_text(f"[run]\nsource_pkgs = sglang\ndisable_warnings = {_quiet_warnings()}\n", encoding="utf-8")
        return rc

    def combine(self) -> Combined:
        """Combine every process's data (kept on disk) and read it back onto the target's files."""
        import coverage

        out = Combined()
        partial = {int(p.stem) for p in self.procs_dir.glob("[0-9]*.partial")}
        files = sorted(self.data_dir.glob(".coverage.*"))
        pids_with_data = {int(m.group(1)) for p in files if (m := _PID.search(p.name))}
        for marker in sorted(self.procs_dir.glob("[0-9]*.json")):
            try:
                rec: dict[str, Any] = json.loads(marker.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            pid = int(rec.get("pid", 0))
            out.processes.append(Process(pid, tuple(rec.get("argv") or ()), pid in pids_with_data, pid in partial))
        # A process that saved data before its record was due (a short fork) was measured all the same.
        recorded = {p.pid for p in out.processes}
        out.processes += [Process(pid, (), True, pid in partial) for pid in sorted(pids_with_data - recorded)]
        if not pids_with_data:
            return out
        cov = coverage.Coverage(data_file=str(self.out / "combined.coverage"), config_file=str(self._combine_rc()))
        cov.combine([str(p) for p in files], keep=True)
        cov.save()
        data = cov.get_data()
        index = self._index()
        for name in data.measured_files():
            rel = index.get(name) or index.get(os.path.realpath(name))
            if rel is None:
                continue
            by_line = data.contexts_by_lineno(name)
            out.lines[rel] = {line: set(ctx) for line, ctx in by_line.items()}
        return out

    def _index(self) -> dict[str, str]:
        """Every file of the target's package by its path and its resolved path -> ``sglang/...``."""
        index: dict[str, str] = {}
        for top, _dirs, names in os.walk(self.root / "sglang", followlinks=True):
            if top.endswith("__pycache__"):
                continue
            for n in names:
                if n.endswith(".py"):
                    path = os.path.join(top, n)
                    rel = os.path.relpath(path, self.root)
                    index[path] = rel
                    index.setdefault(os.path.realpath(path), rel)
        return index

    def statements(self, rel: str) -> set[int]:
        """The executable lines of the target's ``rel`` (coverage.py's own parse of the file)."""
        import coverage

        cov = coverage.Coverage(data_file=None, config_file=False)
        _, stmts, _, _, _ = cov.analysis2(str(self.root / rel))
        return set(stmts)
