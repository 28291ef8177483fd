"""The Ray cluster a run uses, and the placement groups a topology needs on it.

A :class:`Cluster` is either *started* by the harness (a local Ray, or with ``simulate=True`` the topology's
GPUs as Ray logical GPUs on a CPU machine) or *joined* (``--ray-address``); the harness only ever stops a
cluster it started. Ray's node processes start in :mod:`harness.cluster.local_ray`. Simulation, joining,
placement and the API list: docs/modules.md.

Example (run by ``tests/test_examples.py``)::

    from harness import topology
    from harness.cluster import Cluster

    topo = topology.get("2-gpu-h100")
    with Cluster.start(topo, simulate=True) as cluster:
        fit = cluster.check(topo)            # Fit(ok=True, state='CREATED', ...)
        assert fit.ok, fit
        placement = cluster.place(topo)
        prefill = placement.of("prefill")[0] # GroupPlacement: .pg, .bundles, .strategy
        assert len(prefill.bundles) == topo.role("prefill").tp  # one bundle per TP rank
        cluster.release(placement)           # (start workers in it first: harness.workers.start_worker)
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from harness.cluster import join as join_mod
from harness.cluster import local_ray
from harness.cluster import nodes as node_facts
from harness.cluster.nodes import NodeInfo, alive_nodes, local_gpus
from harness.cluster.placement import (
    Fit,
    Placement,
    Placements,
)
from harness.topology import Topology
from harness.workers import procs
from harness.workers.forkserver.policy import Kind, forks

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster as RayCluster

log = logging.getLogger(__name__)

#: Logical CPUs per harness-started node: actors take 0.1, so this holds many; kept small because
#: Ray may prestart one Python worker per CPU on a 2-core machine.
DEFAULT_NUM_CPUS = 4
#: Object store of each harness-started node (MiB). Small and allocated up front: Ray otherwise
#: sizes it at 30% of RAM and maps its pages lazily, and the page faults on every fresh object
#: halve the P→D transfer rate (bench/transfer.py). Larger objects spill to disk, not fail.
DEFAULT_OBJECT_STORE_MB = 512

# Ray's environment: set before ray is imported anywhere in a run started by the harness.
_RAY_ENV = {
    "RAY_DEDUP_LOGS": "0",
    "RAY_SCHEDULER_EVENTS": "0",  # no "(autoscaler) Error: no node types..." lines on the driver
    "RAY_USAGE_STATS_ENABLED": "0",
}


def _short_temp_dir() -> Path:
    # Ray puts AF_UNIX sockets under it: the path must stay far below 107 bytes.
    return Path(tempfile.mkdtemp(prefix="ph-", dir="/tmp" if Path("/tmp").is_dir() else None))


class Cluster:
    """A Ray cluster the harness started or joined. Build it with :meth:`start` or :meth:`join`."""

    def __init__(
        self,
        *,
        address: str,
        owned: bool,
        simulate: bool,
        temp_dir: Path | None,
        sim_cluster: RayCluster | None = None,
        topology: Topology | None = None,
    ) -> None:
        self.address = address
        self.owned = owned
        self.simulate = simulate
        self.topology = topology
        self._temp_dir = temp_dir
        self._sim_cluster = sim_cluster
        self._placements = Placements(owned=owned)
        self._pids: list[int] = []
        self._closed = False
        self._saved_tmpdir: str | None = os.environ.get("RAY_TMPDIR")
        #: What each node said when joined (:func:`harness.cluster.nodes.survey`); empty for a started cluster.
        self.facts: tuple[node_facts.NodeFacts, ...] = ()

    # ---------------------------------------------------------------- construction

    @classmethod
    def start(
        cls,
        topology: Topology | None = None,
        *,
        simulate: bool = False,
        nodes: int | None = None,
        gpus_per_node: int | None = None,
        num_cpus: float | None = None,
        temp_dir: str | Path | None = None,
        object_store_mb: int = DEFAULT_OBJECT_STORE_MB,
    ) -> "Cluster":
        """Start a local Ray for ``topology`` and connect this process to it.

        Args:
            topology: what the cluster must hold; None starts one CPU-only node.
            simulate: give the node(s) the topology's GPUs as logical GPUs; multi-node topologies
                become one Ray node per topology node. Without it, Ray detects real GPUs.
            nodes: number of Ray nodes (default: the topology's; 1 without one). More than one
                starts a ``ray.cluster_utils.Cluster`` (one Ray node per topology node).
            gpus_per_node: logical GPUs per node when simulating (default: the topology's).
            num_cpus: logical CPUs per node (default :data:`DEFAULT_NUM_CPUS`).
            temp_dir: Ray's temp dir (default: a fresh short dir under /tmp, removed at shutdown).
            object_store_mb: object store per node, MiB (one node: allocated at start).

        Returns:
            The connected cluster; stop it with :meth:`shutdown` (or use it as a context manager).

        Raises:
            RuntimeError: this process is already connected to a Ray cluster.
        """
        for k, v in _RAY_ENV.items():
            os.environ.setdefault(k, v)
        import ray

        if ray.is_initialized():
            raise RuntimeError("this process is already connected to Ray; shut it down or use Cluster.join")
        local_ray.own_token()
        procs.reap_stale()
        # The driver owns the cluster: if it is SIGKILLed, the next run reaps what is left.
        procs.claim()
        made_temp = temp_dir is None
        tdir = Path(temp_dir) if temp_dir else _short_temp_dir()
        tdir.mkdir(parents=True, exist_ok=True)
        if made_temp:
            procs.register(os.getpid(), kind="dir", label="ray temp dir", path=tdir)
        cpus = (
            num_cpus
            if num_cpus is not None
            else (topology.cpus_per_node if topology and topology.cpus_per_node else DEFAULT_NUM_CPUS)
        )
        if nodes is None:
            nodes = topology.nodes if topology else 1
        if gpus_per_node is None:
            gpus_per_node = topology.gpus_per_node if topology else 0
        gpus = gpus_per_node if simulate else None
        t0 = time.monotonic()
        saved_tmpdir = os.environ.get("RAY_TMPDIR")
        try:
            sim = local_ray.with_one_retry(lambda: local_ray.start_ray(nodes, cpus, gpus, tdir, object_store_mb))
        except BaseException:
            local_ray.restore_env("RAY_TMPDIR", saved_tmpdir)
            if made_temp:
                shutil.rmtree(tdir, ignore_errors=True)
                procs.unregister(os.getpid(), kind="dir")
            raise
        address = ray.get_runtime_context().gcs_address
        self = cls(
            address=address,
            owned=True,
            simulate=simulate,
            temp_dir=tdir if made_temp else None,
            sim_cluster=sim,
            topology=topology,
        )
        self._saved_tmpdir = saved_tmpdir
        self._register_ray_processes()
        log.info(
            "started Ray at %s (%d node(s), simulate=%s) in %.1f s", address, nodes, simulate, time.monotonic() - t0
        )
        return self

    @classmethod
    def join(cls, address: str, *, probe_timeout: float | None = None, survey: bool = True) -> "Cluster":
        """Connect to an existing cluster at ``address`` (``host:port``); it is never stopped by us.

        Args:
            address: the head's GCS address.
            probe_timeout: seconds for the GCS to answer the up-front probe (Ray itself would retry
                for minutes, or abort this process when token auth has no token); default
                :func:`harness.cluster.join.probe_timeout` (``HARNESS_JOIN_TIMEOUT``, else 15).
            survey: ask every node for its versions and GPU devices (``cluster.facts``).

        Raises:
            RuntimeError: this process is already connected to a Ray cluster.
            harness.cluster.join.JoinError: cannot join, classified (a ``ConnectionError``; its message is
                one line with the fix), or what travels with the run could not be uploaded (kind ``carry``).
        """
        for k, v in _RAY_ENV.items():
            os.environ.setdefault(k, v)
        import ray

        join_mod.probe(address, timeout=probe_timeout)
        if ray.is_initialized():
            raise RuntimeError("this process is already connected to Ray; shut it down first")
        procs.claim()
        join_mod.connect(address)  # carries the harness and a tree or wheel target to the nodes
        self = cls(address=ray.get_runtime_context().gcs_address, owned=False, simulate=False, temp_dir=None)
        if survey:
            self.facts = tuple(node_facts.survey())
        return self

    @property
    def gpu_kind(self) -> str:
        """The cluster's GPUs: ``logical`` when simulated or a joined node lacks its devices, ``real``,
        ``none`` (no GPU resources), ``unknown`` (joined without a survey, or a node did not answer)."""
        if self.simulate:
            return "logical"
        if self.owned:
            return "real" if local_gpus() else "none"
        return node_facts.gpu_kind(list(self.facts)) if self.facts else "unknown"

    def starts_forked(self, kind: Kind, topology: Topology) -> bool:
        """Whether processes of ``kind`` (``rank``, ``server``) for ``topology`` start on this cluster as
        forks of a preloaded fork server (:func:`harness.workers.forkserver.policy.forks`): this
        machine started the cluster, and they drive no real GPU (simulated GPUs are logical)."""
        return forks(kind, real_devices=topology.needs_gpus and not self.simulate, local=self.owned)

    def _register_ray_processes(self) -> None:
        import ray

        nodes = [ray._private.worker._global_node] if self._sim_cluster is None else self._sim_cluster.list_all_nodes()
        for node in nodes:
            for kind, infos in getattr(node, "all_processes", {}).items():
                for info in infos:
                    pid = info.process.pid
                    self._pids.append(pid)
                    procs.register(pid, label=f"ray {kind}")

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- inspection

    def nodes(self) -> list[NodeInfo]:
        """The alive nodes, harness-indexed ones first in index order."""
        return alive_nodes()

    def node_index(self, node_id: str) -> int | None:
        """The topology node index of a Ray node id (None if it has no harness index)."""
        return next((n.index for n in self.nodes() if n.node_id == node_id), None)

    # ---------------------------------------------------------------- placement

    def check(self, topology: Topology, timeout: float = 5.0) -> Fit:
        """Say whether ``topology`` fits this cluster now; remove the trial placement groups again
        (:meth:`Placements.check <harness.cluster.placement.Placements.check>`).

        Returns:
            The :class:`Fit`; ``fit.ok`` is False with the state and missing resource otherwise.
        """
        return self._placements.check(topology, timeout)

    def place(self, topology: Topology, timeout: float = 30.0, label: str = "") -> Placement:
        """Create one STRICT_PACK placement group per role group and wait until all are placed
        (:meth:`Placements.place <harness.cluster.placement.Placements.place>`); :meth:`shutdown`
        releases what is not released before.

        Raises:
            PlacementError: a group is infeasible or not placed in time (partial groups removed).
        """
        return self._placements.place(topology, timeout, label)

    def release(self, placement: Placement) -> None:
        """Remove the placement groups of ``placement`` (actors in them are killed by Ray)."""
        self._placements.release(placement)

    # ---------------------------------------------------------------- teardown

    def shutdown(self, timeout: float = 15.0) -> None:
        """Release placements; if we started the cluster, stop it and verify its processes are gone.

        A joined cluster is only disconnected from. Safe to call twice.

        Raises:
            RuntimeError: processes of the cluster were still running after ``timeout`` (they are
                then killed, and named in the message).
        """
        if self._closed:
            return
        self._closed = True
        import ray

        self._placements.release_all()
        if not self.owned:
            ray.shutdown()
            return
        tree = [d for p in self._pids for d in procs.descendants(p)]
        ray.shutdown()
        if self._sim_cluster is not None:
            self._sim_cluster.shutdown()
            local_ray.restore_env("RAY_TMPDIR", self._saved_tmpdir)
        left = procs.wait_gone(self._pids + tree, timeout)
        for pid in left:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        for pid in self._pids:
            procs.unregister(pid)
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            procs.unregister(os.getpid(), kind="dir")
        if left:
            raise RuntimeError(f"Ray processes still running {timeout:.0f} s after shutdown (killed): {left}")
