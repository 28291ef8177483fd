"""The server probe's KV reads on sglang's real CPU pool and allocator (no server): the registered buffers are
found by pointer and read as the transfer addresses them, a changed byte changes that page's digest only, an
unknown buffer is named, and the canary fills exactly the pages decode's allocator frees."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harness.engines.server import kv_digest
from harness.engines.server.probe_read import ProbeReadError

P = 64


@pytest.fixture
def pool():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(8 * P, P, torch.bfloat16, 2, 16, 2, "cpu", False)


def test_pages_are_read_where_the_transfer_reads_them(pool):
    ptrs, _, item_lens = pool.get_contiguous_buf_infos()
    views = kv_digest.page_views(pool, ptrs, item_lens)
    assert len(views) == 4 and all(v.shape[1] == P * 2 * 16 * 2 for v in views)
    before = kv_digest.digest_pages(views, [1, 2])
    pool.v_buffer[1][P + 3, 1, 7] = 1.5  # one value of page 1, layer 1's V
    after = kv_digest.digest_pages(views, [1, 2])
    changed = [(b, i) for b in range(4) for i in range(2) if before[b][i] != after[b][i]]
    assert changed == [(3, 0)]


def test_a_buffer_outside_the_pool_is_named(pool):
    ptrs, _, item_lens = pool.get_contiguous_buf_infos()
    with pytest.raises(ProbeReadError, match="kv buffer 1"):
        kv_digest.page_views(pool, [ptrs[0], 12345], item_lens[:2])


def test_the_canary_fills_the_pages_the_allocator_frees(pool):
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    allocator = PagedTokenToKVPoolAllocator(8 * P, P, torch.bfloat16, "cpu", pool, need_sort=True)
    ptrs, _, item_lens = pool.get_contiguous_buf_infos()
    side = kv_digest._Side(canary=True, allocator=allocator)
    assert side.read(None, pool, SimpleNamespace(kv_data_ptrs=ptrs, kv_item_lens=item_lens), "r", P) is not None
    release = kv_digest._wrap_release_pages(side, type(allocator)._release_page_ids)
    slots = allocator.alloc(2 * P)
    pages = sorted({int(s) // P for s in slots})
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.fill_(0.25)
    release(allocator, torch.tensor(pages))
    assert side.canaried == set(pages)
    for v in side.views:
        assert bool((v[pages] == kv_digest.CANARY_BYTE).all()) and not bool((v[7] == kv_digest.CANARY_BYTE).any())
    assert kv_digest.digest_pages(side.views, pages[:1]) == [[d] for d in side.expect]
