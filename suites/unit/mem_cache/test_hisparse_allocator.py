"""DeepSeek-V4 hisparse allocator on the PD decode side, with real objects.

Upstream's ``test_hisparse_allocator.py`` cases, redone without mocks: the allocator, the pools,
``HiSparseCoordinator``, ``_swa_tail_len`` and ``_pre_alloc`` are sglang's own (built by
``harness.targets.sglang``); only the idle-scheduler environment is hand-made. Effects are observed
through the allocators' real state (free sizes, the full->SWA mapping), never through a spy.
"""

from __future__ import annotations

import pytest
import torch

from harness.api import expect, make_req

pytestmark = [pytest.mark.topology("cpu"), pytest.mark.est_time(3)]

PAGE = 256
WINDOW = 200


def _pages(tokens: int, page: int = PAGE) -> int:
    """Tokens rounded up to whole pages (what a paged allocator charges)."""
    return -(-tokens // page) * page


def test_alloc_extend_swa_tail_forwarded_to_logical_allocator(hisparse_side):
    allocator = hisparse_side.allocator
    logical = allocator.logical_attn_allocator
    device = hisparse_side.config.device
    fill, tail = 700, 188  # 700 - 188 = 512: page-aligned evicted prefix
    before = hisparse_side.snapshot()
    hisparse_mapping_before = allocator.full_to_hisparse_device_index_mapping.clone()

    kv_loc = allocator.alloc_extend_swa_tail(
        prefix_lens=torch.tensor([0], dtype=torch.int64, device=device),
        prefix_lens_cpu=torch.tensor([0], dtype=torch.int64),
        seq_lens=torch.tensor([fill], dtype=torch.int64, device=device),
        seq_lens_cpu=torch.tensor([fill], dtype=torch.int64),
        last_loc=torch.tensor([-1], dtype=torch.int64, device=device),
        extend_num_tokens=fill,
        swa_tail_len=tail,
    )

    assert kv_loc is not None and kv_loc.numel() == fill
    # The logical allocator took full pages for the whole fill and SWA pages for the tail only;
    # the hisparse device allocator and its mapping were not touched.
    assert hisparse_side.snapshot().taken_since(before) == {"full": _pages(fill), "swa": _pages(tail)}
    assert torch.equal(allocator.full_to_hisparse_device_index_mapping, hisparse_mapping_before)
    mapping = logical.full_to_swa_index_mapping[kv_loc]
    assert bool((mapping[: fill - tail] == 0).all()), "evicted prefix must have no SWA slot"
    assert bool((mapping[fill - tail :] > 0).all()) and mapping[fill - tail :].unique().numel() == tail

    allocator.free(kv_loc)
    assert hisparse_side.snapshot().free() == before.free()


def test_decode_budget_uses_full_logical_capacity_for_swa_tail(hisparse_side):
    logical = hisparse_side.allocator.logical_attn_allocator
    assert hisparse_side.uses_swa_tail()
    # min(full, SWA) is what a non-SWA-tail budget would use; the SWA tail needs only the window.
    assert logical.available_size() < logical.full_available_size()

    full_budget, swa_budget = hisparse_side.admission_budget()

    assert full_budget == logical.full_available_size()
    assert swa_budget == logical.swa_available_size()

    req = make_req("budget", prompt_len=512)
    hisparse_side.prealloc(req)
    full_after, swa_after = hisparse_side.admission_budget()
    expect(
        "admission budgets spent",
        full=(full_budget - full_after, _pages(512)),
        swa=(swa_budget - swa_after, _pages(256)),
    )
    hisparse_side.release(req)
    full_back, swa_back = hisparse_side.admission_budget()
    expect("admission budgets after release", full=(full_back, full_budget), swa=(swa_back, swa_budget))


def test_decode_prealloc_direct_to_host(hisparse_side):
    fill = 512
    req = make_req("seed", prompt_len=fill)  # one output token received: fill_len == prompt
    assert hisparse_side.fill_len(req) == fill
    # The real _swa_tail_len: window start 512 - 200 = 312, floored to page 256 -> tail 256.
    assert hisparse_side.swa_tail_len(fill) == 256
    before = hisparse_side.snapshot()

    result = hisparse_side.prealloc(req)

    after = hisparse_side.snapshot([req])
    state = after.request("seed")
    host_slots = hisparse_side.coordinator.host_token_len(fill)
    expect(
        "hisparse prealloc",
        fill_len=(result.fill_len, fill),
        swa_tail_len=(result.swa_tail_len, 256),
        swa_evicted_seqlen=(state.swa_evicted_seqlen, 256),
    )
    assert state.kv_allocated_len == fill
    # Direct-to-host: full and SWA charged from the logical pools, no hisparse device pages, host
    # slots for the compressed (C4) KV as the RDMA destination.
    assert after.taken_since(before) == {"full": _pages(fill), "swa": _pages(256), "req_slots": 1, "host": host_slots}
    assert result.destination.numel() == host_slots
    assert tuple(result.destination.tolist()) == state.host_indices[:host_slots]
    assert all(slot == 0 for slot in state.swa_indices[:256]), "evicted prefix must have no SWA slot"
    assert len(set(state.swa_indices[256:])) == 256 and 0 not in state.swa_indices[256:]

    hisparse_side.release(req)
    assert hisparse_side.snapshot().free() == hisparse_side.baseline.free()
