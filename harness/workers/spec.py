"""What a worker runs and how to tell it is ready: the spec a caller builds, and what a started worker
reports back.

A payload is either :class:`InProcess` (an object built inside the actor) or :class:`Subprocess` (a
command, a server, run by the actor in its own process group); readiness is a tuple of checks
(:class:`HttpCheck`, :class:`PortCheck`, :class:`CallCheck`). A worker that dies is
:class:`WorkerDied`, carrying its name, the cause and the tail of its log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Union

from harness.rundir import RunDir

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

TAIL_LINES = 50


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


@dataclass(frozen=True)
class InProcess:
    """An object built inside the actor: ``cls(*args, **kwargs)``."""

    cls: Union[type, str]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Subprocess:
    """A command run by the actor in its own process group. ``{port}`` placeholders are filled.

    ``env`` is laid over the worker's own environment; its ``PYTHONPATH`` goes in front of the
    worker's, whose entries the command still gets after it: what the worker's node put there (a
    joined cluster's node: the copies Ray unpacked, the sglang target its setup selected) stays
    on the command's path even when ``env`` was built on the driver, from the driver's.

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
        return RunDir(Path(self.run_dir)).worker_log(self.name)


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
    payload_start: float | None = None


@dataclass(frozen=True)
class WorkerContext:
    """Inside a worker: who am I. Returned by :func:`current`."""

    name: str
    gpu_ids: tuple[int, ...]
    ports: dict
    log_path: str
    run_dir: str


class PlacementBundles(Protocol):
    """What a worker needs of the placement group it starts in: the Ray group and its bundles, one
    per rank (:class:`harness.cluster.GroupPlacement` is one)."""

    @property
    def pg(self) -> "PlacementGroup": ...

    @property
    def bundles(self) -> tuple[dict[str, float], ...]: ...


class RolePlacement(Protocol):
    """A topology's placement as a server stack reads it: the groups of each role
    (:class:`harness.cluster.Placement` is one)."""

    def of(self, role: str) -> tuple[PlacementBundles, ...]: ...
