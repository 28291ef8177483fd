"""Decode prealloc reclaims evictable SWA pages of the decode radix cache (sglang #40309).

With ``--disaggregation-decode-enable-radix-cache`` finished requests leave their window pages in
the tree as evictable SWA. Admission (``_swa_aware_allocatable_token_budgets``) counts free *and*
evictable SWA, so ``_pre_alloc`` itself must evict SWA pages when the free ones fall short; before
#40309 it reclaimed only full-attention pages and a request that passed admission failed with
"KV cache is full!". Here a small SWA pool is left holding a cached page, and the next request's
tail needs every SWA page: the real ``_pre_alloc`` must succeed: a prealloc admission accepted must
not fail (the ledger's ``alloc-after-admit`` invariant, the same one the PD decode ranks record).
"""

from __future__ import annotations

import pytest

from harness.api import PoolSizes, PreallocFailed, make_req, require_capability

PAGE, WINDOW = 64, 100
# Three SWA pages: one stays cached after the first request, the second request's tail needs all three.
SIZES = PoolSizes(full_tokens=48 * PAGE, swa_tokens=3 * PAGE, req_slots=4, max_context_len=4096)


def test_prealloc_reclaims_evictable_swa_pages(decode_side):
    require_capability("decode-radix-swa-reclaim")  # the fix under test: a release before it has nothing to check
    side = decode_side(page_size=PAGE, window=WINDOW, radix_cache=True, sizes=SIZES)
    first = make_req("cached", prompt_len=300)
    side.prealloc(first)
    side.release(first)
    cached = side.snapshot()
    assert cached.tree_swa_evictable > 0, "the first request must leave SWA pages in the radix cache"

    second = make_req("needs-reclaim", prompt_len=1100)
    tail = side.swa_tail_len(side.fill_len(second))
    tail_pages = -(-tail // PAGE) * PAGE
    assert cached.swa < tail_pages <= cached.swa + cached.tree_swa_evictable, "the case must need SWA eviction"
    _, swa_budget = side.admission_budget()
    assert swa_budget >= tail_pages, "admission counts the evictable SWA pages"

    try:
        result = side.prealloc(second)
    except PreallocFailed as failed:  # "KV cache is full!" without the SWA reclaim
        pytest.fail(
            f"[alloc-after-admit] admission's SWA budget {swa_budget} covers the tail ({tail_pages}) "
            f"but the prealloc failed: {failed}"
        )

    assert result.swa_tail_len == tail
    assert side.snapshot().taken_since(cached)["swa"] == tail_pages - cached.tree_swa_evictable
    side.release(second)
    side.evict_cache()
    assert side.snapshot().free() == side.baseline.free()
