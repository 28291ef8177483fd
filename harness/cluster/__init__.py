"""The Ray cluster a run uses: started or joined, its nodes, and the placement groups a topology needs.

Modules: :mod:`.cluster` (the :class:`Cluster`: started, simulated or joined, and stopped again),
:mod:`.join` (whether this process can join a cluster it did not start, checked before joining),
:mod:`.nodes` (what each node holds: versions and GPUs, asked of every node at once),
:mod:`.placement` (a topology's placement groups). The public names are re-exported here.
"""

from harness.cluster.cluster import DEFAULT_NUM_CPUS, DEFAULT_OBJECT_STORE_MB, Cluster
from harness.cluster.nodes import NodeFacts, NodeInfo, local_gpus
from harness.cluster.placement import Fit, GroupPlacement, Placement, PlacementError, Placements
from harness.workers.node_ref import NODE_LABEL, NODE_RESOURCE

__all__ = [
    "DEFAULT_NUM_CPUS",
    "DEFAULT_OBJECT_STORE_MB",
    "NODE_LABEL",
    "NODE_RESOURCE",
    "Cluster",
    "Fit",
    "GroupPlacement",
    "NodeFacts",
    "NodeInfo",
    "Placement",
    "PlacementError",
    "Placements",
    "local_gpus",
]
