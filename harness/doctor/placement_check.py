"""Placement checks: the topology fits the cluster, and each role group landed where it should with
the GPUs it asked for. Pure functions over the cluster's :class:`~harness.cluster.Fit` and what the
probes report about themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.doctor.result import CheckResult, Status
from harness.topology import Topology


@dataclass(frozen=True)
class BundleSeat:
    """Where one bundle (one TP rank) of a role group sat, as its probe saw it."""

    role: str
    group: str  # e.g. "prefill-0"
    rank: int
    node: str  # node label
    node_index: int | None  # harness node index (harness_node_<i>), None when the node has none
    gpu_ids: tuple[str, ...]


def fit_row(topology: Topology, ok: bool, state: str, group: str, missing: str, cluster: str) -> CheckResult:
    """The ``placement.fit`` row from the cluster's fit check.

    Args:
        topology: what was placed.
        ok, state, group, missing: the :class:`~harness.cluster.Fit` fields.
        cluster: how the cluster was reached (for the detail).

    Returns:
        One row; on failure its fix names the missing resource.
    """
    if ok:
        return CheckResult("placement.fit", Status.PASSED, f"{topology.requirement} fits {cluster}", node="all")
    if state == "INFEASIBLE":
        fix = (
            f"run on a cluster that has it ({topology.requirement}), add the missing node/GPUs to Ray, "
            "or --simulate on a CPU machine"
        )
    else:
        fix = "the resources exist but are taken: stop the runs or actors holding them (`ray status`) and rerun"
    return CheckResult("placement.fit", Status.FAILED, f"{state}: group {group}: {missing}", fix, node="all")


def simulation_refused_row(topology: Topology) -> CheckResult:
    return CheckResult(
        "placement.fit",
        Status.FAILED,
        f"{topology.name} sets allow_simulation = false",
        f"run it on {topology.requirement}",
        node="all",
    )


def seat_rows(topology: Topology, seats: list[BundleSeat]) -> list[CheckResult]:
    """One ``placement.group`` row per role group: its node and GPUs, checked against the topology.

    A group fails when its ranks are on more than one node (a TP group must be packed), when a
    rank got a different number of GPUs than ``gpus_per_rank``, or when a pinned role sits on
    another node than ``node``.

    Args:
        topology: the roles' specs.
        seats: one per probed bundle.

    Returns:
        The rows, in group order.
    """
    rows = []
    groups: dict[str, list[BundleSeat]] = {}
    for s in seats:
        groups.setdefault(s.group, []).append(s)
    for name, members in groups.items():
        members.sort(key=lambda s: s.rank)
        role = topology.role(members[0].role)
        nodes = sorted({s.node for s in members})
        gpus = ",".join(g for s in members for g in s.gpu_ids) or "-"
        ranks = "; ".join(f"r{s.rank}: GPU {','.join(s.gpu_ids) or '-'}" for s in members)
        detail = f"{name} (tp {role.tp}) on {', '.join(nodes)}: {ranks}"
        problems = []
        if len(nodes) > 1:
            problems.append("its TP ranks are split across nodes")
        wrong = [s for s in members if len(s.gpu_ids) != role.gpus_per_rank]
        if wrong:
            problems.append(
                f"rank(s) {', '.join(str(s.rank) for s in wrong)} got a GPU count other than {role.gpus_per_rank}"
            )
        if role.node is not None and any(s.node_index is not None and s.node_index != role.node for s in members):
            problems.append(f"pinned to node {role.node} but placed elsewhere")
        if problems:
            rows.append(
                CheckResult(
                    "placement.group",
                    Status.FAILED,
                    f"{detail}: {'; '.join(problems)}",
                    "check the Ray node resources (`ray status`): GPU counts and harness_node_<i> "
                    "labels must match the topology's [cluster]",
                    node=nodes[0],
                    gpu=gpus,
                )
            )
        else:
            rows.append(CheckResult("placement.group", Status.PASSED, detail, node=nodes[0], gpu=gpus))
    return rows
