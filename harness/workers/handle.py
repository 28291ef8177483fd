"""The driver's handle on one started worker (:class:`Worker`) and :func:`start_worker`, which starts
the actor in its placement-group bundle, starts its payload and waits until it is ready
(:func:`launch_worker` starts it without the wait).

A worker that dies raises :class:`~harness.workers.spec.WorkerDied`; stop is graceful, then the actor is
killed. Detail: docs/modules.md. Over 400 lines: one object's start, readiness, watch and stop share its state.
"""

from __future__ import annotations

import logging
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.clock import DEFAULT as DEFAULT_CLOCK
from harness.clock import Clock
from harness.workers import procs
from harness.workers.actor import remote_class, stop_group, tail_file
from harness.workers.node_ref import NodeRef, node_of, raylet_answers
from harness.workers.spec import TAIL_LINES, PlacementBundles, WorkerDied, WorkerInfo, WorkerSpec

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

log = logging.getLogger(__name__)

_POLL_S = 0.1
_CONTROL_TIMEOUT_S = 10.0  # any control RPC (poll, info, stop) answers within this or the actor is wedged
#: The least time :func:`start_worker` gives the actor itself to start (Ray placing it and starting its process)
#: before the readiness wait: a short ``ready_timeout`` bounds the payload's readiness, not Ray's scheduling,
#: which took over 3 s on a 2-core runner under three test processes.
ACTOR_START_S = 30.0


class Worker:
    """The driver's handle on one started worker. Build it with :func:`start_worker`."""

    def __init__(self, spec: WorkerSpec, actor: "ActorHandle", clock: Clock = DEFAULT_CLOCK):
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
        return self._died(
            f"node lost: {self.node or 'its Ray node'} stopped answering ({why}); every worker on it died with it"
        )

    def _actor_error(self, e: Exception) -> WorkerDied:
        """The death behind a Ray actor error: the lost node when its raylet is gone, else the actor's own."""
        why = raylet_answers(self.node.ip, self.node.port) if self.node is not None else None
        if why is not None:
            return self.node_lost(f"raylet {why}")
        died = self._died(_actor_cause(e))
        _, remote = _creation_error(e)
        if remote and "(log not readable" in died.tail:  # the creation task's traceback is all there is
            self._dead = died = WorkerDied(died.name, died.cause, remote, died.log_path)
        return died

    def check(self) -> None:
        """Raise :class:`WorkerDied` if the worker died."""
        cause = self.poll()
        if cause:
            raise self._died(cause)

    # -- lifecycle

    def wait_ready(self, timeout: float | None = None) -> WorkerInfo:
        """Wait for the readiness checks; every poll first checks liveness.

        Raises:
            WorkerDied: the worker died, or was stopped, while starting.
            TimeoutError: not ready within ``timeout`` (default ``spec.ready_timeout``).
        """
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        budget = self.spec.ready_timeout if timeout is None else timeout
        deadline = self._clock.now() + budget
        while True:
            if self._stopped:  # by another thread (a stack whose other worker died while starting)
                raise self._stopped_while_starting()
            self.check()
            left = deadline - self._clock.now()
            try:
                if ray.get(self.actor.ready.remote(), timeout=max(0.1, min(left, _CONTROL_TIMEOUT_S))):
                    assert self.info is not None, "a worker is started before it is waited on"
                    return self.info
            except RayActorError as e:
                if self._stopped:  # its actor was killed by that stop, mid-call
                    raise self._stopped_while_starting() from None
                raise self._actor_error(e) from None
            except GetTimeoutError:
                pass
            if self._clock.now() >= deadline:
                pid = f" (payload pid {self.info.payload_pid})" if self.info and self.info.payload_pid else ""
                raise TimeoutError(
                    f"worker {self.name}: not ready after {budget:g} s{pid}\n"
                    f"--- last lines of its log ---\n{self.tail()}"
                )
            self._clock.sleep(min(_POLL_S * 2, max(0.0, deadline - self._clock.now())))

    def _stopped_while_starting(self) -> WorkerDied:
        return WorkerDied(self.name, "stopped before it was ready", self.tail(), self.log_path)

    def call(self, method: str, *args: Any, timeout: float = 60.0, **kwargs: Any) -> Any:
        """Call ``method`` on the in-process payload, in the actor.

        Raises:
            WorkerDied: the actor died (before or during the call).
            TimeoutError: no answer within ``timeout``.
            Exception: whatever the payload method raised, itself (:func:`payload_error`), not Ray's wrapper.
        """
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        if self._dead is not None:
            raise self._dead
        try:
            return ray.get(self.actor.call.remote(method, args, kwargs), timeout=timeout)
        except SystemError as e:
            # The plugin's fail-fast interrupt landed inside Ray's C code, which wraps it.
            died = next((c for c in (e.__cause__, e.__context__) if isinstance(c, WorkerDied)), None)
            if died is not None:
                raise died from None
            raise
        except RayActorError as e:
            raise self._actor_error(e) from None
        except RayTaskError as e:
            raise payload_error(e, self.name) from None
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
        if (
            info
            and info.payload_pid
            and info.hostname == socket.gethostname()
            and (procs.alive(info.payload_pid, info.payload_start) or procs.group_members(info.payload_pid))
        ):
            stop_group(info.payload_pid, info.payload_start, min(g, 2.0))
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


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def payload_error(e: Exception, worker: str = "") -> BaseException:
    """The exception a payload raised in its worker, out of Ray's ``RayTaskError`` wrapper.

    Ray hands a remote exception back as a wrapper whose text starts with its own colored header
    (``ray::_WorkerActor.call() (pid=…, actor_id=…, repr=<…>)``) and only then the cause. The cause
    itself is returned here, rebuilt by Ray, so a test sees what the payload raised (``pytest.raises``,
    messages and headlines name it), with where it was raised — the worker and the remote traceback,
    colours stripped — as a note. A wrapper whose cause Ray could not rebuild is returned as it is.

    Args:
        e: Ray's wrapper (any other exception is returned unchanged).
        worker: the worker's name, for the note.

    Returns:
        The payload's exception.
    """
    cause = getattr(e, "cause", None)
    if not isinstance(cause, BaseException) or cause is e:
        return e
    lines = _ANSI.sub("", str(e)).splitlines()
    remote = [ln for ln in lines[1:] if ln.strip()]  # the header line is Ray's, the rest its traceback
    if remote and hasattr(cause, "add_note"):
        where = f"worker {worker}" if worker else "a worker"
        cause.add_note(f"raised in {where}, remote traceback:\n" + "\n".join(remote[-40:]))
    return cause


_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Died|Lost|Broken)\b.*")


def _creation_error(e: Exception) -> tuple[str, str]:
    """When the actor died raising in its creation task: the exception's last line and the remote
    traceback (colours stripped); else ``("", "")``."""
    raw = _ANSI.sub("", str(e))
    if "error raised in its creation task" not in raw:
        return "", ""
    lines = [ln.rstrip() for ln in raw.splitlines() if ln.strip()]
    found = [ln.strip() for ln in lines[1:] if _EXC_LINE.match(ln.strip())]
    return (found[-1] if found else ""), "\n".join(lines[1:])


def _actor_cause(e: Exception) -> str:
    """One line from Ray's actor-death error: the exception its creation task raised, or its exit type
    and the first sentence of its detail."""
    raised, _ = _creation_error(e)
    if raised:
        return f"actor died in its creation task: {raised[:300]}"
    text = " ".join(str(e).split())
    kind = re.search(r"Worker exit type: (\w+)", text)
    detail = re.search(r"Worker exit detail: (.*?\.)(?: |$)", text)
    pid = re.search(r"\bpid: (\d+)", text)
    parts = [
        f"pid {pid.group(1)}" if pid else "",
        f"exit type {kind.group(1)}" if kind else "",
        detail.group(1) if detail else "",
    ]
    summary = "; ".join(p for p in parts if p)
    head = text.split(".")[0][:200] if text else e.__class__.__name__
    return f"actor died: {summary}" if summary else f"actor died: {head}"


def launch_worker(
    spec: WorkerSpec,
    group: "PlacementBundles | PlacementGroup | None" = None,
    bundle_index: int = 0,
    *,
    timeout: float | None = None,
    clock: Clock = DEFAULT_CLOCK,
) -> Worker:
    """Start a worker actor in a placement-group bundle and start its payload, without waiting for
    its readiness checks: its ports are leased and known (``worker.ports``, ``worker.url``), so a
    process that only needs its address (a PD router) can start while it is still coming up.
    :meth:`Worker.wait_ready` then waits for it; :func:`start_worker` does both.

    Args:
        spec: what to run.
        group: a :class:`harness.cluster.GroupPlacement` (any :class:`~harness.workers.spec.PlacementBundles`)
            or a raw Ray placement group; None runs the actor outside any placement group (no GPUs).
        bundle_index: which bundle (TP rank) of the group.
        timeout: bounds actor creation and the payload's start (default ``spec.ready_timeout``).
        clock: the clock for the readiness wait.

    Returns:
        The started :class:`Worker` (not yet known to be ready).

    Raises:
        WorkerDied: the actor or its payload died while starting (the worker is stopped).
        TimeoutError: the actor did not start in time (the worker is stopped).
    """
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    opts: dict[str, Any] = {"num_cpus": spec.num_cpus}
    if spec.runtime_env:
        opts["runtime_env"] = spec.runtime_env
    if group is not None:
        pg: PlacementGroup = getattr(group, "pg", group)
        bundles = getattr(group, "bundles", None) or pg.bundle_specs
        gpus = bundles[bundle_index].get("GPU", 0)
        if gpus:
            opts["num_gpus"] = gpus
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle_index
        )
    budget = spec.ready_timeout if timeout is None else timeout
    Path(spec.run_dir, "workers").mkdir(parents=True, exist_ok=True)
    actor = remote_class().options(**opts).remote(spec, procs.owner_env())
    w = Worker(spec, actor, clock)
    try:
        try:
            w.info = ray.get(actor.start.remote(), timeout=budget)
        except RayActorError as e:
            raise w._actor_error(e) from None
        except RayTaskError as e:
            raise w._died(f"payload start raised: {str(e).strip().splitlines()[-1][:300]}") from None
        except GetTimeoutError:
            raise TimeoutError(
                f"worker {spec.name}: actor not started within {budget:g} s (no room in its placement group bundle?)"
            ) from None
        w.node = node_of(w.info.node_id)
    except BaseException:
        w.stop(grace=1.0)
        raise
    return w


def start_worker(
    spec: WorkerSpec,
    group: "PlacementBundles | PlacementGroup | None" = None,
    bundle_index: int = 0,
    *,
    timeout: float | None = None,
    clock: Clock = DEFAULT_CLOCK,
) -> Worker:
    """Start a worker (:func:`launch_worker`) and wait until it is ready.

    Args: as :func:`launch_worker`; ``timeout`` (default ``spec.ready_timeout``) bounds the readiness wait,
        and the actor's own start too, but never below :data:`ACTOR_START_S`.

    Returns:
        The ready :class:`Worker`.

    Raises:
        WorkerDied: the actor or its payload died while starting (the worker is stopped).
        TimeoutError: not ready in time (the worker is stopped).
    """
    budget = spec.ready_timeout if timeout is None else timeout
    w = launch_worker(spec, group, bundle_index, timeout=max(budget, ACTOR_START_S), clock=clock)
    try:
        w.wait_ready(budget)
    except BaseException:
        w.stop(grace=1.0)
        raise
    log.info("worker %s ready: gpus %s ports %s", spec.name, w.gpu_ids, w.ports)
    return w
