"""Placement groups: one per role group of a topology (``RoleSpec.groups`` = count × dp), one bundle
per TP rank, ``STRICT_PACK`` so a TP group sits on one node.

:class:`Placements` places a topology's groups (:meth:`~Placements.place`) or tells whether it fits and what is
missing (:meth:`~Placements.check`, :class:`Fit`), from Ray's scheduling state. Pinning to a node and the
one-node rule: docs/modules.md. Over 400 lines: placing and the fit check read the same Ray state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.clock import DEFAULT as DEFAULT_CLOCK
from harness.clock import Deadline
from harness.cluster.nodes import alive_nodes
from harness.topology import RoleSpec, Topology
from harness.workers.node_ref import NODE_LABEL, NODE_RESOURCE

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

log = logging.getLogger(__name__)

_NODE_RESOURCE_SLICE = 0.001


_POLL_S = 0.05


_SETTLE_S = 0.5  # a NO_RESOURCES shortage must last this long to be the verdict


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
    pg: "PlacementGroup"
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


def _resource_name(key: str) -> str:
    if key.startswith("harness_node_"):
        return f"node {key.rsplit('_', 1)[1]} (resource {key})"
    return key


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


class Placements:
    """The placement groups of one cluster: placed, checked and removed (see the module docstring).

    Args:
        owned: the cluster was started by the harness (a one-node topology is then kept on node 0).
    """

    def __init__(self, *, owned: bool) -> None:
        self.owned = owned
        #: Placements made and not released yet, in order.
        self.held: list[Placement] = []

    def _pin(self, node: int) -> str | tuple[str, str]:
        """How to pin to topology node ``node``: a resource name, or a node label (key, value)."""
        nodes = alive_nodes()
        indexed = [n for n in nodes if n.index == node]
        if any(NODE_RESOURCE.format(node) in n.total for n in indexed):
            return NODE_RESOURCE.format(node)
        if indexed:
            return (NODE_LABEL, str(node))
        if node < len(nodes):
            return f"node:{nodes[node].ip}"
        raise PlacementError(
            Fit("?", False, "INFEASIBLE", missing=f"node {node}: the cluster has {len(nodes)} node(s)")
        )

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
                    raise PlacementError(
                        Fit(topo.name, False, e.fit.state, group=f"{role.name}-{i}", missing=e.fit.missing)
                    ) from None
        groups = []
        for role, i, node, bundles, labels in planned:
            selector = [dict(labels) for _ in bundles] if labels else None
            pg = placement_group(
                bundles,
                strategy="STRICT_PACK",
                name=f"{tag}{topo.name}/{role.name}-{i}",
                bundle_label_selector=selector,
            )
            groups.append(
                GroupPlacement(
                    role=role.name,
                    kind=role.kind,
                    index=i,
                    pg=pg,
                    bundles=tuple(bundles),
                    strategy="STRICT_PACK",
                    node=node,
                    labels=labels,
                )
            )
        return groups

    def _wait(self, topo: Topology, groups: list[GroupPlacement], timeout: float, settle_on_no_resources: bool) -> Fit:
        """Poll ``placement_group_table`` until all groups are created, one is infeasible, or the deadline.

        Ray also reports ``NO_RESOURCES`` for a moment while it commits a sibling group, so with
        ``settle_on_no_resources`` a ``NO_RESOURCES`` verdict is returned early only when a resource
        the group needs is really short on every node now.
        """
        from ray.util.placement_group import placement_group_table

        t0 = DEFAULT_CLOCK.now()
        deadline = t0 + timeout
        short_since: float | None = None
        while True:
            states = []
            for g in groups:
                t = placement_group_table(g.pg)
                states.append((g, t["state"], t["stats"]["scheduling_state"]))
            if all(s == "CREATED" for _, s, _ in states):
                return Fit(topo.name, True, "CREATED", seconds=DEFAULT_CLOCK.now() - t0)
            bad = [(g, sched) for g, s, sched in states if s != "CREATED"]
            infeasible = [g for g, sched in bad if sched == "INFEASIBLE"]
            now = DEFAULT_CLOCK.now()
            if infeasible:
                g = infeasible[0]
                return Fit(
                    topo.name,
                    False,
                    "INFEASIBLE",
                    group=g.name,
                    missing=self._missing(g, "INFEASIBLE"),
                    seconds=now - t0,
                )
            short = None
            if settle_on_no_resources and all(sched == "NO_RESOURCES" for _, sched in bad):
                short = next(((g, m) for g, _ in bad if (m := self._shortage(g))), None)
            if short is None:
                short_since = None
            else:
                # Resources of just-removed groups come back a moment later: the shortage must last.
                short_since = short_since if short_since is not None else now
                if now - short_since >= _SETTLE_S:
                    return Fit(
                        topo.name, False, "NO_RESOURCES", group=short[0].name, missing=short[1], seconds=now - t0
                    )
            if now >= deadline:
                g, sched = bad[0]
                state = sched if sched == "NO_RESOURCES" else "PENDING"
                return Fit(topo.name, False, state, group=g.name, missing=self._missing(g, state), seconds=now - t0)
            DEFAULT_CLOCK.sleep(_POLL_S)

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
        labelled = {n.node_id for n in alive_nodes() if all(n.labels.get(k) == v for k, v in g.labels)}
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
                return (
                    f"{_resource_name(key)}: needs {_fmt(need[key])} on one node, at most {_fmt(best_free)} free now "
                    "(in use by other placement groups or actors)"
                )
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
                return (
                    f"{_resource_name(key)}: needs {_fmt(need[key])} on one node{where}, "
                    f"the largest node has {_fmt(best_total)}"
                )
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
            The :class:`Placement`; release it with :meth:`release` (:meth:`release_all` releases the rest).

        Raises:
            PlacementError: a group is infeasible or not placed in time (partial groups removed).
        """
        groups = self._create(topology, f"harness:{label}:" if label else "harness:")
        fit = self._wait(topology, groups, timeout, settle_on_no_resources=False)
        if not fit.ok:
            self._remove(groups)
            raise PlacementError(fit)
        placement = Placement(topology=topology, groups=tuple(groups))
        self.held.append(placement)
        return placement

    def release(self, placement: Placement) -> None:
        """Remove the placement groups of ``placement`` (actors in them are killed by Ray)."""
        self._remove(list(placement.groups))
        if placement in self.held:
            self.held.remove(placement)

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

        deadline = Deadline(timeout)
        last: dict[int, tuple[str, str]] = {}
        stable_since = DEFAULT_CLOCK.now()
        while not deadline.expired():
            try:
                now_states = {}
                for i, g in enumerate(groups):
                    t = placement_group_table(g.pg)
                    now_states[i] = (t["state"], t["stats"]["scheduling_state"])
            except Exception as e:  # Ray gone: nothing to settle
                log.debug("settle before removal: %s", e)
                break
            if now_states != last:
                last, stable_since = now_states, DEFAULT_CLOCK.now()
            busy = any(
                st == "PREPARED" or sched in ("QUEUED", "SCHEDULING_STARTED") for st, sched in now_states.values()
            )
            if all(st == "CREATED" for st, _ in now_states.values()) or (
                not busy and DEFAULT_CLOCK.now() - stable_since >= _SETTLE_S
            ):
                break
            deadline.sleep(_POLL_S)
        for g in groups:
            try:
                remove_placement_group(g.pg)
            except Exception as e:  # already removed, or Ray gone: nothing left to free
                log.debug("remove %s: %s", g.name, e)
        deadline = Deadline(timeout)
        for g in groups:
            try:
                while placement_group_table(g.pg)["state"] != "REMOVED" and not deadline.expired():
                    deadline.sleep(_POLL_S)
            except Exception as e:  # Ray gone
                log.debug("wait for removal of %s: %s", g.name, e)

    def release_all(self) -> None:
        """Release every placement still held."""
        for p in list(self.held):
            self.release(p)
