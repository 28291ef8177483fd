"""The prefill side of a PD pair on sglang's real objects, plus page-level views both sides share.

:class:`PrefillSide` holds one prefill rank's memory graph and drives the real ``alloc_extend`` and
``release_kv_cache``. Shared helpers: :func:`page_buffers`, :func:`free_pages`, :func:`token_locs`. The pools
and paths: docs/modules.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from harness.targets.sglang import compat
from harness.targets.sglang.compat import pdstate
from harness.engines import alloc_order as order_knob
from harness.engines.sim import rank_runtime
from harness.engines.sim import pools as pool_builders
from harness.engines.sim.requests import make_req

logger = logging.getLogger(__name__)

#: DeepSeek-V4 layer mix (one SWA-only layer, one C4 layer, one C128 layer), as the adapter uses.
DSV4_RATIOS = (0, 4, 128)


@dataclass(frozen=True)
class PageBuffers:
    """The page-indexed KV buffers of one pool graph, as ``[pages, page_bytes]`` uint8 views.

    ``full`` is indexed by full-pool page id (``loc // page_size``), ``swa`` by SWA-pool page id
    (``full_to_swa_index_mapping[loc] // page_size``).
    """

    full: tuple[torch.Tensor, ...]
    swa: tuple[torch.Tensor, ...]


def build_dsv4_pools(
    page_size: int, window: int, sizes: pool_builders.PoolSizes, device: str, *, hisparse: bool = False
) -> tuple[Any, Any]:
    """Build ``DeepSeekV4TokenToKVPool`` (non-hisparse unless asked) and ``SWATokenToKVPoolAllocator`` over it.

    Args:
        page_size: tokens per page (256 for DeepSeek-V4).
        window: the sliding window.
        sizes: pool capacities.
        device: "cpu" or "cuda:N".
        hisparse: build the C4 layer as the hisparse device pool.

    Returns:
        ``(kv_pool, allocator)``.
    """
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    size, size_swa = sizes.checked(page_size)
    compat.require_device(device, page_size=page_size, hisparse=hisparse)
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
                layer_num=len(DSV4_RATIOS),
                device=device,
                enable_memory_saver=False,
                compression_ratios=list(DSV4_RATIOS),
                enable_hisparse=hisparse,
                full_size=size,
            ),
        )
    )
    allocator = SWATokenToKVPoolAllocator(
        size=size,
        size_swa=size_swa,
        page_size=page_size,
        dtype=torch.float8_e4m3fn,
        device=device,
        kvcache=kv_pool,
        need_sort=True,
    )
    return kv_pool, allocator


def byte_view(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """View a KV buffer as ``[pages, page_bytes]`` uint8 (no copy).

    Args:
        buf: a contiguous buffer whose first dimension is token rows (a multiple of ``page_size``)
            or pages (2-D uint8 page buffers).
        page_size: tokens per page.

    Returns:
        The byte view.
    """
    b = buf.view(torch.uint8) if buf.dtype != torch.uint8 else buf
    if buf.dim() == 2 and buf.dtype == torch.uint8:
        return b  # already page rows
    rows = buf.shape[0]
    return b.reshape(rows // page_size, -1)


def page_buffers(kv_pool: Any, page_size: int, full_pages: int) -> PageBuffers:
    """The buffers a PD transfer moves page by page.

    ``SWAKVPool``: K and V of the full layers (full page ids) and of the SWA layers (SWA page ids).
    ``DeepSeekV4TokenToKVPool``: the compressed KV and indexer buffers that hold a row per full
    page (the hisparse C4 device pool does not, and is left out), and the SWA KV per layer.

    Args:
        kv_pool: the pool.
        page_size: tokens per page.
        full_pages: pages of the full pool (a full-page buffer has at least ``full_pages + 1`` rows).

    Returns:
        The :class:`PageBuffers`.
    """
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    if isinstance(kv_pool, DeepSeekV4TokenToKVPool):
        full = []
        pools = compat.dsv4_compressed_pools(kv_pool)
        for ratio in sorted(pools):
            pool, index = pools[ratio]
            # The hisparse C4 device pool is a per-request top-k buffer, not indexed by full page.
            if pool is not None and type(pool).__name__ != "HiSparseC4DevicePool":
                full.extend(pool.kv_buffer)
            if index is not None:
                full.extend(compat.index_page_rows(index))
        full = [b for b in full if b.dim() == 2 and b.shape[0] > full_pages]
        swa = list(kv_pool.swa_kv_pool.kv_buffer)
        return PageBuffers(tuple(byte_view(b, page_size) for b in full), tuple(byte_view(b, page_size) for b in swa))
    f, s = kv_pool.full_kv_pool, kv_pool.swa_kv_pool
    return PageBuffers(
        tuple(byte_view(b, page_size) for b in (*f.k_buffer, *f.v_buffer)),
        tuple(byte_view(b, page_size) for b in (*s.k_buffer, *s.v_buffer)),
    )


def logical_allocator(allocator: Any) -> Any:
    """The ``SWATokenToKVPoolAllocator`` behind an allocator (unwraps the hisparse wrapper)."""
    return getattr(allocator, "logical_attn_allocator", allocator)


def free_pages(allocator: Any) -> dict[str, frozenset[int]]:
    """Free page ids of the full and SWA pools right now (changes nothing).

    Args:
        allocator: a ``SWATokenToKVPoolAllocator`` or the hisparse wrapper.

    Returns:
        ``{"full": ids, "swa": ids}``.
    """
    a = logical_allocator(allocator)
    return {
        "full": frozenset(compat.all_free_pages(a.full_attn_allocator).cpu().tolist()),
        "swa": frozenset(compat.all_free_pages(a.swa_attn_allocator).cpu().tolist()),
    }


def free_sizes(allocator: Any) -> dict[str, int]:
    """Free token slots of the full and SWA pools."""
    a = logical_allocator(allocator)
    return {"full": int(a.full_available_size()), "swa": int(a.swa_available_size())}


def token_locs(
    req_to_token_pool: Any, allocator: Any, req: Any, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-pool and SWA-pool slots of a request's tokens ``start..end-1`` (SWA slot 0 = none).

    Returns:
        ``(full_locs, swa_locs)`` as int64 CPU tensors.
    """
    a = logical_allocator(allocator)
    row = req_to_token_pool.req_to_token[compat.req_kv(req).req_pool_idx, start:end].to(torch.int64)
    swa = a.full_to_swa_index_mapping[row].to(torch.int64)
    return row.cpu(), swa.cpu()


class PrefillSide:
    """One prefill rank's real memory graph.

    Args:
        kind: ``swa`` (SWAKVPool) or ``dsv4`` (DeepSeek-V4 pools).
        page_size: tokens per page.
        window: the sliding window.
        sizes: capacities; the SWA pool is as large as the full pool (prefill computes every
            prompt token's SWA KV before it can drop any).
        device: "cpu" or "cuda:N".
        alloc_order: the allocators' order, ``sglang`` or ``lifo`` (:mod:`harness.engines.alloc_order`).
    """

    def __init__(
        self,
        kind: str,
        page_size: int,
        window: int,
        sizes: pool_builders.PoolSizes,
        device: str,
        alloc_order: str = order_knob.SGLANG,
    ):
        rank_runtime.publish(rank_runtime.RuntimeSettings(device=device, radix_cache=False, page_size=page_size))
        sizes = replace(sizes, swa_tokens=sizes.full_tokens)
        self.page_size = page_size
        self.device = device
        if kind == "dsv4":
            self.kv_pool, self.allocator = build_dsv4_pools(page_size, window, sizes, device)
        else:
            built = pool_builders.build_swa_pools(page_size, sizes, device)
            self.kv_pool, self.allocator = built.kv_pool, built.allocator
        self.req_to_token_pool = pool_builders.build_req_to_token_pool(sizes, device)
        self.tree_cache = pool_builders.build_tree_cache(
            self.req_to_token_pool, self.allocator, page_size, window, radix_cache=False
        )
        self.buffers = page_buffers(self.kv_pool, page_size, sizes.full_tokens // page_size)
        order_knob.apply(self.allocator, alloc_order)

    def alloc(self, rid: str, prompt_len: int) -> Any:
        """Allocate a prompt through the real allocator (``alloc_extend``) into a fresh request slot.

        Args:
            rid: request id.
            prompt_len: prompt tokens.

        Returns:
            The ``Req`` holding the KV.

        Raises:
            MemoryError: no request slot or no room in the pools (nothing stays allocated).
        """
        req = make_req(rid, prompt_len, output_len=0)
        if self.req_to_token_pool.alloc([req]) is None:
            raise MemoryError(f"prefill: no request slot for {rid}")
        dev = self.allocator.device
        loc = self.allocator.alloc_extend(
            prefix_lens=torch.tensor([0], dtype=torch.int64, device=dev),
            prefix_lens_cpu=torch.tensor([0], dtype=torch.int64),
            seq_lens=torch.tensor([prompt_len], dtype=torch.int64, device=dev),
            seq_lens_cpu=torch.tensor([prompt_len], dtype=torch.int64),
            last_loc=torch.tensor([-1], dtype=torch.int64, device=dev),
            extend_num_tokens=prompt_len,
        )
        if loc is None:
            self.req_to_token_pool.free(req)
            raise MemoryError(f"prefill: pools cannot hold {prompt_len} tokens of {rid}")
        kv = compat.req_kv(req)
        self.req_to_token_pool.write((kv.req_pool_idx, slice(0, prompt_len)), loc.to(torch.int32))
        kv.kv_allocated_len = prompt_len
        kv.kv_committed_len = prompt_len
        # The first output token, sampled at the end of prefill, goes to decode with the KV.
        req.output_ids.append(100_000)
        return req

    def release(self, req: Any) -> None:
        """Free a transferred (or aborted) request through ``release_kv_cache(checkpoint=False)``."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        if not req.finished():
            req.finished_reason = FINISH_ABORT("transferred")
        compat.release_kv_cache(req, self.tree_cache, checkpoint=False)

    def locs(self, req: Any, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full and SWA slots of tokens ``start..end-1`` (see :func:`token_locs`)."""
        return token_locs(self.req_to_token_pool, self.allocator, req, start, end)

    def free_pages(self) -> dict[str, frozenset[int]]:
        return free_pages(self.allocator)

    def free_sizes(self) -> dict[str, int]:
        return free_sizes(self.allocator)

    def resources(self) -> dict[str, int]:
        """The resources besides KV pages, by ledger name: free request rows, tokens under a tree lock."""
        return {
            "req_slots": pdstate.request_rows(self.req_to_token_pool)[0],
            "tree_locked": pdstate.tree_locked(self.tree_cache)[0],
        }
