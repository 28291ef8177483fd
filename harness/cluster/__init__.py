"""The Ray cluster a run uses: started or joined, its nodes, and the placement groups a topology needs.

The public names are re-exported here; see :mod:`harness.cluster.cluster` and :mod:`harness.cluster.join`.
"""

from harness.cluster.cluster import (
    DEFAULT_NUM_CPUS,
    DEFAULT_OBJECT_STORE_MB,
    NODE_RESOURCE,
    Cluster,
    Fit,
    GroupPlacement,
    NodeInfo,
    Placement,
    PlacementError,
    local_gpus,
)

__all__ = ["DEFAULT_NUM_CPUS", "DEFAULT_OBJECT_STORE_MB", "NODE_RESOURCE", "Cluster", "Fit", "GroupPlacement",
           "NodeInfo", "Placement", "PlacementError", "local_gpus"]
