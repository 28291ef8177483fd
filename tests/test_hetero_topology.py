"""The heterogeneous-PD topologies: each loads with its model's KV heads, and a TP those heads cannot be
sliced to is refused in one line naming the file, the key and the fix."""

from __future__ import annotations

import pytest

from harness import topology

HETERO = {
    "4-gpu-h100-tp1-tp2": (1, 2),
    "8-gpu-h100-tp1-tp4": (1, 4),
    "8-gpu-h200-tp2-tp4": (2, 4),
    "2-node-16-gpu-h200-tp4-tp8": (4, 8),
    "4-gpu-h100-dp-attention-dp2": (1, 1),
}


@pytest.mark.parametrize("name", sorted(HETERO))
def test_hetero_topologies_load_with_unequal_attention_tp(name):
    topo = topology.get(name)
    attn = (topo.roles_of("prefill")[0].attn_tp, topo.roles_of("decode")[0].attn_tp)
    assert attn == HETERO[name] and topo.kv_heads


def _toml(kv_heads: int, decode_tp: int, extra: str = "") -> str:
    return f"""name = "t"
runner = "r"
kv_heads = {kv_heads}
[cluster]
nodes = 1
gpus_per_node = 0
[roles.prefill]
tp = 1
gpus_per_rank = 0
[roles.decode]
tp = {decode_tp}
gpus_per_rank = 0
{extra}
"""


@pytest.mark.parametrize(
    "kv_heads, decode_tp, extra",
    [(3, 2, ""), (2, 3, ""), (4, 6, 'engine_args = ["--enable-dp-attention", "--dp-size", "2"]')],
    ids=["tp-2-over-3-heads", "tp-3-over-2-heads", "dp-attention-tp-6-dp-2-over-4-heads"],
)
def test_a_tp_the_kv_heads_cannot_be_sliced_to_is_refused_in_one_line(tmp_path, kv_heads, decode_tp, extra):
    path = tmp_path / "t.toml"
    path.write_text(_toml(kv_heads, decode_tp, extra))
    with pytest.raises(topology.TopologyError) as err:
        topology.load(path)
    text = str(err.value)
    assert "\n" not in text and text.startswith("t.toml: roles.decode.tp:") and "kv_heads" in text, text


def test_shared_heads_are_accepted(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(_toml(2, 8))
    assert topology.load(path).kv_heads == 2
