"""Builders for the real decode-side memory objects: KV pools, token allocators, the request slot
pool, the hisparse coordinator and the tree cache, all on a caller-given device.

Every object is sglang's own class, built the way a PD decode worker builds it (``need_sort=True``,
no memory saver). Sizes are small so a CPU test builds them in milliseconds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from harness.targets.sglang import compat
from harness.engines.sim import rank_runtime

logger = logging.getLogger(__name__)

#: Page sizes the non-hisparse path is built and tested with.
SWA_PAGE_SIZES = (1, 16, 64, 256)
#: Hisparse (DeepSeek-V4) page sizes: the C4 compressed page (page // 4) must hold the C128 ratio's pages.
HISPARSE_PAGE_SIZES = (256,)
# DeepSeek-V4 layer mix: one SWA-only layer, one C4 (hisparse) layer, one C128 layer.
_DSV4_COMPRESSION_RATIOS = (0, 4, 128)


@dataclass(frozen=True)
class PoolSizes:
    """Pool capacities: full and SWA pool tokens (multiples of every supported page size), request
    slots, the longest context a request slot holds, and the KV heads one rank stores per token.

    ``head_num`` is this rank's shard of the model's KV heads (``kv_heads // tp``): with tensor
    parallelism each rank's ``SWAKVPool`` holds only its heads, as sglang's MHA/GQA pools do. It
    does not apply to the DeepSeek-V4 pools, whose compressed latent KV has no head dimension and is
    held whole by every TP rank.
    """

    full_tokens: int = 48 * 256
    swa_tokens: int = 24 * 256
    req_slots: int = 8
    max_context_len: int = 8192
    head_num: int = 1

    def checked(self, page_size: int) -> tuple[int, int]:
        """The full and SWA pool sizes, validated against a page size.

        Args:
            page_size: tokens per page.

        Returns:
            ``(full_tokens, swa_tokens)``.

        Raises:
            ValueError: a size is not a positive multiple of ``page_size``.
        """
        for name, value in (("full_tokens", self.full_tokens), ("swa_tokens", self.swa_tokens)):
            if value <= 0 or value % page_size:
                raise ValueError(f"{name}={value} must be a positive multiple of page_size {page_size}")
        return self.full_tokens, self.swa_tokens


@dataclass(frozen=True)
class SwaPools:
    """The non-hisparse decode pools: ``SWAKVPool`` and ``SWATokenToKVPoolAllocator`` over it."""

    kv_pool: Any
    allocator: Any


@dataclass(frozen=True)
class HisparsePools:
    """The hisparse decode pools: ``DeepSeekV4TokenToKVPool``, the logical
    ``SWATokenToKVPoolAllocator`` over it, and ``DeepSeekV4HiSparseTokenToKVPoolAllocator`` wrapping that."""

    kv_pool: Any
    logical_allocator: Any
    allocator: Any


def build_swa_pools(page_size: int, sizes: PoolSizes, device: str) -> SwaPools:
    """Build ``SWAKVPool`` + ``SWATokenToKVPoolAllocator`` (two SWA layers, one full layer).

    Args:
        page_size: tokens per page, one of :data:`SWA_PAGE_SIZES`.
        sizes: pool capacities.
        device: "cpu" or "cuda:N".

    Returns:
        The pool and its allocator.

    Raises:
        ValueError: an unsupported page size.
    """
    if page_size not in SWA_PAGE_SIZES:
        raise ValueError(f"page_size {page_size} not supported; use one of {SWA_PAGE_SIZES}")
    if sizes.head_num < 1:
        raise ValueError(f"head_num={sizes.head_num} must be ≥ 1 (this rank's KV heads)")
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    size, size_swa = sizes.checked(page_size)
    compat.require_device(device, page_size=page_size)
    kv_pool = SWAKVPool(
        size=size,
        size_swa=size_swa,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=sizes.head_num,
        head_dim=8,
        swa_attention_layer_ids=[0, 2],
        full_attention_layer_ids=[1],
        device=device,
        enable_memory_saver=False,
    )
    allocator = _swa_allocator(size, size_swa, page_size, torch.bfloat16, device, kv_pool)
    return SwaPools(kv_pool=kv_pool, allocator=allocator)


def _swa_allocator(size: int, size_swa: int, page_size: int, dtype: Any, device: str, kv_pool: Any) -> Any:
    """sglang's ``SWATokenToKVPoolAllocator`` over ``kv_pool``, as the SWA and the hisparse pools use it."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    return SWATokenToKVPoolAllocator(
        size=size,
        size_swa=size_swa,
        page_size=page_size,
        dtype=dtype,
        device=device,
        kvcache=kv_pool,
        need_sort=True,  # what PD prefill and decode workers use
    )


def build_hisparse_pools(page_size: int, window: int, sizes: PoolSizes, device: str) -> HisparsePools:
    """Build the DeepSeek-V4 hisparse pool graph.

    Args:
        page_size: logical full/SWA page size, one of :data:`HISPARSE_PAGE_SIZES`.
        window: the model's sliding window (the pool sizes its SWA ring state from it).
        sizes: pool capacities.
        device: "cpu" or "cuda:N".

    Returns:
        The DeepSeek-V4 pool, the logical SWA allocator and the hisparse allocator wrapping it.

    Raises:
        ValueError: an unsupported page size.
    """
    if page_size not in HISPARSE_PAGE_SIZES:
        raise ValueError(f"hisparse page_size {page_size} not supported; use one of {HISPARSE_PAGE_SIZES}")
    from sglang.srt.mem_cache.allocator.hisparse import DeepSeekV4HiSparseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    size, size_swa = sizes.checked(page_size)
    ratios = list(_DSV4_COMPRESSION_RATIOS)
    compat.require_device(device, page_size=page_size, hisparse=True)
    kv_pool = DeepSeekV4TokenToKVPool(
        **compat.dsv4_pool_kwargs(
            DeepSeekV4TokenToKVPool,
            dict(
                max_num_reqs=sizes.req_slots,
                num_req_slots=sizes.req_slots + 1,
                swa_size=size_swa,
                c4_size=size // 4,
                c128_size=size // 128,
                c4_state_pool_size=16,
                c128_state_pool_size=16,
                page_size=page_size,
                swa_page_size=page_size,
                sliding_window=max(window, 1),
                dtype=torch.float8_e4m3fn,
                c4_state_dtype=torch.float32,
                c128_state_dtype=torch.float32,
                qk_nope_head_dim=448,
                qk_rope_head_dim=64,
                indexer_head_dim=128,
                layer_num=len(ratios),
                device=device,
                enable_memory_saver=False,
                compression_ratios=ratios,
                enable_hisparse=True,
                full_size=size,
            ),
        )
    )
    logical = _swa_allocator(size, size_swa, page_size, torch.float8_e4m3fn, device, kv_pool)
    allocator = DeepSeekV4HiSparseTokenToKVPoolAllocator(logical)
    return HisparsePools(kv_pool=kv_pool, logical_allocator=logical, allocator=allocator)


def build_req_to_token_pool(sizes: PoolSizes, device: str) -> Any:
    """Build ``ReqToTokenPool`` (the per-request token-index rows).

    Args:
        sizes: request slots and maximum context length.
        device: "cpu" or "cuda:N".

    Returns:
        The pool.
    """
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    return ReqToTokenPool(
        size=sizes.req_slots, max_context_len=sizes.max_context_len, device=device, enable_memory_saver=False
    )


def build_hisparse_coordinator(
    req_to_token_pool: Any, allocator: Any, device: str, *, top_k: int = 64, device_buffer_size: int = 128
) -> Any:
    """Build a real ``HiSparseCoordinator`` (host pool, per-request host rows).

    Initialises a world-size-1 gloo group if none exists; on a CPU device the host pool is
    allocated unpinned (see :func:`rank_runtime.unpinned_host_pools`); the host pool is booked against
    the memory available now (see :func:`rank_runtime.host_pool_budget`).

    Args:
        req_to_token_pool: the request slot pool.
        allocator: the ``DeepSeekV4HiSparseTokenToKVPoolAllocator``.
        device: "cpu" or "cuda:N".
        top_k: hisparse top-k.
        device_buffer_size: per-request device buffer tokens.

    Returns:
        The coordinator.
    """
    from sglang.srt.managers.hisparse_coordinator import HiSparseCoordinator

    rank_runtime.ensure_process_group()
    with rank_runtime.unpinned_host_pools(device), rank_runtime.host_pool_budget():
        return HiSparseCoordinator(
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=allocator,
            top_k=top_k,
            device_buffer_size=device_buffer_size,
            device=device,
            tp_group=None,
        )


def build_tree_cache(
    req_to_token_pool: Any, allocator: Any, page_size: int, window: int | None, *, radix_cache: bool
) -> Any:
    """Build the tree cache a hybrid-SWA PD decode worker gets: ``UnifiedRadixCache`` with FULL and
    SWA components, disabled unless ``--disaggregation-decode-enable-radix-cache``.

    With no window (None or 0) the tree gets the FULL component only: sglang's SWA component
    requires a positive window, and a scheduler without one is not hybrid-SWA to the registry.

    Args:
        req_to_token_pool: the request slot pool.
        allocator: the token allocator.
        page_size: tokens per page.
        window: the sliding window (None when the model has none).
        radix_cache: whether the decode radix cache is on.

    Returns:
        The tree cache.
    """
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    component = compat.component_type()
    components = (component.FULL, component.SWA) if window else (component.FULL,)
    return UnifiedRadixCache(
        CacheInitParams(
            disable=not radix_cache,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
            sliding_window_size=window,
            tree_components=components,
        )
    )
