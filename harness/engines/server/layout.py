"""Where real sglang server processes sit on a topology: the placement shape Ray gets, and the plain baseline.

A real server is ONE process that drives every GPU of its TP group, and a Ray actor sees only its bundle's
GPUs, so :func:`server_layout` places one bundle per server process holding all its GPUs (the command line
still comes from the original topology). Where the plain baseline server goes in each case: docs/modules.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from harness.engines.server.launcher import SERVER_KINDS, LaunchError
from harness.topology import RoleSpec, Topology

PLAIN_ROLE = "plain"
#: Static memory fraction (weights + KV pool) of each of two servers sharing one GPU.
SHARED_GPU_MEM_FRACTION = "0.4"
_SHARE = 0.5


@dataclass(frozen=True)
class ServerLayout:
    """How a topology's real servers are placed.

    ``placement`` is what :meth:`harness.cluster.Cluster.place` gets; ``plain_role`` the placement role
    the plain baseline runs in beside the PD stack (None: unplaced on CPU, or in the prefill group
    after the stack stopped); ``extra_args`` more server flags per role (``decode``, ``plain``).
    """

    placement: Topology
    plain_role: str | None = None
    plain_beside_pd: bool = True
    extra_args: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def args_of(self, role: str) -> tuple[str, ...]:
        """Extra server flags of ``role`` (empty when it has none)."""
        return tuple(self.extra_args.get(role, ()))


def server_gpus(role: RoleSpec) -> int:
    """GPUs one server process of ``role`` drives: its TP group, times DP replicas unless attention-DP."""
    return role.tp * role.gpus_per_rank * (1 if role.dp_attention else role.dp)


def _one_bundle(role: RoleSpec, gpus: float) -> RoleSpec:
    return replace(role, tp=1, dp=1, dp_attention=False, gpus_per_rank=gpus)  # type: ignore[arg-type]


def server_layout(topology: Topology) -> ServerLayout:
    """Derive the placement of real server processes on ``topology``.

    Args:
        topology: a validated topology with prefill, decode and router roles.

    Returns:
        The :class:`ServerLayout` (``topology`` itself as placement when it has no GPUs).

    Raises:
        LaunchError: a server would need more GPUs than one node has (one process, one node), or a
            role has more than one instance (a stack starts one server per role).
    """
    if not topology.needs_gpus:
        return ServerLayout(placement=topology)
    roles: list[RoleSpec] = []
    for role in topology.roles:
        if role.kind not in SERVER_KINDS:
            roles.append(role)
            continue
        if role.count > 1:
            raise LaunchError(
                f"topology {topology.name}: {role.name} has {role.count} instances, and a real server stack "
                f"starts one server per role; run it simulated (the simulated engine starts every "
                f"instance) or use count = 1"
            )
        gpus = server_gpus(role)
        if gpus > topology.gpus_per_node:
            raise LaunchError(
                f"topology {topology.name}: a {role.name} server needs {gpus} GPUs in one process, "
                f"a node has {topology.gpus_per_node}; use a TP group that fits one node"
            )
        roles.append(_one_bundle(role, gpus))
    decode = topology.roles_of("decode")[0]
    plain_gpus = server_gpus(decode)
    # Spare GPUs on the decode node (one-node topologies: all of them; pinned roles: that node's).
    on_node = [r for r in topology.roles if r.kind in SERVER_KINDS and (topology.nodes == 1 or r.node == decode.node)]
    spare = topology.gpus_per_node - sum(server_gpus(r) * r.count for r in on_node)
    plain = RoleSpec(
        name=PLAIN_ROLE, kind=PLAIN_ROLE, gpus_per_rank=plain_gpus, node=decode.node, cpus_per_rank=decode.cpus_per_rank
    )
    if spare >= plain_gpus:
        return ServerLayout(placement=replace(topology, roles=(*roles, plain)), plain_role=PLAIN_ROLE)
    if plain_gpus == 1:
        shared = [_one_bundle(r, _SHARE) if r.name == decode.name else r for r in roles]
        fraction = ("--mem-fraction-static", SHARED_GPU_MEM_FRACTION)
        return ServerLayout(
            placement=replace(topology, roles=(*shared, _one_bundle(plain, _SHARE))),
            plain_role=PLAIN_ROLE,
            extra_args={"decode": fraction, PLAIN_ROLE: fraction},
        )
    return ServerLayout(placement=replace(topology, roles=tuple(roles)), plain_beside_pd=False)
