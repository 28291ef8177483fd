"""The worker actor: the Ray actor body that owns one payload from start to reap, inside its process.

It sets up the log, ports and GPUs, builds or starts the payload, answers the driver's liveness and readiness
polls from a concurrency group of their own, and stops the payload. :func:`current` tells an in-process
payload who it is. The class is made a Ray actor lazily (:func:`remote_class`), so importing this module
imports no Ray. The steps: docs/modules.md.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from harness.changes import measure
from harness.clock import Deadline
from harness.workers import procs
from harness.workers.ports import allocate_ports
from harness.workers.spec import (
    TAIL_LINES,
    CallCheck,
    HttpCheck,
    InProcess,
    PortCheck,
    Subprocess,
    WorkerContext,
    WorkerInfo,
    WorkerSpec,
)

_CURRENT: WorkerContext | None = None


def current() -> WorkerContext:
    """The context of the worker this code runs in (for in-process payloads).

    Raises:
        RuntimeError: not inside a harness worker.
    """
    if _CURRENT is None:
        raise RuntimeError("harness.workers.current() called outside a harness worker")
    return _CURRENT


def tail_file(path: str | Path, n: int = TAIL_LINES) -> str:
    """The last ``n`` lines of a file ("" if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            data = f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(data.splitlines()[-n:])


def _load(name: str) -> Any:
    """The object an import string ``"package.module:Attr"`` names."""
    mod, _, attr = name.partition(":")
    return getattr(importlib.import_module(mod), attr)


def _fill(text: str, ports: dict[str, int]) -> str:
    return text.format(**ports) if ports and "{" in text else text


def _pdeathsig() -> None:
    # The server dies with its actor even if the actor is SIGKILLed (its own children are reaped
    # through the process group by the driver or by the next run's stale cleanup).
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def paths_over(front: str, own: str) -> str:
    """The search path ``front`` followed by the entries of ``own`` it lacks (``os.pathsep``-separated).

    >>> paths_over("/site:/driver/tree", "/node/copy:/site")
    '/site:/driver/tree:/node/copy'
    """
    entries = [e for e in front.split(os.pathsep) if e]
    return os.pathsep.join([*entries, *(e for e in own.split(os.pathsep) if e and e not in entries)])


def _exit_cause(code: int) -> str:
    if code < 0:
        try:
            return f"exit code {code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


class _WorkerActor:
    """The actor body (made remote lazily so importing this module does not import Ray)."""

    def __init__(self, spec: WorkerSpec, owner_env: dict):
        global _CURRENT
        import ray

        os.environ.update(owner_env)
        measure.trace_this_thread()  # each method below, too: Ray runs them on threads of its own
        os.environ.update({k: str(v) for k, v in spec.env.items()})
        for hook in spec.setup:  # e.g. the run's sglang first on this actor's import path (any node)
            _load(hook)()
        self.spec = spec
        self.log_path = spec.log_path
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # The actor's own stdout/stderr (and any child's) go to the worker's log file.
        self._log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self._log_fd, 1)
        os.dup2(self._log_fd, 2)
        logging.basicConfig(
            stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
        )
        self.gpu_ids = tuple(int(g) for g in ray.get_gpu_ids())
        self.cuda = ",".join(str(g) for g in self.gpu_ids)
        os.environ["CUDA_VISIBLE_DEVICES"] = self.cuda
        self.ports = allocate_ports(spec.ports, spec.run_dir)
        self.proc: subprocess.Popen | None = None
        self.proc_start: float | None = None
        self.obj: Any = None
        self.stopped = False
        self._read_to = 0  # how far poll() has read the log for the payload's fatal lines
        self._fatal: str | None = None  # the fatal line's cause, once seen
        procs.register(os.getpid(), label=f"worker {spec.name}")
        _CURRENT = WorkerContext(spec.name, self.gpu_ids, dict(self.ports), str(self.log_path), str(spec.run_dir))
        self._note(f"worker {spec.name} pid {os.getpid()} gpus [{self.cuda}] ports {self.ports}")

    def _note(self, text: str) -> None:
        # The harness's own lines in the worker log, marked so they read apart from the payload's.
        os.write(self._log_fd, f"[harness] {text}\n".encode())

    def start(self) -> WorkerInfo:
        measure.trace_this_thread()
        p = self.spec.payload
        if isinstance(p, InProcess):
            cls = _load(p.cls) if isinstance(p.cls, str) else p.cls
            self.obj = cls(*p.args, **p.kwargs)
        else:
            argv = [_fill(a, self.ports) for a in p.argv]
            env = {
                **os.environ,
                **{k: _fill(str(v), self.ports) for k, v in p.env.items()},
                "CUDA_VISIBLE_DEVICES": self.cuda,
            }
            if "PYTHONPATH" in p.env:  # in front of this worker's own, which still follows (see Subprocess)
                env["PYTHONPATH"] = paths_over(env["PYTHONPATH"], os.environ.get("PYTHONPATH", ""))
            # Noted before the start: once it runs, the payload owns the log (our line would land among its).
            self._note(f"exec {' '.join(argv)}")
            self._read_to = os.fstat(self._log_fd).st_size  # the payload's fatal lines are looked for in its own output
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log_fd,
                stderr=self._log_fd,
                env=env,
                cwd=p.cwd,
                start_new_session=True,
                preexec_fn=_pdeathsig,
            )
            self.proc_start = procs.start_time(self.proc.pid)
            procs.register(self.proc.pid, kind="pgid", label=f"worker {self.spec.name} payload")
        return self.info()

    def info(self) -> WorkerInfo:
        import ray

        return WorkerInfo(
            name=self.spec.name,
            node_id=ray.get_runtime_context().get_node_id(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            gpu_ids=self.gpu_ids,
            cuda_visible_devices=self.cuda,
            ports=dict(self.ports),
            log_path=str(self.log_path),
            payload_pid=self.proc.pid if self.proc else None,
            payload_start=self.proc_start,
        )

    def poll(self) -> str | None:
        if self.proc is not None and not self.stopped:
            code = self.proc.poll()
            if code is not None:
                argv = self.spec.payload.argv if isinstance(self.spec.payload, Subprocess) else ("?",)
                return f"subprocess pid {self.proc.pid} ({argv[0]}) {_exit_cause(code)}"
            if self._fatal is None:
                self._fatal = self._fatal_line()
            return self._fatal
        return None

    def _fatal_line(self) -> str | None:
        """The cause when a complete log line written since the last poll holds one of the payload's
        ``fatal`` texts."""
        fatal = self.spec.payload.fatal if isinstance(self.spec.payload, Subprocess) else ()
        if not fatal:
            return None
        with open(self.log_path, "rb") as f:
            f.seek(self._read_to)
            new = f.read()
        complete = new[: new.rfind(b"\n") + 1]
        self._read_to += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if any(text in line for text in fatal):
                return f"its log says it no longer serves: {line.strip()[:300]}"
        return None

    def ready(self) -> bool:
        measure.trace_this_thread()
        for c in self.spec.ready:
            if isinstance(c, HttpCheck):
                try:
                    with urllib.request.urlopen(_fill(c.url, self.ports), timeout=2) as r:
                        if r.status != c.status:
                            return False
                except OSError:
                    return False
            elif isinstance(c, PortCheck):
                try:
                    socket.create_connection((c.host, self.ports[c.port]), timeout=1).close()
                except OSError:
                    return False
            elif isinstance(c, CallCheck):
                if not getattr(self.obj, c.method)():
                    return False
        return True

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        measure.trace_this_thread()
        return getattr(self.obj, method)(*args, **kwargs)

    def tail(self, n: int) -> str:
        return tail_file(self.log_path, n)

    def stop(self, grace: float) -> str | None:
        """Close the payload; SIGTERM the subprocess group, wait ``grace``, SIGKILL. Returns a problem or None."""
        self.stopped = True
        problem = None
        measure.trace_this_thread()
        if self.obj is not None and hasattr(self.obj, "close"):
            try:
                self.obj.close()
            except Exception as e:  # report, keep tearing down
                problem = f"payload close() raised {e!r}"
        if self.proc is not None:
            problem = stop_group(self.proc.pid, self.proc_start, grace, self.proc) or problem
            procs.unregister(self.proc.pid, kind="pgid")
        measure.save_running()  # ray.kill ends this process without exit handlers
        sys.stdout.flush()
        sys.stderr.flush()
        return problem


def stop_group(pgid: int, start: float | None, grace: float, proc: subprocess.Popen | None = None) -> str | None:
    """SIGTERM the process group ``pgid``, wait up to ``grace`` s for all members, then SIGKILL."""
    if not procs.group_members(pgid) and (proc is None or proc.poll() is not None):
        return None
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return None
    deadline = Deadline(grace)
    while not deadline.expired():
        if proc is not None:
            proc.poll()  # reap the leader so it does not linger as a zombie
        if not procs.group_members(pgid):
            return None
        deadline.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    if proc is not None:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return f"process group {pgid} survived SIGKILL"
    return f"process group {pgid} ignored SIGTERM for {grace:g} s (killed)"


_REMOTE: Any = None


def remote_class() -> Any:
    global _REMOTE
    if _REMOTE is None:
        import ray

        _REMOTE = ray.remote(
            max_restarts=0,
            concurrency_groups={"control": 4},
        )(_with_control_methods(_WorkerActor))
    return _REMOTE


def _with_control_methods(cls: type) -> type:
    # Control methods run in their own concurrency group so poll()/stop() answer while a long
    # payload call occupies the default group (which stays single-threaded for the payload).
    import ray

    for name in ("info", "poll", "ready", "tail", "stop"):
        setattr(cls, name, ray.method(concurrency_group="control")(getattr(cls, name)))
    return cls
