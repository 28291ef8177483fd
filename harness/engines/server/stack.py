"""A real prefill + decode + router stack, each server the subprocess payload of a Ray worker.

:func:`start_pd_stack` starts the three at once and waits until the router lists both servers healthy;
:func:`start_plain_server` starts the parity baseline. The started stack is :class:`.pd_stack.PdStack`. The
start as numbered steps, readiness and the fork rule: docs/modules.md. Over 400 lines: the start's steps share
one set of half-started servers to stop on any failure.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from harness.targets.sglang import selection
from harness.engines.server.http_client import ServerClient
from harness.engines.server.launcher import (
    COMPAT_ENV,
    CPU_ENV,
    Command,
    ServerPorts,
    plain_server_command,
    router_command,
    server_command,
)
from harness.engines.server.accounting_probe import COMPONENT_ENV, LEDGER_ENV, WORKER_ENV
from harness.engines.server.pd_stack import PdStack
from harness.engines.server.rdma import NODE_GPUS_ENV
from harness.topology import Topology
from harness.workers import (
    HttpCheck,
    PlacementBundles,
    RolePlacement,
    Subprocess,
    Worker,
    WorkerSpec,
    launch_worker,
    procs,
    start_worker,
)
from harness.workers import forkserver as fork_servers

log = logging.getLogger(__name__)

#: Packages the real CPU stack needs besides sglang (module name -> pip requirement).
STACK_MODULES = {"sglang_router": "sglang-router", "mooncake": "mooncake-transfer-engine-non-cuda"}


def missing_stack_modules() -> list[str]:
    """pip names of the CPU stack's packages that are not importable here."""
    return [pip for mod, pip in STACK_MODULES.items() if importlib.util.find_spec(mod) is None]


#: Placeholders the worker fills with the ports it leased and reports back.
SERVER_PORT_NAMES = ("http", "nccl")
PREFILL_PORT_NAMES = ("http", "nccl", "bootstrap")
ROUTER_PORT_NAMES = ("http", "prometheus")
PLACEHOLDER_PORTS = ServerPorts(http="{http}", nccl="{nccl}", bootstrap="{bootstrap}")

DEFAULT_READY_TIMEOUT_S = 420.0
#: A real model on GPUs: weights read from disk (hundreds of GB for a DeepSeek-V4 class model) and
#: CUDA graphs captured before ``/health`` answers.
GPU_READY_TIMEOUT_S = 1800.0
_POLL_S = 0.5

#: Called with each worker right after it started (the pytest plugin watches it for fail-fast).
OnStart = Callable[["Worker"], None]


#: Lines of a server's log that mean it no longer serves though its process runs, so the stack is
#: dead (the running test fails at once, the next gets a fresh stack): sglang's mooncake transfer
#: thread ends on any exception (sglang#27162), after which every P→D transfer of that prefill
#: hangs; one it meets is a race of that thread with the scheduler clearing a finished request
#: (``KeyError`` in ``check_status``), seen on a loaded 2-core machine.
SERVER_FATAL: tuple[str, ...] = ("Transfer thread failed because of",)

#: What decides which modules the fork server imported, and how: a server whose values differ is not
#: forked. ``PYTHONPATH`` may differ where it shadows none of them: the fork server imports no sglang,
#: so a fault's or mutant's overlay (a patched ``sglang/`` on the path, ``$HARNESS_SGLANG_OVERLAY``)
#: changes nothing it has (the server is started ``free_path``; the child rebuilds ``sys.path``).
IMPORT_ENV: tuple[str, ...] = (
    "PYTHONPATH",
    "HARNESS_SGLANG",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "TRITON_INTERPRET",
    "LD_LIBRARY_PATH",
    "LD_PRELOAD",
    "CUDA_VISIBLE_DEVICES",
    "PROMETHEUS_MULTIPROC_DIR",
    *CPU_ENV,
)
#: What the servers' ``sitecustomize`` reads: per server, so never in the fork server's environment.
SITE_ENV: tuple[str, ...] = (COMPAT_ENV, LEDGER_ENV, WORKER_ENV, COMPONENT_ENV, "HARNESS_FAULTS", NODE_GPUS_ENV)


def command_env(cmd: Command) -> dict[str, str]:
    # The worker adds these to its own environment; PYTHONPATH must extend ours, not replace it.
    env = cmd.environ(base={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    return {k: v for k, v in env.items() if v}


def fork_server(env: Mapping[str, str], advertise: bool = False) -> fork_servers.ForkServer | fork_servers.Inherited:
    """The server fork server for a server whose command adds ``env`` (:func:`command_env`): this
    process's, or an ancestor's, that serves it (its ``PYTHONPATH`` may differ: see
    :data:`IMPORT_ENV`); started if none does, and named to later child processes with ``advertise``."""
    from harness.engines.server.server_preload import SERVER_PRELOAD

    # The environment the server will have (the Ray worker's: ours, one OpenMP thread, no GPU),
    # without what its sitecustomize reads: the fork server must import no sglang.
    will_have = {
        **os.environ,
        **env,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "CUDA_VISIBLE_DEVICES": "",
    }
    base = {k: v for k, v in will_have.items() if k not in SITE_ENV}
    return fork_servers.shared(
        SERVER_PRELOAD, {}, base=base, must_match=IMPORT_ENV, free_path=True, advertise=advertise
    )


def _forked(argv: Sequence[str], env: dict[str, str]) -> tuple[tuple[str, ...], dict[str, str]]:
    """``argv`` and ``env`` of a server started as a fork of the (shared) server fork server."""
    server = fork_server(env)
    return tuple(server.command(argv)), {**env, fork_servers.SOCKET_ENV: server.socket_path}


def share_fork_server(topology: Topology, advertise: bool = True) -> bool:
    """Start the server fork server for ``topology``'s CPU servers here and (``advertise``) name it to
    the processes this one starts after (:data:`harness.workers.forkserver.ADVERTISE_ENV`), so that
    their servers fork from it rather than each importing the server graph in a fork server of its
    own (the fault check's pytest runs: a patched ``sglang/`` on their path changes nothing the fork
    server has). A later server of this process forks from it either way.

    Returns:
        Whether it serves (False, logged: servers with real GPUs never fork; fork starts switched
        off; it could not start, and each run starts its own as before).
    """
    return _shared_fork_server(topology, advertise) is not None


def fork_server_env(topology: Topology) -> dict[str, str]:
    """What names this process's server fork server for ``topology``'s CPU servers (started if none) to
    one child process, for that child's environment: a pytest run it starts forks its servers from it
    instead of starting a fork server of its own (about 9 CPU-s each), without naming it to every
    later child of this process as :func:`share_fork_server` does. Empty when servers do not fork here.
    """
    server = _shared_fork_server(topology, advertise=False)
    if server is None:
        return {}
    inherited = [p for p in os.environ.get(fork_servers.ADVERTISE_ENV, "").split(os.pathsep) if p]
    return {fork_servers.ADVERTISE_ENV: os.pathsep.join([server.socket_path, *inherited])}


def _shared_fork_server(topology: Topology, advertise: bool) -> fork_servers.ForkServer | fork_servers.Inherited | None:
    """The server fork server of ``topology``'s CPU servers (:func:`fork_server`, started if none), or None
    where servers do not fork (see :func:`share_fork_server`'s return)."""
    if topology.needs_gpus or not fork_servers.forks("server"):
        return None
    cmd = plain_server_command(topology, model="model", ports=ServerPorts(http=0, nccl=0))
    try:
        return fork_server(command_env(cmd), advertise=advertise)
    except fork_servers.ForkServerError as e:
        log.warning("no shared server fork server (%s): each run starts its own", e)
        return None


def _spec(
    name: str,
    cmd: Command,
    run_dir: Path,
    ports: Sequence[str],
    ready_timeout: float,
    ready_path: str = "/health",
    forkserver: bool = False,
) -> WorkerSpec:
    argv, env = tuple(cmd.argv), command_env(cmd)
    if forkserver and argv[:1] == (sys.executable,):
        argv, env = _forked(argv, env)
    return selection.worker_spec(
        WorkerSpec(
            name=name,
            payload=Subprocess(argv, env=env, fatal=SERVER_FATAL),
            run_dir=run_dir,
            ports=tuple(ports),
            ready=(HttpCheck("http://127.0.0.1:{http}" + ready_path),),
            ready_timeout=ready_timeout,
        )
    )


def _start(spec: WorkerSpec, group: PlacementBundles | None, on_start: OnStart | None) -> Worker:
    w = start_worker(spec, group, 0)
    if on_start is not None:
        on_start(w)
    return w


def _group(placement: RolePlacement | None, role: str) -> PlacementBundles | None:
    if placement is None:
        return None
    groups = placement.of(role)
    return groups[0] if groups else None


def _all_ready(
    pool: concurrent.futures.ThreadPoolExecutor, workers: Sequence[Worker], ready: Callable[[Worker], None]
) -> None:
    """Wait for ``workers`` at once; the first failure raises as soon as it happens (the caller stops
    everything, which ends the other waits)."""
    for waited in concurrent.futures.as_completed([pool.submit(ready, w) for w in workers]):
        waited.result()


def wait_router_registered(router: Worker, servers: Sequence[Worker], deadline: float, expect: int = 2) -> list[dict]:
    """Poll the router's ``/workers`` until ``expect`` workers are listed healthy.

    Each poll first checks that the router and the servers are alive.

    Raises:
        WorkerDied: one of them died meanwhile.
        TimeoutError: not registered by ``deadline`` (``time.monotonic()`` seconds).
    """
    client = ServerClient(router.url("http"), timeout_s=5.0)
    seen: list[dict] = []
    while True:
        for w in (router, *servers):
            w.check()
        try:
            seen = client.workers()
        except Exception as e:  # noqa: BLE001 - not up yet; liveness is checked above
            log.debug("router /workers: %r", e)
        healthy = [w for w in seen if w.get("is_healthy", True)]
        if len(healthy) >= expect:
            return seen
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"router {router.name}: {len(healthy)}/{expect} workers registered healthy "
                f"(saw {seen}); router log:\n{router.tail()}"
            )
        time.sleep(_POLL_S)


def pd_commands(
    topology: Topology,
    model: str | Path,
    run_dir: str | Path,
    *,
    names: tuple[str, str] = ("prefill", "decode"),
    probe: bool = True,
    compat_patches: Sequence[str] | None = None,
    extra_args: Mapping[str, Sequence[str]] | None = None,
    extra_env: Mapping[str, Mapping[str, str]] | None = None,
) -> tuple[Command, Command]:
    """The prefill and decode commands :func:`start_pd_stack` runs (ports still placeholders).

    Args: as :func:`start_pd_stack` (``names``: prefill and decode worker names).

    Returns:
        ``(prefill, decode)`` :class:`.launcher.Command`.
    """
    common = dict(model=model, ports=PLACEHOLDER_PORTS, compat_patches=compat_patches)
    more, env = dict(extra_args or {}), dict(extra_env or {})
    # The full probe runs on decode: that is where the PD prealloc paths are, and a PD decode
    # server has no radix cache (the default), so a release returns every page and the books must
    # balance. Prefill's probe records only its cache flushes (the reset check between tests).
    probe_dir = Path(run_dir) if probe else None
    p_cmd = server_command(
        topology,
        "prefill",
        worker=names[0],
        probe_run_dir=probe_dir,
        extra_args=tuple(more.get("prefill", ())),
        extra_env=env.get("prefill"),
        **common,
    )
    d_cmd = server_command(
        topology,
        "decode",
        worker=names[1],
        probe_run_dir=probe_dir,
        extra_args=tuple(more.get("decode", ())),
        extra_env=env.get("decode"),
        **common,
    )
    return p_cmd, d_cmd


def start_pd_stack(
    topology: Topology,
    model: str | Path,
    run_dir: str | Path,
    *,
    placement: RolePlacement | None = None,
    names: tuple[str, str, str] = ("prefill", "decode", "router"),
    probe: bool = True,
    mini_lb: bool = False,
    compat_patches: Sequence[str] | None = None,
    extra_args: Mapping[str, Sequence[str]] | None = None,
    extra_env: Mapping[str, Mapping[str, str]] | None = None,
    ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
    on_start: OnStart | None = None,
    on_launch: OnStart | None = None,
    forkserver: bool = False,
) -> PdStack:
    """Start prefill and decode servers and a PD router as three Ray workers, and wait until ready.

    Args:
        topology: gives the roles, transfer backend and CPU/GPU recipe.
        model: model directory.
        run_dir: the run directory (worker logs, ledger, ports).
        placement: a :class:`harness.cluster.Placement` of the topology's server layout
            (:func:`.layout.server_layout`: bundle 0 of a group holds all GPUs of its server; None:
            no placement groups).
        names: worker names of prefill, decode and router (unique within the run).
        probe: enable the accounting probe on decode (``<run_dir>/ledger/<decode name>.jsonl``) and
            its flush recorder on prefill (``<run_dir>/ledger/<prefill name>.jsonl``).
        mini_lb: run the router as ``--mini-lb``.
        compat_patches: see :func:`.launcher.server_command`.
        extra_args: more server flags per role kind (``prefill``, ``decode``); they win over defaults.
        extra_env: more environment per role kind (``prefill``, ``decode``), set last.
        ready_timeout: one deadline for the whole stack, in seconds.
        on_start: called with each worker once the whole stack is ready (never for a stack that failed).
        on_launch: called with each worker as soon as it is launched (its processes exist), whether or
            not the stack then becomes ready: for the caller's own leftover checks.
        forkserver: start prefill and decode as forks of the server fork server (the caller
            decides: :meth:`harness.cluster.Cluster.starts_forked`).

    Returns:
        The ready :class:`PdStack`.

    Raises:
        WorkerDied: a worker died while starting (everything started is stopped).
        TimeoutError: not ready within ``ready_timeout`` (everything started is stopped).
    """
    t0 = time.monotonic()
    deadline = t0 + ready_timeout
    run_dir = Path(run_dir)
    p_name, d_name, r_name = names
    p_cmd, d_cmd = pd_commands(
        topology,
        model,
        run_dir,
        names=(p_name, d_name),
        probe=probe,
        compat_patches=compat_patches,
        extra_args=extra_args,
        extra_env=extra_env,
    )
    started: list[Worker] = []

    def launch(name: str, cmd: Command, ports: Sequence[str], role: str) -> Worker:
        spec = _spec(
            name, cmd, run_dir, ports, max(1.0, deadline - time.monotonic()), forkserver=forkserver and role != "router"
        )
        w = launch_worker(spec, _group(placement, role), 0)
        started.append(w)
        if on_launch is not None:
            on_launch(w)
        return w

    def ready(w: Worker) -> None:
        w.wait_ready(max(1.0, deadline - time.monotonic()))
        log.info("worker %s ready: ports %s", w.name, w.ports)

    # The router (sglang-router's Rust one) starts beside the servers with none registered, and each
    # server is registered through its /workers API once ready: given the servers' URLs on its command
    # line instead, it would try them while they come up and back off between tries (1 s more each
    # time, up to 5 s). MiniLB (Python) has no such API: it starts after the servers, with their URLs.
    pool = concurrent.futures.ThreadPoolExecutor(3, thread_name_prefix="pd-start")
    fp = fd = None
    try:
        fp = pool.submit(launch, p_name, p_cmd, PREFILL_PORT_NAMES, "prefill")
        fd = pool.submit(launch, d_name, d_cmd, SERVER_PORT_NAMES, "decode")
        if mini_lb:
            concurrent.futures.wait([fp, fd])
            prefill, decode = fp.result(), fd.result()
            _all_ready(pool, (prefill, decode), ready)
            router = launch(
                r_name,
                router_command(
                    topology,
                    prefill=[(prefill.url("http"), prefill.ports["bootstrap"])],
                    decode=[decode.url("http")],
                    port="{http}",
                    prometheus_port="{prometheus}",
                    mini_lb=True,
                    worker=r_name,
                ),
                ROUTER_PORT_NAMES,
                "router",
            )
            ready(router)
        else:
            router = launch(
                r_name,
                router_command(
                    topology, prefill=[], decode=[], port="{http}", prometheus_port="{prometheus}", worker=r_name
                ),
                ROUTER_PORT_NAMES,
                "router",
            )
            concurrent.futures.wait([fp, fd])
            prefill, decode = fp.result(), fd.result()
            _all_ready(pool, (prefill, decode, router), ready)
            client = ServerClient(router.url("http"), timeout_s=10.0)
            client.add_worker(prefill.url("http"), "prefill", prefill.ports["bootstrap"])
            client.add_worker(decode.url("http"), "decode")
        wait_router_registered(router, (prefill, decode), deadline)
        stack = PdStack(prefill, decode, router, str(model), time.monotonic() - t0)
        if on_start is not None:  # inside: a callback that raises stops the stack too
            for w in stack.workers:
                on_start(w)
    except BaseException:
        # A server launch still going (the router's failed beside it) adds its worker when it ends.
        concurrent.futures.wait([f for f in (fp, fd) if f is not None])
        for w in reversed(started):
            try:
                w.stop(grace=2.0)
            except Exception as e:  # noqa: BLE001 - stop the others all the same; the start's error is raised
                log.warning("stopping %s after a failed stack start: %r", w.name, e)
        raise
    finally:
        pool.shutdown(wait=True)
    log.info(
        "PD stack ready in %.1f s: prefill %s decode %s router %s",
        stack.started_s,
        prefill.url("http"),
        decode.url("http"),
        router.url("http"),
    )
    return stack


def launch_role(
    topology: Topology,
    model: str | Path,
    run_dir: str | Path,
    role: str,
    name: str,
    *,
    placement: RolePlacement | None = None,
    probe: bool = True,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
    forkserver: bool = False,
) -> Worker:
    """Launch one server of a PD stack (``prefill`` or ``decode``) as :func:`start_pd_stack` does, and
    return it at once, not ready: the replacement of a running stack's server (:func:`rejoin`), so a test
    can act while it starts."""
    cmd = server_command(
        topology,
        role,
        worker=name,
        model=model,
        ports=PLACEHOLDER_PORTS,
        probe_run_dir=Path(run_dir) if probe else None,
        extra_args=tuple(extra_args),
        extra_env=extra_env,
    )
    ports = PREFILL_PORT_NAMES if role == "prefill" else SERVER_PORT_NAMES
    return launch_worker(
        _spec(name, cmd, Path(run_dir), ports, ready_timeout, forkserver=forkserver), _group(placement, role), 0
    )


def rejoin(stack: PdStack, role: str, worker: Worker, deadline: float) -> PdStack:
    """The stack with ``worker`` (launched by :func:`launch_role`) in place of its ``role`` server: wait
    until it is ready, unregister the old one from the router and register the new one (a prefill with
    its bootstrap port), and wait until the router lists both servers healthy.

    Raises:
        WorkerDied: a worker died meanwhile.
        TimeoutError: not ready or not registered by ``deadline`` (``time.monotonic()`` seconds).
    """
    worker.wait_ready(max(1.0, deadline - time.monotonic()))
    client = ServerClient(stack.router.url("http"), timeout_s=10.0)
    client.remove_worker(getattr(stack, role).url("http"))
    client.add_worker(worker.url("http"), role, worker.ports["bootstrap"] if role == "prefill" else None)
    new = dataclasses.replace(stack, **{role: worker})
    wait_router_registered(new.router, (new.prefill, new.decode), deadline)
    return new


def start_plain_server(
    topology: Topology,
    model: str | Path,
    run_dir: str | Path,
    *,
    name: str = "plain",
    group: PlacementBundles | None = None,
    compat_patches: Sequence[str] | None = None,
    extra_args: Sequence[str] = (),
    ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
    on_start: OnStart | None = None,
    probe: bool = False,
    forkserver: bool = False,
) -> Worker:
    """Start a non-disaggregated server (the parity baseline) as a Ray worker and wait until ready.

    Args:
        topology, model, run_dir, compat_patches, ready_timeout, on_start: as :func:`start_pd_stack`.
        name: worker name.
        probe: record its cache flushes in ``<run_dir>/ledger/<name>.jsonl`` (for :func:`.reset.reset_server`).
        forkserver: as :func:`start_pd_stack`.
        group: placement group to run in (None: none; fine without GPUs; on GPUs its bundle 0
            must hold every GPU of the server, see :mod:`.layout`).
        extra_args: more server flags (they win over defaults).

    Returns:
        The ready :class:`harness.workers.Worker`.

    Raises:
        WorkerDied: it died while starting. TimeoutError: not ready in time.
    """
    cmd = plain_server_command(
        topology,
        model=model,
        ports=PLACEHOLDER_PORTS,
        compat_patches=compat_patches,
        worker=name,
        extra_args=extra_args,
        probe_run_dir=Path(run_dir) if probe else None,
    )
    return _start(
        _spec(name, cmd, Path(run_dir), SERVER_PORT_NAMES, ready_timeout, forkserver=forkserver), group, on_start
    )


def leftover_processes(pids: Sequence[int]) -> list[int]:
    """Of the given server process (group) ids, the ones with any live process left."""
    return [p for p in pids if procs.alive(p) or procs.group_members(p)]
