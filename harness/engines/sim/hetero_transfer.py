"""sglang's own heterogeneous-PD decisions, run in process: which prefill ranks and head slices feed a
decode rank, and which prefill DP rank a request sits on and its receiver binds to.

Each function builds the sglang object whose method decides (``object.__new__``, only the attributes
that method reads) and calls the real method; the RDMA engine is replaced by :class:`RecordingEngine`,
which writes nothing and records the ``(src, dst, length)`` writes sglang asked for. Each function's
docstring names the sglang method that answers it.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from harness.engines.sim import rank_runtime

#: The bootstrap address every simulated request names (sglang keys its prefill info by it).
BOOTSTRAP_ADDR = "sim-prefill:8998"


class RecordingEngine:
    """Stands in for Mooncake's transfer engine: records each batch of writes, moves nothing."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, int, int]] = []
        self._lock = threading.Lock()

    def batch_transfer_sync(self, session_id: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        with self._lock:
            self.writes.extend(zip((int(s) for s in src), (int(d) for d in dst), (int(n) for n in lengths)))
        return 0


@dataclass(frozen=True)
class RankMap:
    """What a decode rank's KV manager resolved for one prefill server (``_resolve_rank_mapping``)."""

    target_tp_ranks: tuple[int, ...]
    required_dst_info_num: int
    required_prefill_response_num: int


@dataclass(frozen=True)
class Registration:
    """What a decode rank registers with prefill (mooncake's ``KVArgsRegisterInfo`` fields used here)."""

    dst_kv_ptrs: tuple[int, ...]
    dst_kv_item_len: int
    dst_tp_rank: int
    dst_attn_tp_size: int


def _shell(cls: type, **attrs: Any) -> Any:
    obj: Any = object.__new__(cls)
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


def _server_info(prefill_attn_tp: int, prefill_dp: int, page_size: int, kv_dtype: str) -> Any:
    from sglang.srt.disaggregation.common.conn import PrefillServerInfo

    return PrefillServerInfo(
        attn_tp_size=prefill_attn_tp,
        attn_cp_size=1,
        dp_size=prefill_dp,
        pp_size=1,
        page_size=page_size,
        kv_cache_dtype=kv_dtype,
        follow_bootstrap_room=True,
    )


def rank_map(decode_attn_tp: int, decode_engine_rank: int, prefill_attn_tp: int) -> RankMap:
    """The prefill TP ranks a decode rank pulls from: ``CommonKVManager._resolve_rank_mapping`` (MHA/GQA,
    no CP/PP), as the decode's KV manager runs it once per prefill server."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.base.conn import KVArgs

    kv_args = _shell(KVArgs, engine_rank=decode_engine_rank)
    mgr = _shell(
        CommonKVManager,
        kv_args=kv_args,
        attn_tp_size=decode_attn_tp,
        attn_cp_size=1,
        attn_cp_rank=0,
        pp_size=1,
        pp_rank=0,
        is_mla_backend=False,
        is_hybrid_mla_backend=False,
        enable_all_cp_ranks_for_transfer=False,
    )
    info = _server_info(prefill_attn_tp, 1, 1, "auto")
    mgr._resolve_rank_mapping(info)
    return RankMap(
        tuple(info.target_tp_ranks), int(info.required_dst_info_num), int(info.required_prefill_response_num)
    )


def kv_writes(
    *,
    engine_rank: int,
    attn_tp: int,
    kv_head_num: int,
    total_kv_heads: int,
    page_size: int,
    kv_data_ptrs: Sequence[int],
    kv_item_lens: Sequence[int],
    prefill_pages: Sequence[int],
    dst: Registration,
    dst_pages: Sequence[int],
) -> list[tuple[int, int, int]]:
    """The writes a prefill rank's mooncake KV manager issues for one request to one decode rank, as its
    transfer worker dispatches them: ``send_kvcache`` when both attention TPs agree, else
    ``send_kvcache_slice`` (the head-sliced path).

    Returns:
        ``(src address, dst address, length)`` per write, in the order sglang issued them.

    Raises:
        RuntimeError: sglang refused the transfer (a non-zero status).
    """
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    kv_args = _shell(
        KVArgs,
        engine_rank=engine_rank,
        kv_data_ptrs=list(kv_data_ptrs),
        kv_item_lens=list(kv_item_lens),
        kv_layer_ids=[],
        kv_head_num=kv_head_num,
        total_kv_head_num=total_kv_heads,
        page_size=page_size,
        prefill_start_layer=0,
        prefill_end_layer=None,
        mla_compression_ratios=None,
        num_draft_entries=0,
    )
    engine = RecordingEngine()
    mgr = _shell(
        MooncakeKVManager,
        kv_args=kv_args,
        engine=engine,
        attn_tp_size=attn_tp,
        pp_size=1,
        is_mla_backend=False,
        is_hybrid_mla_backend=False,
        enable_custom_mem_pool=False,
        custom_mem_pool_type=None,
        max_transfer_batch_indices=0,
        enable_deferred_decode_kv_release=False,
    )
    if rank_runtime.published() is None:  # send_kvcache reads --enable-unified-memory from it
        rank_runtime.publish(rank_runtime.RuntimeSettings(page_size=page_size))
    src = np.asarray(prefill_pages, dtype=np.int32)
    dst_idx = np.asarray(dst_pages, dtype=np.int32)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as executor:
        if attn_tp == dst.dst_attn_tp_size:
            ret = mgr.send_kvcache(
                "sim",
                src,
                list(dst.dst_kv_ptrs),
                dst_idx,
                executor,
                dst_kv_item_len=dst.dst_kv_item_len,
                dst_attn_tp_size=dst.dst_attn_tp_size,
            )
        else:
            ret = mgr.send_kvcache_slice(
                "sim",
                src,
                list(dst.dst_kv_ptrs),
                dst_idx,
                dst.dst_tp_rank,
                dst.dst_attn_tp_size,
                dst.dst_kv_item_len,
                executor,
            )
    if ret != 0:
        raise RuntimeError(f"sglang refused the KV transfer to decode rank {dst.dst_tp_rank} (status {ret})")
    return engine.writes


class _Sink:
    """A DP worker socket of the data-parallel controller: remembers what it was sent."""

    def __init__(self) -> None:
        self.sent = 0

    def send_pyobj(self, obj: Any, flags: int = 0, protocol: int = 0) -> None:
        self.sent += 1

    def send(self, data: Any, flags: int = 0) -> None:
        self.sent += 1


def place_on_dp_rank(req: Any, dp_size: int) -> int:
    """The DP rank a request is dispatched to under ``--load-balance-method follow_bootstrap_room``:
    ``DataParallelController.follow_bootstrap_room_scheduler`` (a router's ``routed_dp_rank`` wins)."""
    from sglang.srt.managers.data_parallel_controller import DataParallelController

    sinks = [_Sink() for _ in range(dp_size)]
    ctl = _shell(DataParallelController, workers=sinks, _active_workers=list(range(dp_size)))
    ctl.follow_bootstrap_room_scheduler(req)
    chosen = [i for i, s in enumerate(sinks) if s.sent]
    if len(chosen) != 1:
        raise RuntimeError(f"the DP controller sent {req.rid} to {len(chosen)} ranks")
    return chosen[0]


def bind_prefill_dp_rank(req: Any, prefill_attn_tp: int, prefill_dp: int, page_size: int) -> int | None:
    """The prefill DP rank a decode receiver is bound to: ``DecodePreallocQueue._resolve_prefill_dp_rank``
    (the request's ``disagg_prefill_dp_rank`` if set, else ``bootstrap_room % dp_size`` under
    follow_bootstrap_room; None: sglang would ask the bootstrap server)."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    mgr = _shell(
        CommonKVManager,
        prefill_info_table={BOOTSTRAP_ADDR: _server_info(prefill_attn_tp, prefill_dp, page_size, "auto")},
    )
    queue = _shell(DecodePreallocQueue, kv_manager=mgr)
    return queue._resolve_prefill_dp_rank(req)


def make_request(rid: str, prompt_len: int, room: int, side: str, prefill_dp_rank: int | None = None) -> Any:
    """A real ``Req`` as the router hands it to one ``side``: the bootstrap address and room and, when the
    router chose the prefill DP rank itself (external routing), that rank: ``routed_dp_rank`` on the
    prefill side, ``disagg_prefill_dp_rank`` on the decode side."""
    from harness.engines.sim.requests import make_req

    req = make_req(rid, prompt_len)
    host, port = BOOTSTRAP_ADDR.rsplit(":", 1)
    req.bootstrap_host, req.bootstrap_port, req.bootstrap_room = host, int(port), room
    if side == "prefill":
        req.routed_dp_rank = prefill_dp_rank
    else:
        req.disagg_prefill_dp_rank = prefill_dp_rank
    return req
