"""Starting a local Ray for :meth:`harness.cluster.Cluster.start`: its node processes (a ``cluster_utils.Cluster``
of one node or several, without the monitors no harness driver reads), one retry of Ray's startup timeout, and
the cleanup of what a failed start left.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

from harness.cluster import join as join_mod
from harness.workers import procs
from harness.workers.node_ref import NODE_RESOURCE

log = logging.getLogger(__name__)

#: Amount of ``harness_node_<i>`` each harness-started node has; bundles take a tiny slice of it.
NODE_RESOURCE_AMOUNT = 1000.0

#: What Ray raises when a node it started has not registered with the GCS within its fixed 30 s
#: (``ray._private.node.Node``; no setting lengthens it): on a 2-core machine running several clusters
#: at once this is load, not a broken install.
STARTUP_TIMEOUT = "timed out during startup"


def with_one_retry(start: Callable[[], Any]) -> Any:
    """``start()``, and once more if Ray's node start timed out (:data:`STARTUP_TIMEOUT`).

    A second timeout, or any other failure, is raised as it came. Ray retries nothing here itself,
    and no library wraps this one case; tenacity would be a dependency for a two-line loop.
    """
    try:
        return start()
    except Exception as e:  # noqa: BLE001 - only Ray's startup timeout is retried; the rest re-raised
        if STARTUP_TIMEOUT not in str(e):
            raise
        log.warning("Ray's node start timed out (%s); starting it once more", e)
    return start()


#: The head node's settings beyond Ray's defaults: no dashboard; no log monitor (it streams the workers'
#: logs to drivers, and every driver here connects with ``log_to_driver=False``; the worker nodes of a
#: ``cluster_utils.Cluster`` start none either); no autoscaler monitor (a local cluster of fixed nodes
#: scales nothing). Each of the last two cost about a CPU-second per cluster, and CI starts ~50.
HEAD_ARGS: dict[str, Any] = dict(
    include_dashboard=False,
    include_log_monitor=False,
    no_monitor=True,
)


def start_ray(nodes: int, cpus: float, gpus: int | None, tdir: Path, object_store_mb: int) -> Any:
    """Start Ray's node(s) as a ``cluster_utils.Cluster`` of ``nodes`` (returned; one node too: ``ray.init``
    starting its own head cannot leave the log and autoscaler monitors out, :data:`HEAD_ARGS`) and connect
    this process. A failure leaves no Ray process (:func:`stop_leftovers`) and this process disconnected."""
    import ray

    from ray.cluster_utils import Cluster as RayCluster

    sim = None
    try:
        # cluster_utils writes the cluster address to <RAY_TMPDIR>/ray/ray_current_cluster:
        # keep it inside our own temp dir so no other Ray user on the machine is redirected.
        os.environ["RAY_TMPDIR"] = str(tdir)
        (tdir / "ray").mkdir(exist_ok=True)
        sim = RayCluster(initialize_head=False, shutdown_at_exit=True)
        for i in range(nodes):
            args: dict[str, Any] = dict(
                num_cpus=cpus,
                resources={NODE_RESOURCE.format(i): NODE_RESOURCE_AMOUNT},
                object_store_memory=object_store_mb << 20,
            )
            if gpus is not None:
                args["num_gpus"] = gpus
            if i == 0:
                args.update(HEAD_ARGS)
                if nodes == 1:  # its object store allocated at start (as ray.init's one node had it)
                    args["_system_config"] = {"preallocate_plasma_memory": True}
            sim.add_node(wait=False, **args)
        sim.wait_for_nodes(timeout=60)
        ray.init(address=sim.address, logging_level="ERROR", log_to_driver=False)
    except BaseException:
        if sim is not None:
            sim.shutdown()
        if ray.is_initialized():
            ray.shutdown()
        stop_leftovers(tdir)
        raise
    return sim


def stop_leftovers(tdir: Path, timeout: float = 10.0) -> None:
    """Kill the processes a failed start left: a node whose start raised (Ray's startup timeout among
    them) is known to neither ``ray.shutdown`` nor its ``cluster_utils.Cluster``, yet its GCS, raylet and
    monitors run on. They are this process's descendants that name ``tdir`` on their command line
    (every Ray process of the attempt does: its session lives there), so a concurrent start of
    something else here is left alone."""
    import psutil

    mine = []
    for pid in procs.descendants(os.getpid()):
        try:
            if str(tdir) in " ".join(psutil.Process(pid).cmdline()):
                os.kill(pid, 9)
                mine.append(pid)
        except (psutil.Error, ProcessLookupError):
            continue
    left = procs.wait_gone(mine, timeout)
    if left:
        log.warning("processes of a failed Ray start still running %.0f s after SIGKILL: %s", timeout, left)


def own_token() -> None:
    """Give a cluster started here a token of its own, in the environment, when Ray would write one.

    ``ray.init()`` starting a cluster turns token auth on and, finding no token, writes one to
    ``~/.ray/auth_token``. That file then turns token auth on for every later ``ray start --head``
    on the machine, whose clients joining by address must set ``RAY_AUTH_MODE=token`` (issue 17's
    first failed try). A token in ``RAY_AUTH_TOKEN`` keeps auth on, is inherited by the cluster's
    processes, and leaves the home directory alone. A token the user already has, or a mode the
    user set, is left as it is.
    """
    import secrets

    if os.environ.get(join_mod.AUTH_MODE_ENV) is None and not join_mod.auth_settings().has_token:
        os.environ[join_mod.TOKEN_ENV] = secrets.token_hex(32)  # Ray's own token size (256 bits)


def restore_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value
