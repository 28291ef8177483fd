"""Workers: one Ray actor per rank that owns its payload from start to reap (Dynamo's lifecycle, made small).

A payload is either

* :class:`InProcess` — an object built inside the actor (``cls(*args, **kwargs)``; ``cls`` may be a
  class or an import string ``"pkg.mod:Class"`` so the driver need not import it); its methods are
  called remotely with :meth:`Worker.call`; or
* :class:`Subprocess` — a command (a server) started by the actor in its own process group, with
  stdout+stderr (its children's too) written to the worker's log file.

Every worker has a log file ``<run_dir>/workers/<name>.log`` (the actor's own stdout/stderr go there
too), ports chosen by the OS and reported back (named in :attr:`WorkerSpec.ports`; ``{name}``
placeholders in a subprocess's argv/env and in check URLs are replaced by them; no port is handed
out twice in one run directory), ``CUDA_VISIBLE_DEVICES`` set from the GPU ids Ray assigned (they
may be non-contiguous, e.g. ``"1,3"``), and a readiness deadline during which every poll first
checks that the actor and its subprocess are alive. A worker that dies raises
:class:`WorkerDied` (name, cause, last 50 log lines; a lost node is named in the cause) — from :meth:`Worker.wait_ready`,
:meth:`Worker.call`, :meth:`Worker.check`, and, while a pytest test runs, from the test itself
(the plugin arms a :class:`Watchdog`). Stop is graceful: SIGTERM to the process group, a bounded
wait, SIGKILL; then the actor is killed.

API::

    WorkerSpec(name, payload, *, run_dir, ports=(), ready=(), ready_timeout=120.0, env={},
               num_cpus=0.1, stop_grace=5.0, runtime_env=None)
    InProcess(cls, args=(), kwargs={})                 # cls: class or "module:Class"
    Subprocess(argv, env={}, cwd=None)                 # argv items may contain "{port_name}"
    HttpCheck(url, status=200) | PortCheck(port) | CallCheck(method)   # readiness checks
    start_worker(spec, group=None, bundle_index=0, timeout=None) -> Worker   # started and ready
    Probe                            # a ready-made in-process payload: context(), env(name), pid(), echo(x)
    worker.call(method, *args, timeout=60.0, **kwargs) -> Any               # in-process payloads
    worker.info -> WorkerInfo(name, node_id, hostname, pid, gpu_ids, cuda_visible_devices,
                              ports, log_path, payload_pid)
    worker.ports["http"], worker.url("http")                                # "http://127.0.0.1:PORT"
    worker.poll() -> str | None      # None while alive, else the cause
    worker.check()                   # raises WorkerDied
    worker.tail(n=50) -> str
    worker.stop(grace=None)          # idempotent; kills the whole process group
    worker.node -> NodeRef | None    # the Ray node it runs on (label, raylet address)
    current() -> WorkerContext       # inside an in-process payload: name, gpu_ids, ports, log_path

Example (an in-process payload, and a server subprocess)::

    from harness.workers import InProcess, Subprocess, HttpCheck, WorkerSpec, start_worker

    placement = cluster.place(topo)
    g = placement.of("decode")[0]
    dec = start_worker(WorkerSpec("decode-0", InProcess("harness.targets.sglang.decode:DecodeSide",
                                  kwargs={"page_size": 64}), run_dir=run_dir), g)
    dec.call("prealloc", rid="r1", fill_len=300)      # runs in the actor, returns the result

    srv = start_worker(WorkerSpec(
        "prefill-0",
        Subprocess(("python", "-m", "sglang.launch_server", "--port", "{http}",
                    "--disaggregation-bootstrap-port", "{bootstrap}", ...)),
        run_dir=run_dir, ports=("http", "bootstrap"),
        ready=(HttpCheck("http://127.0.0.1:{http}/health"),), ready_timeout=120),
        placement.of("prefill")[0])
    requests.get(srv.url("http") + "/get_model_info")
    srv.stop()
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Union

from harness.workers import procs
from harness.workers.ports import allocate_ports
from harness.clock import DEFAULT as DEFAULT_CLOCK
from harness.clock import Clock
from harness.workers.nodes import NodeRef, node_of, raylet_answers

log = logging.getLogger(__name__)

TAIL_LINES = 50
_POLL_S = 0.1
_CONTROL_TIMEOUT_S = 10.0  # any control RPC (poll, info, stop) answers within this or the actor is wedged


class WorkerDied(RuntimeError):
    """A worker (its actor or its subprocess) died. Carries the name, the cause and the log tail."""

    def __init__(self, name: str, cause: str, tail: str, log_path: str | Path | None = None):
        self.name = name
        self.cause = cause
        self.tail = tail
        self.log_path = str(log_path) if log_path else None
        lines = tail.rstrip("\n")
        where = f" ({self.log_path})" if self.log_path else ""
        super().__init__(f"worker {name} died: {cause}\n--- last {TAIL_LINES} lines of its log{where} ---\n{lines}")

    def __reduce__(self):
        return (WorkerDied, (self.name, self.cause, self.tail, self.log_path))


class WorkerStartError(RuntimeError):
    """A worker did not become ready in time (it was stopped again)."""


# ------------------------------------------------------------------ spec


@dataclass(frozen=True)
class InProcess:
    """An object built inside the actor: ``cls(*args, **kwargs)``."""

    cls: Union[type, str]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Subprocess:
    """A command run by the actor in its own process group. ``{port}`` placeholders are filled.

    ``fatal``: text that, on a line of the worker's log, means the payload no longer works though
    its process runs (a thread it cannot serve without died): the worker is dead from then on, as if
    the process had exited.
    """

    argv: tuple[str, ...]
    env: dict = field(default_factory=dict)
    cwd: str | None = None
    fatal: tuple[str, ...] = ()


@dataclass(frozen=True)
class HttpCheck:
    """Ready when GET ``url`` (placeholders filled, run on the worker's node) answers ``status``."""

    url: str
    status: int = 200


@dataclass(frozen=True)
class PortCheck:
    """Ready when something accepts TCP connections on the named port on the worker's node."""

    port: str
    host: str = "127.0.0.1"


@dataclass(frozen=True)
class CallCheck:
    """Ready when the in-process payload's ``method()`` returns something truthy."""

    method: str


Check = Union[HttpCheck, PortCheck, CallCheck]


@dataclass(frozen=True)
class WorkerSpec:
    """What to run as one worker, and how to tell it is ready."""

    name: str
    payload: Union[InProcess, Subprocess]
    run_dir: str | Path
    ports: tuple[str, ...] = ()
    ready: tuple[Check, ...] = ()
    ready_timeout: float = 120.0
    env: dict = field(default_factory=dict)
    num_cpus: float = 0.1
    stop_grace: float = 5.0
    #: Ray ``runtime_env`` of the actor (e.g. :meth:`harness.workers.forkserver.ForkServer.runtime_env`).
    runtime_env: dict | None = None
    #: Functions (``"module:function"``) the actor calls first, in order, before it builds or starts
    #: its payload: what makes the worker's process import the run's engine under test on whichever
    #: node it runs (the sglang adapter's :func:`harness.targets.sglang.selection.worker_spec` adds its own).
    setup: tuple[str, ...] = ()

    @property
    def log_path(self) -> Path:
        return Path(self.run_dir) / "workers" / f"{self.name}.log"


@dataclass(frozen=True)
class WorkerInfo:
    """What a started worker reports back."""

    name: str
    node_id: str
    hostname: str
    pid: int
    gpu_ids: tuple[int, ...]
    cuda_visible_devices: str
    ports: dict
    log_path: str
    payload_pid: int | None = None
    payload_start: int | None = None


@dataclass(frozen=True)
class WorkerContext:
    """Inside a worker: who am I. Returned by :func:`current`."""

    name: str
    gpu_ids: tuple[int, ...]
    ports: dict
    log_path: str
    run_dir: str


_CURRENT: WorkerContext | None = None


def current() -> WorkerContext:
    """The context of the worker this code runs in (for in-process payloads).

    Raises:
        RuntimeError: not inside a harness worker.
    """
    if _CURRENT is None:
        raise RuntimeError("harness.workers.current() called outside a harness worker")
    return _CURRENT


class Probe:
    """A payload that reports where it runs (smoke suites, the overhead benchmark, tests)."""

    def context(self) -> WorkerContext:
        return current()

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def pid(self) -> int:
        return os.getpid()

    def echo(self, value: Any) -> Any:
        return value

    def module_file(self, name: str) -> str | None:
        """Where this process would import top-level module ``name`` from (None: nowhere); e.g.
        which sglang a worker runs, without importing it."""
        spec = importlib.util.find_spec(name)
        return spec.origin if spec is not None else None

    def say(self, text: str) -> None:
        """Print ``text`` (it lands in the worker's log)."""
        print(text, flush=True)

    def fail(self, message: str) -> None:
        raise ValueError(message)


# ------------------------------------------------------------------ helpers used inside the actor


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
        logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
        self.gpu_ids = tuple(int(g) for g in ray.get_gpu_ids())
        self.cuda = ",".join(str(g) for g in self.gpu_ids)
        os.environ["CUDA_VISIBLE_DEVICES"] = self.cuda
        self.ports = allocate_ports(spec.ports, spec.run_dir)
        self.proc: subprocess.Popen | None = None
        self.proc_start: int | None = None
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
        p = self.spec.payload
        if isinstance(p, InProcess):
            cls = _load(p.cls) if isinstance(p.cls, str) else p.cls
            self.obj = cls(*p.args, **p.kwargs)
        else:
            argv = [_fill(a, self.ports) for a in p.argv]
            env = {**os.environ, **{k: _fill(str(v), self.ports) for k, v in p.env.items()},
                   "CUDA_VISIBLE_DEVICES": self.cuda}
            # Noted before the start: once it runs, the payload owns the log (our line would land among its).
            self._note(f"exec {' '.join(argv)}")
            self._read_to = os.fstat(self._log_fd).st_size  # the payload's fatal lines are looked for in its own output
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log_fd, stderr=self._log_fd,
                                         env=env, cwd=p.cwd, start_new_session=True, preexec_fn=_pdeathsig)
            self.proc_start = procs.start_time(self.proc.pid)
            procs.register(self.proc.pid, kind="pgid", label=f"worker {self.spec.name} payload")
        return self.info()

    def info(self) -> WorkerInfo:
        import ray

        return WorkerInfo(
            name=self.spec.name, node_id=ray.get_runtime_context().get_node_id(), hostname=socket.gethostname(),
            pid=os.getpid(), gpu_ids=self.gpu_ids, cuda_visible_devices=self.cuda, ports=dict(self.ports),
            log_path=str(self.log_path), payload_pid=self.proc.pid if self.proc else None,
            payload_start=self.proc_start,
        )

    def poll(self) -> str | None:
        if self.proc is not None and not self.stopped:
            code = self.proc.poll()
            if code is not None:
                return f"subprocess pid {self.proc.pid} ({self.spec.payload.argv[0]}) {_exit_cause(code)}"
            if self._fatal is None:
                self._fatal = self._fatal_line()
            return self._fatal
        return None

    def _fatal_line(self) -> str | None:
        """The cause when a complete log line written since the last poll holds one of the payload's
        ``fatal`` texts."""
        fatal = self.spec.payload.fatal
        if not fatal:
            return None
        with open(self.log_path, "rb") as f:
            f.seek(self._read_to)
            new = f.read()
        complete = new[:new.rfind(b"\n") + 1]
        self._read_to += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if any(text in line for text in fatal):
                return f"its log says it no longer serves: {line.strip()[:300]}"
        return None

    def ready(self) -> bool:
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
        return getattr(self.obj, method)(*args, **kwargs)

    def tail(self, n: int) -> str:
        return tail_file(self.log_path, n)

    def stop(self, grace: float) -> str | None:
        """Close the payload; SIGTERM the subprocess group, wait ``grace``, SIGKILL. Returns a problem or None."""
        self.stopped = True
        problem = None
        if self.obj is not None and hasattr(self.obj, "close"):
            try:
                self.obj.close()
            except Exception as e:  # report, keep tearing down
                problem = f"payload close() raised {e!r}"
        if self.proc is not None:
            problem = _stop_group(self.proc.pid, self.proc_start, grace, self.proc) or problem
            procs.unregister(self.proc.pid, kind="pgid")
        sys.stdout.flush()
        sys.stderr.flush()
        return problem


def _stop_group(pgid: int, start: int | None, grace: float, proc: subprocess.Popen | None = None) -> str | None:
    """SIGTERM the process group ``pgid``, wait up to ``grace`` s for all members, then SIGKILL."""
    if not procs.group_members(pgid) and (proc is None or proc.poll() is not None):
        return None
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return None
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if proc is not None:
            proc.poll()  # reap the leader so it does not linger as a zombie
        if not procs.group_members(pgid):
            return None
        time.sleep(0.05)
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


def _remote_class() -> Any:
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


# ------------------------------------------------------------------ driver side


class Worker:
    """The driver's handle on one started worker. Build it with :func:`start_worker`."""

    def __init__(self, spec: WorkerSpec, actor: Any, clock: Clock = DEFAULT_CLOCK):
        self.spec = spec
        self.name = spec.name
        self.actor = actor
        self.info: WorkerInfo | None = None
        self._clock = clock
        self._dead: WorkerDied | None = None
        self._stopped = False
        self.node: NodeRef | None = None  # set once started
        self._node_lost = False

    # -- properties

    @property
    def ports(self) -> dict[str, int]:
        return dict(self.info.ports) if self.info else {}

    @property
    def gpu_ids(self) -> tuple[int, ...]:
        return self.info.gpu_ids if self.info else ()

    @property
    def log_path(self) -> Path:
        return self.spec.log_path

    def url(self, port: str, host: str = "127.0.0.1") -> str:
        """``http://host:PORT`` for a named port."""
        return f"http://{host}:{self.ports[port]}"

    # -- liveness

    def tail(self, n: int = TAIL_LINES) -> str:
        """The last ``n`` lines of the worker's log (read locally; through the actor if not local)."""
        text = tail_file(self.log_path, n)
        if text or self.log_path.exists():
            return text
        import ray

        try:
            return ray.get(self.actor.tail.remote(n), timeout=_CONTROL_TIMEOUT_S)
        except Exception as e:  # the actor is gone and the log is on another machine
            return f"(log not readable from here: {e.__class__.__name__})"

    def _died(self, cause: str) -> WorkerDied:
        if self._dead is None:
            self._dead = WorkerDied(self.name, cause, self.tail(), self.log_path)
        return self._dead

    def poll(self, timeout: float = _CONTROL_TIMEOUT_S) -> str | None:
        """None while the worker (actor and subprocess) is alive, else the cause of death."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self._dead is not None:
            return self._dead.cause
        if self._stopped:
            return None
        try:
            cause = ray.get(self.actor.poll.remote(), timeout=timeout)
        except RayActorError as e:
            cause = self._actor_error(e).cause
        except GetTimeoutError:
            return None  # busy, not dead: a wedged actor is caught by the call/readiness deadlines
        if cause:
            self._died(cause)
        return cause

    def node_lost(self, why: str) -> WorkerDied:
        """Record that the worker's node is gone (its actor and everything it ran died with it)."""
        self._node_lost = True
        return self._died(f"node lost: {self.node or 'its Ray node'} stopped answering ({why}); "
                          "every worker on it died with it")

    def _actor_error(self, e: Exception) -> WorkerDied:
        """The death behind a Ray actor error: the lost node when its raylet is gone, else the actor's own."""
        why = raylet_answers(self.node.ip, self.node.port) if self.node is not None else None
        if why is not None:
            return self.node_lost(f"raylet {why}")
        return self._died(_actor_cause(e))

    def check(self) -> None:
        """Raise :class:`WorkerDied` if the worker died."""
        cause = self.poll()
        if cause:
            raise self._died(cause)

    # -- lifecycle

    def wait_ready(self, timeout: float | None = None) -> WorkerInfo:
        """Wait for the readiness checks; every poll first checks liveness.

        Raises:
            WorkerDied: the worker died while starting.
            TimeoutError: not ready within ``timeout`` (default ``spec.ready_timeout``).
        """
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        budget = self.spec.ready_timeout if timeout is None else timeout
        deadline = self._clock.now() + budget
        while True:
            self.check()
            left = deadline - self._clock.now()
            try:
                if ray.get(self.actor.ready.remote(), timeout=max(0.1, min(left, _CONTROL_TIMEOUT_S))):
                    return self.info
            except RayActorError as e:
                raise self._actor_error(e) from None
            except GetTimeoutError:
                pass
            if self._clock.now() >= deadline:
                pid = f" (payload pid {self.info.payload_pid})" if self.info and self.info.payload_pid else ""
                raise TimeoutError(f"worker {self.name}: not ready after {budget:g} s{pid}\n--- last lines of its log ---\n{self.tail()}")
            self._clock.sleep(min(_POLL_S * 2, max(0.0, deadline - self._clock.now())))

    def call(self, method: str, *args: Any, timeout: float = 60.0, **kwargs: Any) -> Any:
        """Call ``method`` on the in-process payload, in the actor.

        Raises:
            WorkerDied: the actor died (before or during the call).
            TimeoutError: no answer within ``timeout``.
            Exception: whatever the payload method raised (as Ray's wrapped task error).
        """
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self._dead is not None:
            raise self._dead
        try:
            return ray.get(self.actor.call.remote(method, args, kwargs), timeout=timeout)
        except SystemError as e:
            # The plugin's fail-fast interrupt landed inside Ray's C code, which wraps it.
            if isinstance(e.__cause__, WorkerDied) or isinstance(e.__context__, WorkerDied):
                raise (e.__cause__ or e.__context__) from None
            raise
        except RayActorError as e:
            raise self._actor_error(e) from None
        except GetTimeoutError:
            cause = self.poll()
            if cause:
                raise self._died(cause) from None
            raise TimeoutError(f"worker {self.name}: {method}() did not return within {timeout:g} s") from None

    def stop(self, grace: float | None = None) -> None:
        """Stop the payload (SIGTERM, wait, SIGKILL of its process group), then kill the actor.

        Idempotent. If the actor is already dead, its subprocess group is killed from here when it
        runs on this machine.
        """
        if self._stopped:
            return
        self._stopped = True
        import ray

        g = self.spec.stop_grace if grace is None else grace
        try:
            if self._node_lost:  # nothing answers there: asking would only wait out the timeout
                raise RuntimeError(f"node lost: {self.node}")
            problem = ray.get(self.actor.stop.remote(g), timeout=g + _CONTROL_TIMEOUT_S)
            if problem:
                log.warning("worker %s: %s", self.name, problem)
        except Exception as e:  # dead or wedged actor: clean up its process group ourselves below
            log.debug("worker %s: stop through the actor failed: %r", self.name, e)
        info = self.info
        if info and info.payload_pid and info.hostname == socket.gethostname() and (
            procs.alive(info.payload_pid, info.payload_start) or procs.group_members(info.payload_pid)
        ):
            _stop_group(info.payload_pid, info.payload_start, min(g, 2.0))
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as e:  # already gone
            log.debug("worker %s: kill: %r", self.name, e)
        if info and info.hostname == socket.gethostname():
            procs.wait_gone([info.pid], 10.0)
            if info.payload_pid:
                procs.unregister(info.payload_pid, kind="pgid")
            procs.unregister(info.pid)

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Worker({self.name!r}, gpus={list(self.gpu_ids)}, ports={self.ports})"


def _actor_cause(e: Exception) -> str:
    """One line from Ray's actor-death error: its exit type and the first sentence of its detail."""
    text = " ".join(str(e).split())
    kind = re.search(r"Worker exit type: (\w+)", text)
    detail = re.search(r"Worker exit detail: (.*?\.)(?: |$)", text)
    pid = re.search(r"\bpid: (\d+)", text)
    parts = [f"pid {pid.group(1)}" if pid else "", f"exit type {kind.group(1)}" if kind else "",
             detail.group(1) if detail else ""]
    summary = "; ".join(p for p in parts if p)
    head = text.split(".")[0][:200] if text else e.__class__.__name__
    return f"actor died: {summary}" if summary else f"actor died: {head}"


def start_worker(spec: WorkerSpec, group: Any = None, bundle_index: int = 0, *, timeout: float | None = None,
                 clock: Clock = DEFAULT_CLOCK) -> Worker:
    """Start a worker actor in a placement-group bundle, start its payload and wait until it is ready.

    Args:
        spec: what to run.
        group: a :class:`harness.cluster.GroupPlacement` (or a raw Ray placement group); None runs
            the actor outside any placement group (no GPUs).
        bundle_index: which bundle (TP rank) of the group.
        timeout: readiness budget (default ``spec.ready_timeout``); also bounds actor creation.
        clock: the clock for the readiness wait.

    Returns:
        The ready :class:`Worker`.

    Raises:
        WorkerDied: the actor or its payload died while starting (the worker is stopped).
        TimeoutError: not ready in time (the worker is stopped).
    """
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    opts: dict[str, Any] = {"num_cpus": spec.num_cpus}
    if spec.runtime_env:
        opts["runtime_env"] = spec.runtime_env
    if group is not None:
        pg = getattr(group, "pg", group)
        bundles = getattr(group, "bundles", None) or pg.bundle_specs
        gpus = bundles[bundle_index].get("GPU", 0)
        if gpus:
            opts["num_gpus"] = gpus
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle_index)
    budget = spec.ready_timeout if timeout is None else timeout
    Path(spec.run_dir, "workers").mkdir(parents=True, exist_ok=True)
    actor = _remote_class().options(**opts).remote(spec, procs.owner_env())
    w = Worker(spec, actor, clock)
    try:
        try:
            w.info = ray.get(actor.start.remote(), timeout=budget)
        except RayActorError as e:
            raise w._actor_error(e) from None
        except RayTaskError as e:
            raise w._died(f"payload start raised: {str(e).strip().splitlines()[-1][:300]}") from None
        except GetTimeoutError:
            raise TimeoutError(f"worker {spec.name}: actor not started within {budget:g} s "
                               "(no room in its placement group bundle?)") from None
        w.wait_ready(budget)
        w.node = node_of(w.info.node_id)
    except BaseException:
        w.stop(grace=1.0)
        raise
    log.info("worker %s ready: gpus %s ports %s", spec.name, w.gpu_ids, w.ports)
    return w


# ------------------------------------------------------------------ fail-fast


class Watchdog:
    """Polls workers from a background thread; calls ``on_death(WorkerDied)`` once per dead worker.

    The pytest plugin uses it to fail the running test within ~2 s of a worker's death. Each round
    also knocks on the raylet of every node a watched worker runs on: a node whose raylet has not
    answered for ``node_grace`` seconds is lost, and every worker on it is reported dead with the
    node named (Ray itself says so only when its health check gives up, ~15 s later).
    """

    def __init__(self, on_death: Callable[[WorkerDied], None], interval: float = 0.25, node_grace: float = 1.0):
        self._on_death = on_death
        self._interval = interval
        self._node_grace = node_grace
        self._workers: list[Worker] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._silent_since: dict[str, float] = {}

    def add(self, worker: Worker) -> None:
        with self._lock:
            self._workers.append(worker)

    def remove(self, worker: Worker) -> None:
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)

    def start(self) -> "Watchdog":
        self._thread = threading.Thread(target=self._run, name="harness-watchdog", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _lost_nodes(self, workers: list[Worker]) -> dict[str, str]:
        """node id -> why, for the nodes of ``workers`` whose raylet stayed silent for ``node_grace``."""
        lost = {}
        nodes = {w.node.node_id: w.node for w in workers if w.node is not None and not w._stopped}
        for node_id, node in nodes.items():
            why = raylet_answers(node.ip, node.port)
            if why is None:
                self._silent_since.pop(node_id, None)
                continue
            since = self._silent_since.setdefault(node_id, time.monotonic())
            if time.monotonic() - since >= self._node_grace:
                lost[node_id] = f"raylet {why} for {time.monotonic() - since:.1f} s"
        return lost

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                workers = list(self._workers)
            lost = self._lost_nodes(workers)
            for w in workers:
                if w.node is not None and w.node.node_id in lost and not w._stopped:
                    self.remove(w)
                    self._on_death(w.node_lost(lost[w.node.node_id]))
            workers = [w for w in workers if not (w.node is not None and w.node.node_id in lost)]
            for w in workers:
                if w._stopped:
                    continue
                try:
                    cause = w.poll(timeout=2.0)
                except Exception as e:  # Ray gone during teardown
                    log.debug("watchdog poll %s: %r", w.name, e)
                    continue
                if cause:
                    self.remove(w)
                    self._on_death(w._died(cause))
