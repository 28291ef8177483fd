"""Which Ray node a worker runs on, and whether that node still answers.

:func:`node_index` reads a node's harness index back (:data:`NODE_RESOURCE` or :data:`NODE_LABEL`),
:class:`NodeRef` names a worker's node for its errors, and :func:`raylet_answers` knocks on the node's
raylet, because Ray lists a lost node as alive for about 15 s. Detail: docs/modules.md.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Mapping

#: The custom resource every node the harness starts carries (``harness_node_<i>``).
NODE_RESOURCE = "harness_node_{}"
#: The node label naming a Ray node's topology node index (``ray start --labels pd-harness/node=1``).
NODE_LABEL = "pd-harness/node"


@dataclass(frozen=True)
class NodeRef:
    """The Ray node a worker runs on: its id, its raylet's address and a readable label."""

    node_id: str
    ip: str
    port: int
    label: str

    def __str__(self) -> str:
        return f"{self.label} (Ray node {self.node_id[:12]}, raylet {self.ip}:{self.port})"


def node_index(resources: Mapping[str, float], labels: Mapping[str, str]) -> int | None:
    """A Ray node's topology node index: its ``harness_node_<i>`` resource, else its ``pd-harness/node`` label.

    >>> node_index({"CPU": 4.0, "harness_node_1": 1000.0}, {})
    1
    >>> node_index({"CPU": 4.0}, {"pd-harness/node": "2"})
    2
    >>> node_index({"CPU": 4.0}, {}) is None
    True
    """
    prefix = NODE_RESOURCE.format("")
    for key in resources:
        if key.startswith(prefix) and key.rsplit("_", 1)[1].isdigit():
            return int(key.rsplit("_", 1)[1])
    value = labels.get(NODE_LABEL, "")
    return int(value) if value.isdigit() else None


def raylet_answers(ip: str, port: int, timeout: float = 1.0) -> str | None:
    """None while a node's raylet accepts TCP connections, else why not (refused, timed out).

    Ray learns that a node is lost only when the GCS health check gives up on it (about 15 s with
    Ray's defaults) and lists it as alive until then; a raylet that is gone refuses connections at once.
    """
    try:
        socket.create_connection((ip, port), timeout=timeout).close()
        return None
    except OSError as e:
        return e.strerror or type(e).__name__


def node_of(node_id: str) -> NodeRef | None:
    """The :class:`NodeRef` of an alive Ray node (None when Ray does not list it as alive)."""
    import ray

    for n in ray.nodes():
        if n.get("NodeID") == node_id and n.get("Alive"):
            ip = n.get("NodeManagerAddress", "")
            index = node_index(dict(n.get("Resources", {})), n.get("Labels") or {})
            label = f"node{index}/{ip}" if index is not None else f"{ip}/{node_id[:6]}"
            return NodeRef(node_id, ip, int(n.get("NodeManagerPort") or 0), label)
    return None
