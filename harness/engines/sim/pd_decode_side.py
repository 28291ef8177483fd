"""Decode-side operations a PD run needs beyond prealloc and release (``decode.py``):

:class:`Dsv4DecodeSide` (DeepSeek-V4 pools without hisparse), :func:`decode_step`, :func:`abort`,
:func:`fail_transfer`, :func:`retract` and :func:`resume`, each through sglang's real path. Only the
environment is hand-made (the ``ScheduleBatch`` tensors, a model config, :class:`FailedReceiver`). Which real
path each drives: docs/modules.md.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from typing import Any

import torch

from harness.targets.sglang import compat
from harness.engines.sim import rank_runtime
from harness.engines.sim.decode_side import DecodeSide
from harness.engines.sim.decode_types import DecodeConfig
from harness.engines.sim.prefill_side import build_dsv4_pools

logger = logging.getLogger(__name__)


class Dsv4DecodeSide(DecodeSide):
    """A decode side over ``DeepSeekV4TokenToKVPool`` without hisparse (same operations as DecodeSide).

    Args:
        config: ``hisparse`` must be False; ``page_size`` is the DeepSeek-V4 page (256).
    """

    def __init__(self, config: DecodeConfig):
        if config.hisparse:
            raise ValueError("Dsv4DecodeSide is the non-hisparse graph; use DecodeSide for hisparse")
        super().__init__(config)

    def _build_pools(self) -> None:
        config = self.config
        self.kv_pool, self.allocator = build_dsv4_pools(
            config.page_size, config.window or 0, config.sizes, config.device
        )
        self._full_allocator = self.allocator


def decode_step(side: DecodeSide, reqs: list[Any], step: int) -> torch.Tensor:
    """Run one decode step for ``reqs`` through ``alloc_for_decode(batch, token_per_req=1)``.

    Afterwards does the bookkeeping ``ScheduleBatch.prepare_for_decode`` does around that call
    (:func:`~harness.targets.sglang.compat.commit_decode_tokens`); the caller appends the sampled
    token to ``output_ids``.

    Args:
        side: the decode side.
        reqs: running requests (their KV committed up to ``kv_committed_len``).
        step: the forward iteration number.

    Returns:
        The new token's full-pool slot per request (``out_cache_loc``), on CPU.

    Raises:
        RuntimeError: sglang's "Decode out of memory".
    """
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.mem_cache.allocation import alloc_for_decode
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    rank_runtime.publish(side._settings)
    device = side.allocator.device
    seq = [int(compat.req_kv(r).kv_committed_len) for r in reqs]
    idx = [int(compat.req_kv(r).req_pool_idx) for r in reqs]
    batch = ScheduleBatch(
        reqs=list(reqs),
        req_to_token_pool=side.req_to_token_pool,
        token_to_kv_pool_allocator=side.allocator,
        tree_cache=side.tree_cache,
        model_config=types.SimpleNamespace(is_encoder_decoder=False),
        device=str(device),
        hisparse_coordinator=side.coordinator,
        forward_mode=ForwardMode.DECODE,
        forward_iter=step,
        seq_lens=torch.tensor(seq, dtype=torch.int64, device=device),
        seq_lens_cpu=torch.tensor(seq, dtype=torch.int64),
        req_pool_indices=torch.tensor(idx, dtype=torch.int64, device=device),
        req_pool_indices_cpu=torch.tensor(idx, dtype=torch.int64),
    )
    out = alloc_for_decode(batch, token_per_req=1)
    compat.commit_decode_tokens(reqs, token_per_req=1)
    # Not driven: prepare_for_decode's hisparse_coordinator.map_last_loc_to_buffer (it stages the
    # top-k device buffer for the attention kernel and needs CUDA); the logical allocation above is
    # the accounting under test.
    return out.to("cpu", torch.int64)


def abort(side: DecodeSide, req: Any) -> None:
    """Release an aborted request: ``FINISH_ABORT``, the coordinator's ``request_finished`` (hisparse),
    then ``release_kv_cache(req, tree_cache, checkpoint=False)``."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    rank_runtime.publish(side._settings)
    req.finished_reason = FINISH_ABORT("aborted mid-transfer")
    if side.coordinator is not None:
        side.coordinator.request_finished(req)
    compat.release_kv_cache(req, side.tree_cache, checkpoint=False)


class FailedReceiver:
    """The KV receiver of a transfer that failed, as sglang's ``CommonKVReceiver`` reports one: it polls
    ``KVPoll.Failed`` and ``failure_exception`` raises ``KVTransferError`` with the failure's reason.

    The harness's transport stands where mooncake's does; it stopped, synchronously, before the
    failure was reported, so no write is left in flight (no abort notification, no deferred release).

    Args:
        room: the request's bootstrap room.
        reason: why the transfer failed (sglang records it with the abort).
    """

    abort_notified = False
    require_staging = False

    def __init__(self, room: int, reason: str):
        self.room, self.reason = room, reason
        self.kv_mgr = types.SimpleNamespace(enable_deferred_decode_kv_release=False)
        self.cleared = False

    def poll(self) -> Any:
        from sglang.srt.disaggregation.base.conn import KVPoll

        return KVPoll.Failed

    def failure_exception(self) -> None:
        from sglang.srt.disaggregation.common.conn import KVTransferError

        raise KVTransferError(self.room, self.reason)

    def clear(self) -> None:
        self.cleared = True


def fail_transfer(side: DecodeSide, req: Any, reason: str) -> None:
    """Fail the transfer of ``req`` through sglang's ``DecodeTransferQueue.pop_transferred``.

    The queue holds the request alone, its receiver a :class:`FailedReceiver`: sglang's failed-transfer
    branch aborts it (``prepare_abort``: ``FINISH_ABORT`` with the reason), releases what prealloc took
    (``_release_request``: the hisparse coordinator's ``request_finished``, then ``release_kv_cache``
    without checkpoint) and frees its metadata slot.

    Args:
        side: the decode side that preallocated ``req``.
        req: the request whose transfer failed.
        reason: the failure's reason.

    Raises:
        RuntimeError: sglang did not treat the transfer as failed (it handed the request on, or did
            not abort it).
    """
    from sglang.srt.disaggregation.decode import DecodeRequest, DecodeTransferQueue
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    rank_runtime.publish(side._settings)
    rank_runtime.ensure_process_group()  # the queue reduces its polls over the (world-size-1) TP group
    slots = ReqToMetadataIdxAllocator(1)
    room = int(getattr(req, "bootstrap_room", None) or 0)
    queue = DecodeTransferQueue.__new__(DecodeTransferQueue)
    # Environment only: the fields an idle decode scheduler gives the queue, with staging, host
    # receive, hicache and deferred release off (none of them is on in a CPU or default GPU server).
    queue.__dict__.update(
        queue=[DecodeRequest(req=req, kv_receiver=FailedReceiver(room, reason), metadata_buffer_index=slots.alloc())],
        gloo_group=None,
        tp_rank=0,
        req_to_metadata_buffer_idx_allocator=slots,
        metadata_buffers=_MetadataSlots(),
        tree_cache=side.tree_cache,
        enable_host_receive=False,
        enable_staging=False,
        staging_handler=None,
        enable_deferred_kv_release=False,
        deferred_kv_release_timeout=0.0,
        _deferred_releases=[],
        _skipped_checksum_signatures=set(),
        # server_args: up to 0.5.18 the poll hands the scheduler's to its metadata gate (None: no gate,
        # which a failed receiver never reaches).
        scheduler=types.SimpleNamespace(
            server_args=None,
            enable_decode_hicache=False,
            enable_hisparse=side.coordinator is not None,
            hisparse_coordinator=side.coordinator,
            disagg_decode_prealloc_queue=side.queue,
            metrics_reporter=types.SimpleNamespace(enable_metrics=False),
            output_streamer=types.SimpleNamespace(stream_output=lambda reqs, return_logprob=False: None),
        ),
    )
    handed_on = queue.pop_transferred()
    if handed_on or queue.queue or not isinstance(req.finished_reason, FINISH_ABORT):
        raise RuntimeError(
            f"{req.rid}: pop_transferred did not fail the transfer (handed on {handed_on}, "
            f"still queued {len(queue.queue)}, finished_reason {req.finished_reason!r})"
        )


class _MetadataSlots:
    """What the metadata buffers see of a failed transfer: the queue frees the request's slot with
    ``clear_slot`` (up to 0.5.18: by zeroing its ``bootstrap_room`` entry). The first output token a
    prefill writes there never comes, so there is nothing else to clear."""

    def __init__(self) -> None:
        self.bootstrap_room = [0]  # the one slot of the queue's ReqToMetadataIdxAllocator(1)

    def clear_slot(self, idx: int) -> None:
        self.bootstrap_room[idx] = 0


#: The retraction backup the CPU servers run with (``launcher.CPU_DECODE_ARGS``): the KV of a retracted
#: request is copied to CPU tensors and written back at its new pages on resume.
RETRACTION_BACKUP = "cpu_tensor"


def _publish_retraction(side: DecodeSide) -> None:
    rank_runtime.publish(dataclasses.replace(side._settings, retraction_backup=RETRACTION_BACKUP))


def retract(side: DecodeSide, req: Any, remaining: int) -> bool:
    """Retract a decoding request as ``ScheduleBatch.retract_decode`` retracts each one it gives up.

    sglang's ``release_req``: the KV backed up (``backup_kv_cache`` with the ``cpu_tensor`` backup), the
    pages released without a checkpoint, the tree cache evicted for the requests that stay, the
    request reset for a retract; then ``DecodePreallocQueue.add(req, is_retracted=True)`` queues it for
    :func:`resume`.

    Args:
        side: the decode side running ``req``.
        req: the request to retract.
        remaining: requests still running after it (sglang evicts the tree for their next steps).

    Returns:
        Whether the backup was taken (False: sglang would abort the request; it is not queued).

    Raises:
        CapabilityMissing: the target has no decode retraction backup (``backup_kv_cache``; missing through
            0.5.18): a skip.
    """
    compat.require("decode-retraction")
    from sglang.srt.managers.schedule_batch import release_req

    _publish_retraction(side)
    saved = release_req(
        req=req,
        remaing_req_count=remaining,
        req_to_token_pool=side.req_to_token_pool,
        token_to_kv_pool_allocator=side.allocator,
        tree_cache=side.tree_cache,
        hisparse_coordinator=side.coordinator,
    )
    if saved:
        side.queue.add(req, is_retracted=True)
    return bool(saved)


def resume(side: DecodeSide, running: list[Any]) -> list[Any]:
    """Resume retracted requests through ``DecodePreallocQueue.resume_retracted_reqs``: each one the
    admission budgets let in is preallocated again (``_pre_alloc``) and its backup restored.

    Args:
        side: the decode side.
        running: the requests decoding now (the scheduler's running batch, which the budgets count).

    Returns:
        The resumed requests, in sglang's order.
    """
    _publish_retraction(side)
    scheduler = side.queue.scheduler
    scheduler.running_batch.reqs = list(running)
    try:
        return list(side.queue.resume_retracted_reqs())
    finally:
        scheduler.running_batch.reqs = []
