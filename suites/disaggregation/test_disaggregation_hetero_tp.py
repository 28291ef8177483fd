"""Heterogeneous PD on the simulated engine: prefill and decode with unequal TP, and DP attention.

sglang's own mooncake code decides what moves (the decode rank's prefill TP ranks, the head slices each
prefill rank writes, the DP rank a request is dispatched to and the one its receiver binds to); the tests
derive by hand, from the model's KV heads and the two shapes, which heads each decode rank must own and
which prefill DP rank each request must come from, and compare every element with what prefill holds.

No real-server twin: sglang 0.5.23's CPU path runs no server with TP above 1 on this machine. With TP 2 its
scheduler first asks for ``SGLANG_CPU_OMP_THREADS_BIND`` (more ranks than NUMA nodes), and with that set it
dies building its TP group: ``init_model_parallel_group`` keeps PyNccl on for a CPU device
(``PyNcclCommunicator``: "Expected a cuda device, but got: cpu"). Measured with the launcher's plain CPU
command and ``--tp 2`` on tiny-llama; every shape here needs TP 2 on at least one side.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness.api import (
    HeteroModel,
    HeteroRefused,
    HeteroRequest,
    HeteroShape,
    hetero_check,
    hetero_content,
    hetero_start,
    hetero_transfer,
)

pytestmark = [pytest.mark.est_time(30), pytest.mark.timeout(300)]


def heads_by_hand(kv_heads: int, attn_tp: int, rank: int) -> list[int]:
    """The KV heads one attention-TP rank owns: ``kv_heads // attn_tp`` consecutive heads when there are at
    least as many heads as ranks; else each head is shared by ``attn_tp // kv_heads`` consecutive ranks
    (TP 4 over 2 heads: [0, 0, 1, 1], sgl#23746; TP 8 over 2: [0, 0, 0, 0, 1, 1, 1, 1])."""
    if attn_tp <= kv_heads:
        per = kv_heads // attn_tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (attn_tp // kv_heads)]


def _attn(role):
    return role.tp // role.dp if role.dp_attention else role.tp


def _check_request(pair, rid, prompt_len, kv_heads, decode_ranks, prefill_dp, p_attn, d_attn, layers):
    """Every decode rank of ``decode_ranks`` holds exactly its heads of ``rid``, element for element equal to
    what the prefill ranks of DP rank ``prefill_dp`` hold for those heads."""
    pos = np.arange(prompt_len)
    prefill_kv = {}
    for t in range(p_attn):
        got = pair.readback("prefill", prefill_dp * p_attn + t, rid)["kv"]
        for slot, head in enumerate(heads_by_hand(kv_heads, p_attn, t)):
            prefill_kv.setdefault(head, got[:, :, :, slot])
    for rank in decode_ranks:
        want_heads = heads_by_hand(kv_heads, d_attn, rank % d_attn)
        kv = pair.readback("decode", rank, rid)["kv"]
        assert kv.shape[3] == len(want_heads), f"decode rank {rank} holds {kv.shape[3]} head slots, owns {want_heads}"
        for slot, head in enumerate(want_heads):
            for layer in range(layers):
                for k_or_v in (0, 1):
                    want = hetero_content(rid, layer, k_or_v, head, pos, kv.shape[4])
                    got = kv[layer, k_or_v, :, slot]
                    if not np.array_equal(got, want):
                        bad = int(np.flatnonzero((got != want).any(axis=1))[0])
                        raise AssertionError(
                            f"{rid}: decode rank {rank} head slot {slot} should hold KV head {head} "
                            f"(layer {layer}, {'KV'[k_or_v]}): position {bad} differs"
                        )
            assert np.array_equal(kv[:, :, :, slot], prefill_kv[head]), (
                f"{rid}: decode rank {rank}'s head {head} differs from what prefill holds"
            )


@pytest.mark.topology("4-gpu-h100-tp1-tp2", "8-gpu-h100-tp1-tp4", "8-gpu-h200-tp2-tp4", "2-node-16-gpu-h200-tp4-tp8")
def test_each_decode_rank_receives_exactly_the_kv_heads_it_owns(pd_workers, topology):
    model = HeteroModel(kv_heads=topology.kv_heads)
    pair = hetero_start(pd_workers, topology, model)
    prefill, decode = topology.roles_of("prefill")[0], topology.roles_of("decode")[0]
    reqs = [HeteroRequest(f"h{n}", n, room=100 + n) for n in (1, model.page_size, 2 * model.page_size + 3, 29)]
    deliveries = hetero_transfer(pair, reqs)
    for req, got in zip(reqs, deliveries):
        assert got.decode_ranks == list(range(decode.tp)), f"{req.rid} reached decode ranks {got.decode_ranks}"
        _check_request(pair, req.rid, req.prompt_len, model.kv_heads, got.decode_ranks, 0, prefill.tp, decode.tp, 2)
    # The collapse case by hand: decode TP above the heads means ranks share them, in runs.
    owners = [heads_by_hand(model.kv_heads, decode.tp, r) for r in range(decode.tp)]
    if decode.tp > model.kv_heads:
        assert owners == [[r // (decode.tp // model.kv_heads)] for r in range(decode.tp)]


@pytest.mark.topology("4-gpu-h100-dp-attention-dp2")
def test_dp_attention_kv_comes_from_the_prefill_dp_rank_the_receiver_is_bound_to(pd_workers, topology):
    model = HeteroModel(kv_heads=topology.kv_heads)
    pair = hetero_start(pd_workers, topology, model)
    prefill, decode = topology.roles_of("prefill")[0], topology.roles_of("decode")[0]
    p_attn, d_attn = _attn(prefill), _attn(decode)
    reqs = [
        HeteroRequest("room-even", 9, room=10),
        HeteroRequest("room-odd", 13, room=11),
        # The router picked the prefill DP rank itself, against the room's parity: decode must follow it.
        HeteroRequest("routed", 7, room=20, prefill_dp_rank=1),
        # Retracted after its KV arrived, then rebootstrapped: bound again to the same prefill DP rank.
        HeteroRequest("retracted", 11, room=31, retract=True),
        HeteroRequest("routed-retracted", 6, room=41, prefill_dp_rank=0, retract=True),
    ]
    deliveries = hetero_transfer(pair, reqs)
    for req, got in zip(reqs, deliveries):
        # By hand: follow_bootstrap_room puts a request on DP rank room % dp on both sides, unless the router
        # chose the prefill DP rank.
        want_prefill = req.prefill_dp_rank if req.prefill_dp_rank is not None else req.room % prefill.dp
        want_decode = [(req.room % decode.dp) * d_attn + t for t in range(d_attn)]
        assert got.prefill_dp_rank == want_prefill, f"{req.rid} was prefilled on DP rank {got.prefill_dp_rank}"
        assert got.decode_ranks == want_decode, f"{req.rid} decoded on ranks {got.decode_ranks}"
        bootstraps = 2 if req.retract else 1
        for rank in got.decode_ranks:
            assert got.bound[rank] == [want_prefill] * bootstraps, (
                f"{req.rid}: decode rank {rank}'s receiver bound to prefill DP ranks {got.bound[rank]} "
                f"(bootstraps in order), its KV is on DP rank {want_prefill}"
            )
        _check_request(pair, req.rid, req.prompt_len, model.kv_heads, got.decode_ranks, want_prefill, p_attn, d_attn, 2)


@pytest.mark.topology("cpu")
def test_a_tp_the_kv_heads_cannot_be_sliced_to_is_refused_in_one_line():
    with pytest.raises(HeteroRefused) as refused:
        hetero_check(HeteroModel(kv_heads=3), HeteroShape(1, 1), HeteroShape(2, 1))
    text = str(refused.value)
    assert "\n" not in text and "decode attention TP 2" in text and "3 KV heads" in text, text
    hetero_check(HeteroModel(kv_heads=2), HeteroShape(1, 1), HeteroShape(8, 1))  # shared heads are fine
