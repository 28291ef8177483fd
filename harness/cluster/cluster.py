"""The Ray cluster a run uses, and the placement groups a topology needs on it.

A :class:`Cluster` is either *started* by the harness (the embedded default: a local Ray with the
dashboard off, quiet logs and a short temp dir) or *joined* (``--ray-address``: a real, possibly
multi-node cluster). The harness only ever stops a cluster it started.

Simulation (``simulate=True``) gives a CPU machine the topology's GPUs as Ray *logical* GPUs. A
one-node topology becomes one local Ray node with ``gpus_per_node`` GPUs; a multi-node topology
becomes a ``ray.cluster_utils.Cluster`` with one Ray node per topology node. Every node started by
the harness carries the custom resource ``harness_node_<i>`` so a role with ``node = i`` is pinned
there. A joined cluster names its nodes with the same resource or, the Ray 2.60 way, with the node
label ``pd-harness/node=<i>`` (``ray start --labels pd-harness/node=1``; pinned through the
placement group's ``bundle_label_selector``); otherwise pinning uses the i-th node's ``node:<ip>``
resource.

Joining (``Cluster.join``) is checked first by :func:`harness.cluster.join.probe` (one classified
:class:`harness.cluster.join.JoinError` when it cannot work: unreachable, refused auth, version mismatch),
and then every node is asked for its versions and GPU devices (:func:`harness.cluster.nodes.survey`:
``cluster.facts``, ``cluster.gpu_kind`` says whether its GPUs are ``real`` or ``logical``).

Placement: one placement group per role group (``RoleSpec.groups`` = count × dp), one bundle per TP
rank, ``STRICT_PACK`` so a TP group sits on one node. On a cluster the harness started, a one-node
topology is kept on node 0 (so a simulated cluster shaped for the largest topology still places a
small one the way its real runner would). :meth:`Cluster.check` tells within ``timeout``
(5 s by default) whether a topology fits and, if not, which resource is missing, using the
scheduling state Ray records in ``placement_group_table`` (``INFEASIBLE``: the cluster can never
hold it; ``NO_RESOURCES``: it could, but the resources are in use now).

API::

    Cluster.start(topology=None, *, simulate=False, nodes=None, gpus_per_node=None, num_cpus=None,
                  temp_dir=None) -> Cluster
    Cluster.join(address) -> Cluster
    cluster.check(topology, timeout=5.0) -> Fit           # never raises for "does not fit"
    cluster.place(topology, timeout=30.0) -> Placement    # raises PlacementError (carries the Fit)
    cluster.release(placement)                            # removes its placement groups
    cluster.shutdown(timeout=15.0)                        # stops what we started; verifies no process is left
    placement.of("prefill") -> tuple[GroupPlacement, ...] # one per group; .pg, .bundles, .node_ids()

Example::

    from harness import topology
    from harness.cluster import Cluster

    topo = topology.get("2-gpu-h100")
    with Cluster.start(topo, simulate=True) as cluster:
        fit = cluster.check(topo)            # Fit(ok=True, state='CREATED', ...)
        placement = cluster.place(topo)
        prefill = placement.of("prefill")[0] # GroupPlacement: .pg, .bundles, .strategy
        ...                                  # start workers in it (harness.workers.start_worker)
        cluster.release(placement)
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.cluster import join as join_mod
from harness.cluster import nodes as node_facts
from harness.cluster.nodes import local_gpus
from harness.topology import RoleSpec, Topology
from harness.workers import procs
from harness.workers.nodes import NODE_LABEL, NODE_RESOURCE, node_index

log = logging.getLogger(__name__)

#: Amount of ``harness_node_<i>`` each harness-started node has; bundles take a tiny slice of it.
_NODE_RESOURCE_AMOUNT = 1000.0
_NODE_RESOURCE_SLICE = 0.001
#: Logical CPUs per harness-started node: actors take 0.1, so this holds many; kept small because
#: Ray may prestart one Python worker per CPU on a 2-core machine.
DEFAULT_NUM_CPUS = 4
#: Object store of each harness-started node (MiB). Small and allocated up front: Ray otherwise
#: sizes it at 30% of RAM and maps its pages lazily, and the page faults on every fresh object
#: halve the P→D transfer rate (bench/transfer.py). Larger objects spill to disk, not fail.
DEFAULT_OBJECT_STORE_MB = 512
_POLL_S = 0.05
_SETTLE_S = 0.5  # a NO_RESOURCES shortage must last this long to be the verdict

# Ray's environment: set before ray is imported anywhere in a run started by the harness.
_RAY_ENV = {
    "RAY_DEDUP_LOGS": "0",
    "RAY_SCHEDULER_EVENTS": "0",  # no "(autoscaler) Error: no node types..." lines on the driver
    "RAY_USAGE_STATS_ENABLED": "0",
}


class PlacementError(RuntimeError):
    """A topology could not be placed within the timeout. ``fit`` says which resource is missing."""

    def __init__(self, fit: "Fit"):
        super().__init__(str(fit))
        self.fit = fit


@dataclass(frozen=True)
class Fit:
    """Whether a topology fits the cluster.

    ``state`` is ``CREATED`` when every group was placed, else the first failing group's scheduling
    state from ``placement_group_table`` (``INFEASIBLE``, ``NO_RESOURCES``, or ``PENDING`` when Ray
    had not decided by the deadline). ``missing`` names the resource, e.g. ``"GPU: needs 2 on one
    node, the largest node has 0"``.
    """

    topology: str
    ok: bool
    state: str
    group: str = ""
    missing: str = ""
    seconds: float = 0.0

    def __str__(self) -> str:
        if self.ok:
            return f"{self.topology}: fits ({self.seconds:.1f} s)"
        return f"{self.topology}: {self.state}: group {self.group}: {self.missing}"


@dataclass(frozen=True)
class GroupPlacement:
    """One placement group: a TP group of one role (one bundle per rank)."""

    role: str
    kind: str
    index: int
    pg: Any  # ray.util.placement_group.PlacementGroup
    bundles: tuple[dict[str, float], ...]
    strategy: str
    node: int | None
    labels: tuple[tuple[str, str], ...] = ()  # the node label every bundle must sit on (a joined cluster's pin)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def node_ids(self) -> list[str]:
        """Ray node id (hex) of each bundle, in bundle order (the group must be placed)."""
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(self.pg)
        return [table["bundles_to_node_id"][i] for i in range(len(self.bundles))]


@dataclass(frozen=True)
class Placement:
    """All placement groups of a topology on a cluster, in role order."""

    topology: Topology
    groups: tuple[GroupPlacement, ...]

    def of(self, role: str) -> tuple[GroupPlacement, ...]:
        """The groups of ``role`` (a role name such as ``prefill``).

        Raises:
            KeyError: the topology has no such role.
        """
        self.topology.role(role)
        return tuple(g for g in self.groups if g.role == role)


@dataclass(frozen=True)
class NodeInfo:
    """One alive Ray node, with its harness index (``harness_node_<i>``) when it has one."""

    node_id: str
    ip: str
    index: int | None
    total: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


def _short_temp_dir() -> Path:
    # Ray puts AF_UNIX sockets under it: the path must stay far below 107 bytes.
    return Path(tempfile.mkdtemp(prefix="ph-", dir="/tmp" if Path("/tmp").is_dir() else None))


class Cluster:
    """A Ray cluster the harness started or joined. Build it with :meth:`start` or :meth:`join`."""

    def __init__(self, *, address: str, owned: bool, simulate: bool, temp_dir: Path | None,
                 sim_cluster: Any = None, topology: Topology | None = None):
        self.address = address
        self.owned = owned
        self.simulate = simulate
        self.topology = topology
        self._temp_dir = temp_dir
        self._sim_cluster = sim_cluster
        self._placements: list[Placement] = []
        self._pids: list[int] = []
        self._closed = False
        self._saved_tmpdir: str | None = os.environ.get("RAY_TMPDIR")
        #: What each node said when joined (:func:`harness.cluster.nodes.survey`); empty for a started cluster.
        self.facts: tuple[node_facts.NodeFacts, ...] = ()

    # ---------------------------------------------------------------- construction

    @classmethod
    def start(cls, topology: Topology | None = None, *, simulate: bool = False, nodes: int | None = None,
              gpus_per_node: int | None = None, num_cpus: float | None = None,
              temp_dir: str | Path | None = None, object_store_mb: int = DEFAULT_OBJECT_STORE_MB) -> "Cluster":
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
        _own_token()
        procs.reap_stale()
        # The driver owns the cluster: if it is SIGKILLed, the next run reaps what is left.
        procs.claim()
        made_temp = temp_dir is None
        tdir = Path(temp_dir) if temp_dir else _short_temp_dir()
        tdir.mkdir(parents=True, exist_ok=True)
        if made_temp:
            procs.register(os.getpid(), kind="dir", label="ray temp dir", path=tdir)
        cpus = num_cpus if num_cpus is not None else (topology.cpus_per_node if topology and topology.cpus_per_node else DEFAULT_NUM_CPUS)
        if nodes is None:
            nodes = topology.nodes if topology else 1
        if gpus_per_node is None:
            gpus_per_node = topology.gpus_per_node if topology else 0
        gpus = gpus_per_node if simulate else None
        t0 = time.monotonic()
        sim = None
        saved_tmpdir = os.environ.get("RAY_TMPDIR")
        try:
            if nodes == 1:
                kwargs: dict[str, Any] = dict(
                    include_dashboard=False, logging_level="ERROR", _temp_dir=str(tdir), num_cpus=cpus,
                    resources={NODE_RESOURCE.format(0): _NODE_RESOURCE_AMOUNT}, log_to_driver=False,
                    object_store_memory=object_store_mb << 20,
                    _system_config={"preallocate_plasma_memory": True},
                )
                if gpus is not None:
                    kwargs["num_gpus"] = gpus
                ray.init(**kwargs)
            else:
                from ray.cluster_utils import Cluster as RayCluster

                # cluster_utils writes the cluster address to <RAY_TMPDIR>/ray/ray_current_cluster:
                # keep it inside our own temp dir so no other Ray user on the machine is redirected.
                os.environ["RAY_TMPDIR"] = str(tdir)
                (tdir / "ray").mkdir(exist_ok=True)
                sim = RayCluster(initialize_head=False, shutdown_at_exit=True)
                for i in range(nodes):
                    args: dict[str, Any] = dict(num_cpus=cpus, resources={NODE_RESOURCE.format(i): _NODE_RESOURCE_AMOUNT},
                                                object_store_memory=object_store_mb << 20)
                    if gpus is not None:
                        args["num_gpus"] = gpus
                    if i == 0:
                        args.update(include_dashboard=False)
                    sim.add_node(wait=False, **args)
                sim.wait_for_nodes(timeout=60)
                ray.init(address=sim.address, logging_level="ERROR", log_to_driver=False)
        except BaseException:
            if sim is not None:
                sim.shutdown()
            if ray.is_initialized():
                ray.shutdown()
            _restore_env("RAY_TMPDIR", saved_tmpdir)
            if made_temp:
                shutil.rmtree(tdir, ignore_errors=True)
                procs.unregister(os.getpid(), kind="dir")
            raise
        address = ray.get_runtime_context().gcs_address
        self = cls(address=address, owned=True, simulate=simulate, temp_dir=tdir if made_temp else None,
                   sim_cluster=sim, topology=topology)
        self._saved_tmpdir = saved_tmpdir
        self._register_ray_processes()
        log.info("started Ray at %s (%d node(s), simulate=%s) in %.1f s", address, nodes, simulate, time.monotonic() - t0)
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
                one line with the fix).
        """
        for k, v in _RAY_ENV.items():
            os.environ.setdefault(k, v)
        import ray

        join_mod.probe(address, timeout=probe_timeout)
        if ray.is_initialized():
            raise RuntimeError("this process is already connected to Ray; shut it down first")
        procs.claim()
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
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
        import ray

        out = []
        for n in ray.nodes():
            if not n.get("Alive"):
                continue
            res = dict(n.get("Resources", {}))
            labels = dict(n.get("Labels") or {})
            out.append(NodeInfo(node_id=n["NodeID"], ip=n.get("NodeManagerAddress", ""),
                                index=node_index(res, labels), total=res, labels=labels))
        return sorted(out, key=lambda n: (n.index is None, n.index if n.index is not None else 0, n.node_id))

    def node_index(self, node_id: str) -> int | None:
        """The topology node index of a Ray node id (None if it has no harness index)."""
        return next((n.index for n in self.nodes() if n.node_id == node_id), None)

    def _pin(self, node: int) -> str | tuple[str, str]:
        """How to pin to topology node ``node``: a resource name, or a node label (key, value)."""
        nodes = self.nodes()
        indexed = [n for n in nodes if n.index == node]
        if any(NODE_RESOURCE.format(node) in n.total for n in indexed):
            return NODE_RESOURCE.format(node)
        if indexed:
            return (NODE_LABEL, str(node))
        if node < len(nodes):
            return f"node:{nodes[node].ip}"
        raise PlacementError(Fit(self.topology.name if self.topology else "?", False, "INFEASIBLE",
                                 missing=f"node {node}: the cluster has {len(nodes)} node(s)"))

    # ---------------------------------------------------------------- placement

    def _node_of(self, topo: Topology, role: RoleSpec) -> int | None:
        """The node a role is pinned to: its own ``node``; on a cluster we started, a one-node
        topology keeps all its roles on node 0 (a simulated cluster may have more nodes than it)."""
        if role.node is not None:
            return role.node
        return 0 if self.owned and topo.nodes == 1 else None

    def _bundles(self, role: RoleSpec, node: int | None) -> tuple[list[dict[str, float]], tuple[tuple[str, str], ...]]:
        """The role's bundles, pinned to ``node``: by a slice of its resource, or by its label."""
        bundles = role.bundles()
        if node is None:
            return bundles, ()
        pin = self._pin(node)
        if isinstance(pin, tuple):
            return bundles, (pin,)
        for b in bundles:
            b[pin] = _NODE_RESOURCE_SLICE
        return bundles, ()

    def _create(self, topo: Topology, tag: str) -> list[GroupPlacement]:
        from ray.util.placement_group import placement_group

        # Every group's bundles first: a topology naming a node the cluster lacks fails before
        # any group exists (creating one and removing it at once can leak its resources in Ray).
        planned = []
        for role in topo.roles:
            node = self._node_of(topo, role)
            for i in range(role.groups):
                try:
                    planned.append((role, i, node, *self._bundles(role, node)))
                except PlacementError as e:
                    raise PlacementError(Fit(topo.name, False, e.fit.state, group=f"{role.name}-{i}", missing=e.fit.missing)) from None
        groups = []
        for role, i, node, bundles, labels in planned:
            selector = [dict(labels) for _ in bundles] if labels else None
            pg = placement_group(bundles, strategy="STRICT_PACK", name=f"{tag}{topo.name}/{role.name}-{i}",
                                 bundle_label_selector=selector)
            groups.append(GroupPlacement(role=role.name, kind=role.kind, index=i, pg=pg,
                                         bundles=tuple(bundles), strategy="STRICT_PACK", node=node, labels=labels))
        return groups

    def _wait(self, topo: Topology, groups: list[GroupPlacement], timeout: float, settle_on_no_resources: bool) -> Fit:
        """Poll ``placement_group_table`` until all groups are created, one is infeasible, or the deadline.

        Ray also reports ``NO_RESOURCES`` for a moment while it commits a sibling group, so with
        ``settle_on_no_resources`` a ``NO_RESOURCES`` verdict is returned early only when a resource
        the group needs is really short on every node now.
        """
        from ray.util.placement_group import placement_group_table

        t0 = time.monotonic()
        deadline = t0 + timeout
        short_since: float | None = None
        while True:
            states = []
            for g in groups:
                t = placement_group_table(g.pg)
                states.append((g, t["state"], t["stats"]["scheduling_state"]))
            if all(s == "CREATED" for _, s, _ in states):
                return Fit(topo.name, True, "CREATED", seconds=time.monotonic() - t0)
            bad = [(g, sched) for g, s, sched in states if s != "CREATED"]
            infeasible = [g for g, sched in bad if sched == "INFEASIBLE"]
            now = time.monotonic()
            if infeasible:
                g = infeasible[0]
                return Fit(topo.name, False, "INFEASIBLE", group=g.name, missing=self._missing(g, "INFEASIBLE"), seconds=now - t0)
            short = None
            if settle_on_no_resources and all(sched == "NO_RESOURCES" for _, sched in bad):
                short = next(((g, m) for g, _ in bad if (m := self._shortage(g))), None)
            if short is None:
                short_since = None
            else:
                # Resources of just-removed groups come back a moment later: the shortage must last.
                short_since = short_since if short_since is not None else now
                if now - short_since >= _SETTLE_S:
                    return Fit(topo.name, False, "NO_RESOURCES", group=short[0].name, missing=short[1], seconds=now - t0)
            if now >= deadline:
                g, sched = bad[0]
                state = sched if sched == "NO_RESOURCES" else "PENDING"
                return Fit(topo.name, False, state, group=g.name, missing=self._missing(g, state), seconds=now - t0)
            time.sleep(_POLL_S)

    @staticmethod
    def _need(g: GroupPlacement) -> dict[str, float]:
        need: dict[str, float] = {}
        for b in g.bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0.0) + v
        return need

    def _eligible(self, g: GroupPlacement, totals: dict[str, dict[str, float]]) -> set[str]:
        """Nodes that may hold ``g``: those with its pin resource and its label (all when unpinned)."""
        need = self._need(g)
        pins = [k for k in need if k.startswith("harness_node_") or k.startswith("node:")]
        labelled = {n.node_id for n in self.nodes() if all(n.labels.get(k) == v for k, v in g.labels)}
        return {n for n, r in totals.items() if all(k in r for k in pins) and n in labelled}

    def _shortage(self, g: GroupPlacement) -> str | None:
        """The resource ``g`` needs on one node that no eligible node has free now, or None.

        Eligible: nodes that have the group's pin resource or label (all nodes when it is not pinned).
        """
        import ray

        need = self._need(g)
        totals = ray._private.state.total_resources_per_node()
        eligible = self._eligible(g, totals)
        avail = {n: r for n, r in ray._private.state.available_resources_per_node().items() if n in eligible}
        for key in sorted(need, key=lambda k: (k != "GPU", k)):
            best_free = max((r.get(key, 0.0) for r in avail.values()), default=0.0)
            if best_free + 1e-9 < need[key]:
                return (f"{_resource_name(key)}: needs {_fmt(need[key])} on one node, at most {_fmt(best_free)} free now "
                        "(in use by other placement groups or actors)")
        return None

    def _missing(self, g: GroupPlacement, state: str) -> str:
        """Name the resource a group lacks: the first one no node can (or now does) provide."""
        import ray

        need = self._need(g)
        totals = ray._private.state.total_resources_per_node()
        if g.labels:  # a label-pinned group can only ever use its labelled node(s)
            eligible = self._eligible(g, totals)
            totals = {n: r for n, r in totals.items() if n in eligible}
        where = f" labelled {', '.join(f'{k}={v}' for k, v in g.labels)}" if g.labels else ""
        for key in sorted(need, key=lambda k: (k != "GPU", k)):
            best_total = max((r.get(key, 0.0) for r in totals.values()), default=0.0)
            if best_total + 1e-9 < need[key]:
                return f"{_resource_name(key)}: needs {_fmt(need[key])} on one node{where}, the largest node has {_fmt(best_total)}"
        short = self._shortage(g)
        if short:
            return short
        listing = ", ".join(f"{_resource_name(k)} {_fmt(v)}" for k, v in need.items())
        if state == "INFEASIBLE":
            return "no single node holds all of " + listing
        return "the resources exist but were not granted in time: " + listing

    def check(self, topology: Topology, timeout: float = 5.0) -> Fit:
        """Say whether ``topology`` fits this cluster now; remove the trial placement groups again.

        Args:
            topology: what to fit.
            timeout: seconds to wait for Ray's decision (a group still undecided is ``PENDING``).

        Returns:
            The :class:`Fit`; ``fit.ok`` is False with the state and missing resource otherwise.
        """
        try:
            groups = self._create(topology, "harness-check:")
        except PlacementError as e:
            return e.fit
        try:
            return self._wait(topology, groups, timeout, settle_on_no_resources=True)
        finally:
            self._remove(groups)

    def place(self, topology: Topology, timeout: float = 30.0, label: str = "") -> Placement:
        """Create one STRICT_PACK placement group per role group and wait until all are placed.

        Args:
            topology: what to place.
            timeout: seconds for all groups to be created.
            label: tells this placement's group names apart from another placement of the same
                topology in this cluster (group names are unique in Ray).

        Returns:
            The :class:`Placement`; release it with :meth:`release` (shutdown releases the rest).

        Raises:
            PlacementError: a group is infeasible or not placed in time (partial groups removed).
        """
        groups = self._create(topology, f"harness:{label}:" if label else "harness:")
        fit = self._wait(topology, groups, timeout, settle_on_no_resources=False)
        if not fit.ok:
            self._remove(groups)
            raise PlacementError(fit)
        placement = Placement(topology=topology, groups=tuple(groups))
        self._placements.append(placement)
        return placement

    def release(self, placement: Placement) -> None:
        """Remove the placement groups of ``placement`` (actors in them are killed by Ray)."""
        self._remove(list(placement.groups))
        if placement in self._placements:
            self._placements.remove(placement)

    @staticmethod
    def _remove(groups: list[GroupPlacement], timeout: float = 5.0) -> None:
        """Remove the groups and wait (bounded) until Ray reports them REMOVED.

        Groups that are not CREATED are first let settle (their state unchanged for a moment):
        removing a group while Ray is still preparing its bundles on a node (e.g. the feasible
        sibling of an infeasible group, removed the instant the sibling's verdict is known) leaks
        those bundles' resources for good — seen with Ray 2.60: a node's 8 GPUs stayed "in use"
        with no group holding them, and every later placement on the node failed.
        """
        from ray.util.placement_group import placement_group_table, remove_placement_group

        deadline = time.monotonic() + timeout
        last: dict[int, tuple[str, str]] = {}
        stable_since = time.monotonic()
        while time.monotonic() < deadline:
            try:
                now_states = {}
                for i, g in enumerate(groups):
                    t = placement_group_table(g.pg)
                    now_states[i] = (t["state"], t["stats"]["scheduling_state"])
            except Exception as e:  # Ray gone: nothing to settle
                log.debug("settle before removal: %s", e)
                break
            if now_states != last:
                last, stable_since = now_states, time.monotonic()
            busy = any(st == "PREPARED" or sched in ("QUEUED", "SCHEDULING_STARTED") for st, sched in now_states.values())
            if all(st == "CREATED" for st, _ in now_states.values()) or (
                    not busy and time.monotonic() - stable_since >= _SETTLE_S):
                break
            time.sleep(_POLL_S)
        for g in groups:
            try:
                remove_placement_group(g.pg)
            except Exception as e:  # already removed, or Ray gone: nothing left to free
                log.debug("remove %s: %s", g.name, e)
        deadline = time.monotonic() + timeout
        for g in groups:
            try:
                while placement_group_table(g.pg)["state"] != "REMOVED" and time.monotonic() < deadline:
                    time.sleep(_POLL_S)
            except Exception as e:  # Ray gone
                log.debug("wait for removal of %s: %s", g.name, e)

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

        for p in list(self._placements):
            self.release(p)
        if not self.owned:
            ray.shutdown()
            return
        tree = [d for p in self._pids for d in procs.descendants(p)]
        ray.shutdown()
        if self._sim_cluster is not None:
            self._sim_cluster.shutdown()
            _restore_env("RAY_TMPDIR", self._saved_tmpdir)
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


def _own_token() -> None:
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


def _restore_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _resource_name(key: str) -> str:
    if key.startswith("harness_node_"):
        return f"node {key.rsplit('_', 1)[1]} (resource {key})"
    return key


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"
