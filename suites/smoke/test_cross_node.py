"""Smoke: on a two-node topology prefill sits on node 0 and decode on node 1, each with its own GPU.

Runs on a simulated two-node cluster, and on a joined one (``--ray-address``) whose nodes say which
topology node they are (resource ``harness_node_<i>`` or label ``pd-harness/node=<i>``).
"""

from __future__ import annotations

import pytest

from harness.api import InProcess

pytestmark = [pytest.mark.topology("2-node-2-gpu-h100"), pytest.mark.est_time(20)]


def test_prefill_and_decode_sit_on_their_own_nodes(pd_workers, ray_cluster, topology):
    prefill = pd_workers("prefill", InProcess(dict))
    decode = pd_workers("decode", InProcess(dict))

    assert prefill.info.node_id != decode.info.node_id
    for role, w in (("prefill", prefill), ("decode", decode)):
        assert ray_cluster.node_index(w.info.node_id) == topology.role(role).node, f"{role} on the wrong node"
        assert len(w.gpu_ids) == 1 and w.info.cuda_visible_devices == str(w.gpu_ids[0])
    # Each payload lives in its own worker on its own node.
    decode.call("update", side="decode")
    assert decode.call("get", "side") == "decode" and prefill.call("get", "side") is None
