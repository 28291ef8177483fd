"""Put PD pairs of a topology on a Ray cluster: one worker (actor) per TP rank of the first prefill
and the first decode group, started in parallel in the topology's placement groups.

Each worker builds its rank payload inside its actor (sglang is imported there, never in the driver) and
gets the driver's ``HARNESS_FAULTS``; ranks without a real GPU start as forks of a fork server. More
pairs (``instances``) and the fork rule: docs/modules.md.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from harness.engines.sim.ranks import Ranks
from harness.engines.sim.driver import PDPair
from harness.engines.sim.workload import KVSpec
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
    """Started PD pairs on Ray: their workers, one :class:`PDPair` per instance, and how to stop them."""

    topology: Topology
    pairs: list[PDPair]
    workers: list[Worker]
    placement: Placement | None
    cluster: Cluster
    on_stop: Callable[[Worker], None] | None = None
    stopped: bool = field(default=False)

    @property
    def pair(self) -> PDPair:
        """The first pair (the only one unless ``instances`` asked for more)."""
        return self.pairs[0]

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


def rank_runtime_env(
    cluster: Cluster, topology: Topology, env: dict[str, str] | None = None, target: Target | None = None
) -> dict[str, Any] | None:
    """The Ray runtime environment of ``topology``'s rank workers: a fork server's (started here on
    first use: its preload is the one slow step, and a caller may take it ahead to time the ranks
    alone), or None when the ranks start as fresh interpreters (:meth:`Cluster.starts_forked`)."""
    if not cluster.starts_forked("rank", topology):
        return None
    from harness.engines.fork_preload import RANK_PRELOAD, after_python
    from harness.workers import forkserver

    # The ranks' own environment, so what modules read at import is what the ranks would read: their
    # TARGET too (selection.worker_spec), so a driver that had not selected one yet when the server
    # started (a bench, not an entry point) gets the same server on its next deployment, not a second.
    target = selection.current() if target is None else target
    server_env = {
        **worker_env(env),
        selection.ENV_VAR: target.spec,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    return forkserver.shared(RANK_PRELOAD, server_env, launch=after_python).runtime_env()


def start(
    cluster: Cluster,
    topology: Topology,
    run_dir: str | Path,
    spec: KVSpec,
    *,
    name_prefix: str = "",
    env: dict[str, str] | None = None,
    on_start: Callable[[Worker], None] | None = None,
    on_stop: Callable[[Worker], None] | None = None,
    ready_timeout: float = 300.0,
    call_timeout: float = 120.0,
    target: Target | None = None,
    instances: int | None = 1,
) -> Deployment:
    """Place ``topology`` and start one prefill and one decode worker per TP rank of each pair.

    Args:
        cluster: a started or joined :class:`harness.cluster.Cluster`.
        topology: the topology (the groups of its first prefill and decode roles are used).
        run_dir: the run directory (worker logs and ledgers go under it).
        spec: the initial pool configuration.
        name_prefix: prefix of worker names (keeps ledgers of several deployments apart).
        env: extra worker environment.
        on_start / on_stop: called with each worker after start / before stop (fail-fast watch).
        ready_timeout: seconds for a worker to build its payload (sglang import included).
        call_timeout: seconds any one payload call may take.
        target: the sglang the ranks run (default: this process's, :func:`harness.targets.sglang.selection.current`).
        instances: PD pairs to start (pair *i*: the *i*-th prefill and decode groups); None: one per
            group, which needs as many prefill groups as decode groups.

    Returns:
        The :class:`Deployment`.

    Raises:
        ValueError: ``instances`` is below 1 or more than the roles have groups.
        PlacementError: the topology does not fit.
        WorkerDied / TimeoutError: a worker did not start (the others are stopped).
    """
    from harness.workers import InProcess, WorkerSpec, start_worker

    prefill_role = topology.roles_of("prefill")[0]
    decode_role = topology.roles_of("decode")[0]
    pairs = _instances(topology.name, prefill_role.groups, decode_role.groups, instances)
    runtime_env = rank_runtime_env(cluster, topology, env, target)
    placement = cluster.place(topology)
    jobs = []
    for i in range(pairs):
        for role, cls in (
            (prefill_role, "harness.engines.sim.prefill_rank:PrefillWorker"),
            (decode_role, "harness.engines.sim.decode_rank:DecodeWorker"),
        ):
            group = placement.of(role.name)[i]
            for rank in range(role.tp):
                name = f"{name_prefix}{role.name}-{i}-r{rank}"
                ws = selection.worker_spec(
                    WorkerSpec(
                        name=name,
                        run_dir=str(run_dir),
                        num_cpus=role.cpus_per_rank,
                        env=worker_env(env),
                        ready_timeout=ready_timeout,
                        runtime_env=runtime_env,
                        payload=InProcess(
                            cls,
                            kwargs={"name": name, "shard": rank, "tp": role.tp, "spec": spec, "run_dir": str(run_dir)},
                        ),
                    ),
                    target,
                )
                jobs.append(((i, role.kind), ws, group, rank))
    started: list[tuple[tuple[int, str], Worker]] = []
    try:
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            futures = [(key, pool.submit(start_worker, ws, group, rank)) for key, ws, group, rank in jobs]
            errors = []
            for key, fut in futures:
                try:
                    w = fut.result()
                    started.append((key, w))
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
    dep = Deployment(topology, [], [w for _, w in started], placement, cluster, on_stop)
    try:
        for i in range(pairs):
            prefill = [w for key, w in started if key == (i, "prefill")]
            decode = [w for key, w in started if key == (i, "decode")]
            dep.pairs.append(PDPair(Ranks(prefill, call_timeout), Ranks(decode, call_timeout)))
        for pair in dep.pairs:
            pair.configure(spec)
    except BaseException:
        dep.stop()
        raise
    return dep


def _instances(name: str, prefill_groups: int, decode_groups: int, asked: int | None) -> int:
    """How many pairs to start: ``asked``, or one per group when None; refused with one line when
    the roles do not have that many groups."""
    have = min(prefill_groups, decode_groups)
    if asked is None:
        if prefill_groups != decode_groups:
            raise ValueError(
                f"{name}: prefill has {prefill_groups} group(s), decode {decode_groups}: pairs need as many of "
                "each; pass instances=N (N ≤ the smaller count)"
            )
        return have
    if not 1 <= asked <= have:
        raise ValueError(
            f"{name}: instances={asked}, but the topology has {have} prefill/decode pair(s); "
            f"pass 1 to {have} or None for all"
        )
    return asked
