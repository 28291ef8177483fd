"""Faults mirroring upstream sglang bugs on the PD decode prealloc / admission paths.

Each factory rebuilds the broken variant the way the upstream code was before its fix: a
wrapper when the bug was a missing step (the SWA reclaim of #40309, the SWA-tail allocation of
#24036), a copy of the 0.5.23 function with the fix taken out when the bug was inside a
computation (the page rounding of the reservation, the hisparse budget). Copies reach sglang's
helpers through ``original.__globals__`` so this module imports nothing from the engine.

Registered into the catalog by ``harness/faults/catalog.py`` (``FAULTS`` below is appended there).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from harness.faults import Fault

_DECODE = "sglang.srt.disaggregation.decode"
_QUEUE = f"{_DECODE}:DecodePreallocQueue"


def _alloc_for_decode_prealloc_without_page_assert(original: Callable[..., Any]) -> Callable[..., Any]:
    """``alloc_for_decode_prealloc`` of 0.5.23 without its page-alignment assertion on
    ``fill_len - swa_tail_len``: an unaligned SWA eviction floor is recorded on the request."""
    g = original.__globals__
    async_h2d, torch, component_type = g["async_h2d"], g["torch"], g["ComponentType"]

    def alloc_for_decode_prealloc(allocator: Any, *, req: Any, fill_len: int, delta_len: int, prefix_len: int,
                                  total_prefix_len: int, prefix_indices: Optional[Any], uses_swa_tail: bool,
                                  swa_tail_len: int, req_to_token_pool: Optional[Any] = None) -> Any:
        req.kv.kv_allocated_len = fill_len
        if allocator.page_size == 1:
            return allocator.alloc(delta_len)
        device = allocator.device
        last_loc = (prefix_indices[-1:].to(dtype=torch.int64, device=device) if prefix_len > 0
                    else async_h2d([-1], dtype=torch.int64, device=device))
        extra_kwargs: dict[str, Any] = {}
        dsv4_unwrap_prealloc = None
        if hasattr(allocator, "c128_attn_allocator"):
            from sglang.srt.hardware_backend.npu.dsv4.dsv4_common_hooks import (  # engine path, as upstream
                dsv4_prealloc_kwargs,
                dsv4_unwrap_prealloc,
            )

            extra_kwargs = dsv4_prealloc_kwargs(allocator, req, fill_len, req_to_token_pool, device=device)
        lens = dict(
            prefix_lens=async_h2d([total_prefix_len], dtype=torch.int64, device=device),
            prefix_lens_cpu=torch.tensor([total_prefix_len], dtype=torch.int64),
            seq_lens=async_h2d([fill_len], dtype=torch.int64, device=device),
            seq_lens_cpu=torch.tensor([fill_len], dtype=torch.int64),
            last_loc=last_loc,
            extend_num_tokens=delta_len,
        )
        if uses_swa_tail:
            kv_loc = allocator.alloc_extend_swa_tail(**lens, swa_tail_len=swa_tail_len, **extra_kwargs)
            # The fault: no `assert swa_evicted_seqlen >= 0 and swa_evicted_seqlen % page_size == 0`.
            req.kv.set_evicted_seqlen(component_type.SWA, fill_len - swa_tail_len)
        else:
            kv_loc = allocator.alloc_extend(**lens, **extra_kwargs)
        if dsv4_unwrap_prealloc is not None:
            kv_loc = dsv4_unwrap_prealloc(kv_loc, req_to_token_pool, req, total_prefix_len, fill_len)
        return kv_loc

    return alloc_for_decode_prealloc


def _pre_alloc_without_swa_reclaim(original: Callable[..., Any]) -> Callable[..., Any]:
    """``DecodePreallocQueue._pre_alloc`` as before #40309: it evicts full-attention pages from the
    decode radix cache but never reclaims SWA pages, although admission counted them as available."""

    def _pre_alloc(self: Any, req: Any, prefix_indices: Any = None, prefix_len: Optional[int] = None,
                   total_prefix_len: Optional[int] = None) -> Any:
        # The real body runs unchanged; only its one call to the SWA reclaim does nothing. An instance
        # attribute shadows the method for this call only, so the caller-side reclaim in
        # pop_preallocated (which predates #40309) keeps working.
        self._reclaim_swa_tail_capacity = lambda *args, **kwargs: None
        try:
            return original(self, req, prefix_indices, prefix_len, total_prefix_len)
        finally:
            del self._reclaim_swa_tail_capacity

    return _pre_alloc


def _alloc_for_decode_prealloc_full_swa(original: Callable[..., Any]) -> Callable[..., Any]:
    """``alloc_for_decode_prealloc`` as before #24036: ``allocator.alloc_extend`` for the whole fill,
    so the SWA pool is charged for every token, not the window tail (and no SWA eviction floor)."""

    def alloc_for_decode_prealloc(allocator: Any, **kwargs: Any) -> Any:
        return original(allocator, **{**kwargs, "uses_swa_tail": False})

    return alloc_for_decode_prealloc


def _prealloc_required_tokens_unaligned(original: Callable[..., Any]) -> Callable[..., Any]:
    """``DecodePreallocQueue._prealloc_required_tokens`` without the rounding of both lengths up to a
    page: the reservation is smaller than the whole pages the paged allocator hands out."""
    get_memory = original.__globals__["get_memory"]

    def _prealloc_required_tokens(self: Any, req: Any) -> tuple[int, int]:
        full_len, swa_len = self._prealloc_kv_lens(req)
        # The fault: no `ceil_align(..., page_size)` of full_len and swa_len here.
        swa_reserved = self.num_reserved_decode_tokens
        if get_memory().disable_radix_cache:
            swa_reserved = 0
        return full_len + self.num_reserved_decode_tokens, swa_len + swa_reserved

    return _prealloc_required_tokens


def _allocatable_token_budgets_swa_clamped(original: Callable[..., Any]) -> Callable[..., Any]:
    """``DecodePreallocQueue._allocatable_token_budgets`` as before #30408: on the hisparse path the
    budget is the logical allocator's ``available_size()`` (min of full and SWA free) even when the
    SWA-tail prealloc is on, so the SWA pool caps admission instead of the full logical capacity."""
    g = original.__globals__
    get_disagg = g["get_disagg"]

    def _allocatable_token_budgets(self: Any, retractable_tokens: Optional[int] = None, count_retracted: bool = True,
                                   extra_reserved_reqs: int = 0, reserved_tokens: Optional[int] = None,
                                   hicache_reserved_tokens: int = 0) -> int:
        need_space_for_single_req = self._need_space_for_single_req(retractable_tokens)
        if reserved_tokens is None:
            reserved_tokens = self._active_reserved_tokens(extra_reserved_reqs=extra_reserved_reqs)
        if self.scheduler.enable_hisparse:
            # The fault: no `full_available_size()` branch for the SWA-tail prealloc.
            available_size = self.token_to_kv_pool_allocator.logical_attn_allocator.available_size()
        elif self._uses_swa_reservation():
            available_size = self.token_to_kv_pool_allocator.full_available_size()
            if get_disagg().disaggregation_decode_enable_radix_cache:
                available_size += self._radix_full_evictable()
        else:
            available_size = self.token_to_kv_pool_allocator.available_size()
            if get_disagg().disaggregation_decode_enable_radix_cache:
                available_size += self._radix_full_evictable()
        allocatable_tokens = available_size - max(reserved_tokens, need_space_for_single_req)
        last = self.scheduler.last_batch
        if last and last.forward_mode.is_prebuilt():
            allocatable_tokens -= self.num_reserved_decode_tokens * len(last.reqs)
        if count_retracted:
            for req in self.retracted_queue:
                full_required, _ = self._prealloc_required_tokens(req)
                allocatable_tokens -= full_required
        return allocatable_tokens - hicache_reserved_tokens

    return _allocatable_token_budgets


FAULTS: tuple[Fault, ...] = (
    Fault(
        name="swa-tail-unaligned-noassert",
        description="swa-tail-unaligned with the page-alignment assert in alloc_for_decode_prealloc bypassed",
        upstream="sglang#35286 / sglang#35396 (assert added by the fix)",
        target=f"{_DECODE}:alloc_for_decode_prealloc",
        make=_alloc_for_decode_prealloc_without_page_assert,
        requires=("swa-tail-unaligned",),
    ),
    Fault(
        name="prealloc-no-swa-evict",
        description="_pre_alloc reclaims only full-attention pages, never the evictable SWA pages admission counted",
        upstream="sglang#40309",
        target=f"{_QUEUE}._pre_alloc",
        make=_pre_alloc_without_swa_reclaim,
    ),
    Fault(
        name="swa-full-length",
        description="decode prealloc charges the SWA pool for the full fill length instead of the window tail",
        upstream="sglang#24036 (SWA prealloc sizing)",
        target=f"{_DECODE}:alloc_for_decode_prealloc",
        make=_alloc_for_decode_prealloc_full_swa,
    ),
    Fault(
        name="decode-reserve-unaligned",
        description="decode prealloc reservation (_prealloc_required_tokens) not rounded up to whole pages",
        upstream="sglang#35265",
        target=f"{_QUEUE}._prealloc_required_tokens",
        make=_prealloc_required_tokens_unaligned,
    ),
    Fault(
        name="hisparse-budget-swa",
        description="hisparse decode admission budget from the SWA-clamped available size, not full logical capacity",
        upstream="sglang#30401 / sglang#30408",
        target=f"{_QUEUE}._allocatable_token_budgets",
        make=_allocatable_token_budgets_swa_clamped,
    ),
)
