"""Topology loading: shipped files are valid, bad files give one clear error."""

from __future__ import annotations

import pytest

from harness import topology


@pytest.mark.parametrize("name", ["cpu", "2-gpu-h100", "8-gpu-h200", "2-node-16-gpu-h200"])
def test_shipped_topologies_load(name):
    t = topology.get(name)
    assert t.name == name
    assert {r.kind for r in t.roles} >= {"prefill", "decode"}
