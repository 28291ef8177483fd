"""The decode side's value types: its configuration (:class:`DecodeConfig`), what one prealloc produced
(:class:`PreallocResult`), and the failure of one (:class:`PreallocFailed`); :mod:`.decode_side` builds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.engines.sim import pools as pool_builders


class PreallocFailed(RuntimeError):
    """No request slot, or the allocator could not hold the request (sglang's ``req_pool_indices is
    full!`` / ``KV cache is full!`` assertions, or on the hisparse path the host pool's
    ``HiSparse host mem pool alloc failed``).

    sglang's scheduler never reaches these (its admission check runs first; the assertion would
    end the worker); the harness does, to test allocation failure. ``_pre_alloc`` takes the request
    slot before allocating KV, and on the hisparse path also allocates host slots before it checks
    the KV allocation, so the adapter aborts the request through the real paths
    (``HiSparseCoordinator.request_finished``, ``ReqToTokenPool.free``) before raising. Any KV page
    still taken after that is a real leak and shows in :meth:`DecodeSide.snapshot`.

    Attributes:
        rid: the request.
        detail: sglang's assertion message.
        held: slots per pool the failed ``_pre_alloc`` held before the abort (``taken_since``).
    """

    def __init__(self, rid: str, detail: str, held: dict[str, int]):
        super().__init__(f"prealloc of {rid} failed (held {held} until aborted): {detail}")
        self.rid = rid
        self.detail = detail
        self.held = held

    def __reduce__(self) -> tuple:
        # Crosses Ray's process boundary (a PD rank's failure reaches the driver): pickle by fields.
        return (type(self), (self.rid, self.detail, self.held))


@dataclass(frozen=True)
class DecodeConfig:
    """One decode worker's memory configuration.

    Attributes:
        hisparse: the DeepSeek-V4 hisparse path (``alloc_for_decode_prealloc_hisparse``) instead of
            the SWAKVPool path (``alloc_for_decode_prealloc``).
        page_size: tokens per page (SWA path: 1/16/64/256; hisparse: 256).
        window: the model's sliding window (``scheduler.sliding_window_size``); None or 0 = none.
        radix_cache: ``--disaggregation-decode-enable-radix-cache`` (not with hisparse, as in sglang).
        sizes: pool capacities.
        device: "cpu", or "cuda:N" on a GPU worker.
        num_reserved_decode_tokens: the queue's per-request decode reserve (sglang's default 512
            matters only to admission, which the harness does not drive; kept for completeness).
        hisparse_top_k: coordinator top-k.
        hisparse_device_buffer_size: coordinator device buffer tokens per request.
        alloc_order: the allocators' order, ``sglang`` or ``lifo`` (:mod:`harness.engines.alloc_order`).
    """

    hisparse: bool = False
    page_size: int = 64
    window: int | None = 128
    radix_cache: bool = False
    sizes: pool_builders.PoolSizes = field(default_factory=pool_builders.PoolSizes)
    device: str = "cpu"
    num_reserved_decode_tokens: int = 512
    hisparse_top_k: int = 64
    hisparse_device_buffer_size: int = 128
    alloc_order: str = "sglang"

    def __post_init__(self) -> None:
        if self.hisparse and self.radix_cache:
            raise ValueError(
                "hisparse is incompatible with the decode radix cache (as in sglang): set radix_cache=False"
            )
        allowed = pool_builders.HISPARSE_PAGE_SIZES if self.hisparse else pool_builders.SWA_PAGE_SIZES
        if self.page_size not in allowed:
            raise ValueError(f"page_size {self.page_size} not supported on this path; use one of {allowed}")
        if self.window is not None and self.window < 0:
            raise ValueError(f"window must be >= 0 or None, got {self.window}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device {self.device!r} not supported; use 'cpu' or 'cuda:N'")


@dataclass(frozen=True)
class PreallocResult:
    """What one prealloc produced.

    Attributes:
        rid: the request.
        fill_len: tokens preallocated (``_pre_alloc_fill_len``).
        swa_tail_len: tokens given SWA slots (``_swa_tail_len(fill_len)``); equals ``fill_len``
            when the SWA-tail path is not used (page size 1, or no window).
        uses_swa_tail: whether ``_uses_swa_tail_prealloc()`` chose the SWA-tail path.
        prefix_len: tokens reused from the decode radix cache (0 with the cache off).
        destination: the transfer destination indices ``_pre_alloc`` returned (full-pool slots;
            hisparse host slots on the hisparse path).
    """

    rid: str
    fill_len: int
    swa_tail_len: int
    uses_swa_tail: bool
    prefix_len: int
    destination: Any
