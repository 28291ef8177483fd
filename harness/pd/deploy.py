"""Put a PD pair of a topology on a Ray cluster: one worker (actor) per TP rank of the first prefill
and the first decode group, started in parallel in the topology's placement groups.

Each worker holds a :class:`~harness.pd.prefill.PrefillWorker` or
:class:`~harness.pd.decode.DecodeWorker` payload built inside its actor (sglang is imported there,
never in the driver). Workers get any ``HARNESS_FAULTS`` of the driver, so a fault injected for a
test reaches the ranks (the SWA eviction interval comes with each configuration, ``KVSpec``).

Ranks without a real GPU (CPU topologies, simulated GPUs) start as forks of a
:mod:`harness.workers.forkserver` that already imported what a rank runs
(:data:`harness.targets.sglang.preload.RANK_PRELOAD`), one per driver process and rank environment:
each rank is still its own Ray actor in its placement-group bundle, but pays a fork instead of
sglang's import (the rule, and its switch ``HARNESS_FORK_START=0``: :mod:`harness.workers.forkserver.policy`).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from harness.pd.ranks import Ranks
from harness.pd.run import PDPair
from harness.pd.spec import KVSpec
from harness.targets.sglang.compat import checks
from harness.targets.sglang import selection
from harness.targets.sglang.selection import Target
from harness.topology import Topology

if TYPE_CHECKING:
    from harness.cluster import Cluster, Placement
    from harness.workers import Worker

logger = logging.getLogger(__name__)

FAULTS_ENV = "HARNESS_FAULTS"
def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a PD rank worker: sglang's own checks on (the second oracle:
    :mod:`harness.targets.sglang.compat.checks`), the driver's faults, ``extra``. (The SWA eviction
    interval is per configuration: each decode rank sets it from ``KVSpec.eviction_interval``.)"""
    env: dict[str, str] = checks.environment(None)
    if os.environ.get(FAULTS_ENV):
        env[FAULTS_ENV] = os.environ[FAULTS_ENV]
    env.update(extra or {})
    return env


@dataclass
class Deployment:
    """A started PD pair on Ray: its workers, the :class:`PDPair` over them, and how to stop it."""

    topology: Topology
    pair: PDPair
    workers: list[Worker]
    placement: Placement | None
    cluster: Cluster
    on_stop: Callable[[Worker], None] | None = None
    stopped: bool = field(default=False)

    def stop(self) -> None:
        """Stop every worker (graceful, then kill) and release the placement. Idempotent."""
        if self.stopped:
            return
        self.stopped = True
        for w in reversed(self.workers):
            if self.on_stop is not None:
                self.on_stop(w)
            try:
                w.stop()
            except Exception as e:  # keep stopping the others
                logger.warning("stopping %s: %r", w.name, e)
        if self.placement is not None:
            self.cluster.release(self.placement)


def start(cluster: Cluster, topology: Topology, run_dir: str | Path, spec: KVSpec, *, name_prefix: str = "",
          env: dict[str, str] | None = None, on_start: Callable[[Worker], None] | None = None,
          on_stop: Callable[[Worker], None] | None = None, ready_timeout: float = 300.0,
          call_timeout: float = 120.0, target: Target | None = None) -> Deployment:
    """Place ``topology`` and start one prefill and one decode worker per TP rank.

    Args:
        cluster: a started or joined :class:`harness.cluster.Cluster`.
        topology: the topology (its first prefill and decode groups are used).
        run_dir: the run directory (worker logs and ledgers go under it).
        spec: the initial pool configuration.
        name_prefix: prefix of worker names (keeps ledgers of several deployments apart).
        env: extra worker environment.
        on_start / on_stop: called with each worker after start / before stop (fail-fast watch).
        ready_timeout: seconds for a worker to build its payload (sglang import included).
        call_timeout: seconds any one payload call may take.
        target: the sglang the ranks run (default: this process's, :func:`harness.targets.sglang.selection.current`).

    Returns:
        The :class:`Deployment`.

    Raises:
        PlacementError: the topology does not fit.
        WorkerDied / TimeoutError: a worker did not start (the others are stopped).
    """
    from harness.workers import InProcess, WorkerSpec, start_worker

    runtime_env = None
    if cluster.starts_forked("rank", topology):
        from harness.targets.sglang.preload import RANK_PRELOAD
        from harness.workers import forkserver

        # The ranks' own environment, so what modules read at import is what the ranks would read.
        server_env = {**worker_env(env), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        runtime_env = forkserver.shared(RANK_PRELOAD, server_env).runtime_env()
    placement = cluster.place(topology)
    prefill_role = topology.roles_of("prefill")[0]
    decode_role = topology.roles_of("decode")[0]
    jobs = []
    for role, cls in ((prefill_role, "harness.pd.prefill:PrefillWorker"), (decode_role, "harness.pd.decode:DecodeWorker")):
        group = placement.of(role.name)[0]
        for rank in range(role.tp):
            name = f"{name_prefix}{role.name}-0-r{rank}"
            ws = selection.worker_spec(WorkerSpec(
                name=name, run_dir=str(run_dir), num_cpus=role.cpus_per_rank, env=worker_env(env),
                ready_timeout=ready_timeout, runtime_env=runtime_env,
                payload=InProcess(cls, kwargs={"name": name, "shard": rank, "tp": role.tp, "spec": spec,
                                               "run_dir": str(run_dir)})), target)
            jobs.append((role.kind, ws, group, rank))
    started: list[tuple[str, Worker]] = []
    try:
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            futures = [(kind, pool.submit(start_worker, ws, group, rank)) for kind, ws, group, rank in jobs]
            errors = []
            for kind, fut in futures:
                try:
                    w = fut.result()
                    started.append((kind, w))
                    if on_start is not None:
                        on_start(w)
                except BaseException as e:  # collect; stop what started below
                    errors.append(e)
            if errors:
                raise errors[0]
    except BaseException:
        for _, w in started:
            if on_stop is not None:
                on_stop(w)
            w.stop()
        cluster.release(placement)
        raise
    prefill = [w for kind, w in started if kind == "prefill"]
    decode = [w for kind, w in started if kind == "decode"]
    pair = PDPair(Ranks(prefill, call_timeout), Ranks(decode, call_timeout))
    pair.configure(spec)
    return Deployment(topology, pair, [w for _, w in started], placement, cluster, on_stop)
