"""Topology loading: shipped files are valid, bad files give one clear error."""

from __future__ import annotations

import pytest

from harness import topology


@pytest.mark.parametrize(
    "name",
    [
        "cpu",
        "2-gpu-h100",
        "8-gpu-h200",
        "2-node-16-gpu-h200",
        "2-node-2-gpu-h100",
        "4-node-32-gpu-h200",
        "4-node-32-gpu-h200-dp-attention",
    ],
)
def test_shipped_topologies_load(name):
    t = topology.get(name)
    assert t.name == name
    assert {r.kind for r in t.roles} >= {"prefill", "decode"}


@pytest.mark.parametrize("name", ["4-node-32-gpu-h200", "4-node-32-gpu-h200-dp-attention"])
def test_the_32_gpu_topologies_are_two_node_sized_tp8_instances_per_role(name):
    """The shape ``bench/topology_scaling.py`` runs at 32 ranks, checked without starting them: each
    role has two placement groups of eight one-GPU ranks, and each group fills a node."""
    t = topology.get(name)
    assert (t.nodes, t.gpus_per_node, t.total_gpus) == (4, 8, 32)
    for kind in ("prefill", "decode"):
        (role,) = t.roles_of(kind)
        assert (role.groups, role.tp, role.gpus_per_group) == (2, 8, t.gpus_per_node)
        assert (role.dp, role.dp_attention) == ((8, True) if name.endswith("dp-attention") else (1, False))
    assert sum(r.groups * r.tp for r in t.roles if r.kind != "router") == 32
