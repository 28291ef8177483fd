"""Decode-side operations a PD run needs beyond prealloc and release (``decode.py``):

* :class:`Dsv4DecodeSide` — a :class:`~harness.targets.sglang.decode.DecodeSide` over
  DeepSeek-V4 pools *without* hisparse (the adapter's DeepSeek-V4 graph is the hisparse one);
* :func:`decode_step` — one batched decode step through the real ``alloc_for_decode`` (which runs
  ``ScheduleBatch.maybe_evict_swa`` — SWA window eviction — then ``alloc_paged_token_slots_decode``);
* :func:`abort` — release of a request aborted before it finished (``release_kv_cache`` without
  checkpoint, as the scheduler does for an abort).

Only environment is hand-made: the ``ScheduleBatch`` carries the tensors ``prepare_for_decode``
would have (``seq_lens``, ``req_pool_indices``) and a model config namespace.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

from harness.targets.sglang import compat, runtime
from harness.targets.sglang import pools as pool_builders
from harness.targets.sglang.decode import DecodeConfig, DecodeSide
from harness.targets.sglang.prefill import build_dsv4_pools

logger = logging.getLogger(__name__)


class Dsv4DecodeSide(DecodeSide):
    """A decode side over ``DeepSeekV4TokenToKVPool`` without hisparse (same operations as DecodeSide).

    Args:
        config: ``hisparse`` must be False; ``page_size`` is the DeepSeek-V4 page (256).
    """

    def __init__(self, config: DecodeConfig):
        if config.hisparse:
            raise ValueError("Dsv4DecodeSide is the non-hisparse graph; use DecodeSide for hisparse")
        self.config = config
        self._settings = runtime.RuntimeSettings(device=config.device, radix_cache=config.radix_cache,
                                                  page_size=config.page_size)
        runtime.publish(self._settings)
        sizes, device = config.sizes, config.device
        self.req_to_token_pool = pool_builders.build_req_to_token_pool(sizes, device)
        self.coordinator = None
        self.kv_pool, self.allocator = build_dsv4_pools(config.page_size, config.window or 0, sizes, device)
        self._full_allocator = self.allocator
        self.tree_cache = pool_builders.build_tree_cache(self.req_to_token_pool, self.allocator, config.page_size,
                                                         config.window, radix_cache=config.radix_cache)
        self.queue = self._build_queue()
        self.baseline = self.snapshot()


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

    runtime.publish(side._settings)
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

    runtime.publish(side._settings)
    req.finished_reason = FINISH_ABORT("aborted mid-transfer")
    if side.coordinator is not None:
        side.coordinator.request_finished(req)
    compat.release_kv_cache(req, side.tree_cache, checkpoint=False)
