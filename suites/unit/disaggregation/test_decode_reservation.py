"""The PD decode admission reservation covers what the paged allocator really takes (sglang #35265).

``DecodePreallocQueue._prealloc_required_tokens(req)`` is the decode-side reservation admission
checks a request against (``_check_if_req_exceed_kv_capacity``, ``pop_preallocated``,
``resume_retracted_reqs``): the full length and the SWA tail, each plus the decode reserve. The
paged allocator hands out whole pages, so a reservation not rounded up to a page under-counts by
up to ``page - 1`` tokens per pool and admission over-commits. Here the reservation, less each pool's
decode reserve (from the configuration), is compared with the pool slots the real ``_pre_alloc``
then takes, on fills and tails that end mid-page (the ledger's ``reserve-short`` rule).
"""

from __future__ import annotations

import pytest

from harness.api import ledger, make_req

# (page size, window, prompt length): each fill ends mid-page and each tail is unaligned.
CASES = [
    pytest.param(64, 100, 300, id="page64-fill300"),
    pytest.param(64, 100, 1000, id="page64-fill1000"),
    pytest.param(16, 100, 250, id="page16-fill250"),
    pytest.param(256, 128, 385, id="page256-fill385"),
]


@pytest.mark.parametrize("page, window, prompt_len", CASES)
def test_prealloc_reservation_covers_allocated_pages(decode_side, page: int, window: int, prompt_len: int):
    side = decode_side(page_size=page, window=window)
    req = make_req("reserve", prompt_len=prompt_len)
    fill = side.fill_len(req)
    assert fill % page, "the case must end mid-page, else rounding cannot matter"
    tail = side.swa_tail_len(fill)
    assert tail % page, "the tail must end mid-page too, else the SWA rounding cannot matter"
    # sglang's own reservation for this request (the queue is the real DecodePreallocQueue).
    full_required, swa_required = side.reservation(req)
    config = side.ledger_config()

    before = side.snapshot()
    side.prealloc(req)
    taken = side.snapshot().taken_since(before)

    # The ledger's rule, with each pool's decode reserve (config, not sglang's answer) taken off:
    # 512 reserved tokens would otherwise hide a reservation short of the whole pages by < 1 page.
    event = ledger.Event(
        seq=0,
        ts=0.0,
        kind="prealloc",
        rid="reserve",
        component="decode",
        worker="unit",
        page_size=page,
        fill_len=fill,
        swa_tail_len=tail,
        pages={"full": taken["full"] // page, "swa": taken["swa"] // page},
        reserved={"full": full_required, "swa": swa_required},
    )
    broken = [str(v) for v in ledger.prealloc_violations(config, event)]
    assert not broken, "; ".join(broken)
    assert full_required - config.decode_reserve >= taken["full"]
    assert swa_required - config.swa_decode_reserve >= taken["swa"]
    side.release(req)
    assert side.snapshot().free() == side.baseline.free()
