"""SWA accounting of PD decode prealloc on both paths, with real objects (sglang #35286 / #35396).

On PD decode prealloc ``swa_evicted_seqlen = fill_len - swa_tail_len`` must be >= 0 and a multiple
of the page size, on ``alloc_for_decode_prealloc`` (SWAKVPool) and
``alloc_for_decode_prealloc_hisparse`` (DeepSeek-V4). Upstream's test replaced ``_swa_tail_len``
and the allocator with mocks; here every allocator, pool, ``_swa_tail_len``, ``_pre_alloc`` and
release is sglang's own (``harness.targets.sglang``), and Hypothesis sweeps page size, window,
fill length, output tokens received from prefill, radix cache on/off, several live requests and
pool pressure. Invariants, on every case:

* evicted = fill - tail is >= 0 and page-aligned; tokens before it map to no SWA slot, tokens
  after it to distinct live SWA slots (distinct across all live requests too);
* tail >= min(W, fill) and tail < W + page, where W is the window (with the decode radix cache,
  sglang keeps ``max(window, page) + 1`` tokens before the floor, so W is that);
* the full pool is charged ceil(fill) pages, the SWA pool ceil(tail) pages, the hisparse device
  pool nothing, the host pool the C4 slots of the fill;
* a prealloc fails exactly when it does not fit, and a failure leaves every pool and every live
  request exactly as before;
* after release (and, with the radix cache, evicting it) every pool is back to its baseline.

Requests always carry at least one prompt token: sglang's scheduler rejects empty requests before
they reach prealloc; fill 0 is covered through ``_swa_tail_len`` itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.targets.sglang import SWA_PAGE_SIZES, DecodeSide, PoolSizes, PreallocFailed, compat, make_req

logger = logging.getLogger(__name__)

pytestmark = [pytest.mark.topology("cpu"), pytest.mark.est_time(40)]

HISPARSE_PAGE = 256
MAX_PROMPT = 1200
# Bounded so the file runs in well under a minute on a busy 2-core machine.
SWEEP = settings(max_examples=80, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _pages(tokens: int, page: int) -> int:
    return -(-tokens // page) * page


def _edge_lengths(page: int) -> list[int]:
    """Fill lengths at and around page boundaries: 0, 1, page-1, page, page+1, multiples."""
    return sorted({0, 1, page - 1, page, page + 1, 2 * page - 1, 2 * page, 2 * page + 1, 3 * page, 5 * page + 3})


@dataclass(frozen=True)
class Scenario:
    """One generated case: the decode worker's configuration and the requests it receives."""

    hisparse: bool
    page: int
    window: int | None
    radix_cache: bool
    sizes: PoolSizes
    requests: tuple[tuple[int, int], ...]  # (prompt_len, output tokens received from prefill)


@st.composite
def scenarios(draw, with_hisparse: bool = True) -> Scenario:
    hisparse = with_hisparse and draw(st.integers(0, 3)) == 0  # one case in four on the hisparse path
    page = HISPARSE_PAGE if hisparse else draw(st.sampled_from(SWA_PAGE_SIZES))
    windows = [st.none(), st.just(0), st.just(page), st.integers(1, 1500)]
    if page > 1:
        windows.append(st.integers(1, page - 1))  # window smaller than a page
    window = draw(st.one_of(*windows))
    if hisparse and not window:
        window = draw(st.integers(1, 1500))  # DeepSeek-V4 always has a sliding window
    radix_cache = (not hisparse) and draw(st.booleans())
    edges = [n for n in _edge_lengths(page) if 1 <= n <= MAX_PROMPT]
    prompt = st.one_of(st.sampled_from(edges), st.integers(1, MAX_PROMPT))
    if window:
        prompt = st.one_of(prompt, st.sampled_from([window, window + 1, max(window - 1, 1)]))
    requests = draw(st.lists(st.tuples(prompt, st.integers(0, 3)), min_size=1, max_size=4))
    if draw(st.booleans()):  # pool pressure: small pools, few request slots
        unit = max(page, 64)
        sizes = PoolSizes(full_tokens=unit * draw(st.integers(2 if hisparse else 1, 16)),
                          swa_tokens=unit * draw(st.integers(1, 8)), req_slots=draw(st.integers(1, 4)))
    else:
        sizes = PoolSizes()
    return Scenario(hisparse, page, window, radix_cache, sizes, tuple(requests))


def _check_tail(side: DecodeSide, fill: int, tail: int) -> None:
    """The tail invariants for one fill length, against sglang's own ``_swa_tail_len`` result."""
    config, page = side.config, side.config.page_size
    if not side.uses_swa_tail() or not config.window or fill <= 0:
        assert tail == max(fill, 0), f"no SWA-tail prealloc here: tail must be the fill ({fill}), got {tail}"
        return
    evicted = fill - tail
    assert evicted >= 0, f"fill {fill}: negative evicted prefix {evicted} (tail {tail})"
    assert evicted % page == 0, f"fill {fill}: evicted prefix {evicted} is not a multiple of page {page}"
    keep = max(config.window, page) + 1 if config.radix_cache else config.window
    assert tail >= min(keep, fill), f"fill {fill}: tail {tail} shorter than the window {keep}"
    assert tail < keep + page, f"fill {fill}: tail {tail} not < window {keep} + page {page}"


def _fits(side: DecodeSide, free: dict[str, int], fill: int, tail: int) -> bool:
    page = side.config.page_size
    swa_need = _pages(tail, page) if side.uses_swa_tail() else fill
    return free["req_slots"] >= 1 and free["full"] >= _pages(fill, page) and free["swa"] >= swa_need


def _expected_charge(side: DecodeSide, fill: int, tail: int) -> dict[str, int]:
    page = side.config.page_size
    charge = {"full": _pages(fill, page), "swa": _pages(tail, page) if side.uses_swa_tail() else fill,
              "req_slots": 1}
    if side.coordinator is not None:
        host_page = side.allocator.hisparse_page_size
        charge["host"] = _pages(side.coordinator.host_token_len(fill), host_page)
    return {pool: n for pool, n in charge.items() if n}


def _check_live_disjoint(states) -> None:
    full = [slot for state in states for slot in state.full_indices]
    swa = [slot for state in states for slot in state.swa_indices if slot]
    assert len(full) == len(set(full)), "two live requests share a full-pool slot"
    assert len(swa) == len(set(swa)), "two live requests share an SWA slot"


def run_scenario(scenario: Scenario, device: str) -> None:
    """Build the decode side, preallocate every request, check every invariant, release all."""
    side = DecodeSide(_config(scenario, device))
    for fill in _edge_lengths(scenario.page):
        _check_tail(side, fill, side.swa_tail_len(fill))

    live = []
    for i, (prompt_len, output_len) in enumerate(scenario.requests):
        req = make_req(f"r{i}", prompt_len, output_len)
        fill = side.fill_len(req)
        assert fill == prompt_len + max(output_len - 1, 0)
        tail = side.swa_tail_len(fill)
        _check_tail(side, fill, tail)
        before = side.snapshot(live)
        fits = _fits(side, before.free(), fill, tail)
        try:
            result = side.prealloc(req)
        except PreallocFailed as failed:
            assert not fits, f"prealloc of fill {fill} (tail {tail}) failed with {before.free()} free"
            # The allocator checks before it allocates: a failure holds no full or SWA page.
            assert not {"full", "swa", "hisparse_device"} & set(failed.held), f"failure took KV: {failed.held}"
            assert side.snapshot(live) == before, "a failed prealloc changed the pools or a live request"
            continue
        assert fits, f"prealloc of fill {fill} (tail {tail}) succeeded with only {before.free()} free"

        after = side.snapshot([*live, req])
        state = after.request(req.rid)
        assert (result.fill_len, result.swa_tail_len) == (fill, tail)
        assert state.kv_allocated_len == fill and state.kv_committed_len == fill
        evicted = fill - tail if side.uses_swa_tail() else 0
        assert state.swa_evicted_seqlen == evicted
        assert after.taken_since(before) == _expected_charge(side, fill, tail)
        assert after.requests[:-1] == before.requests, "prealloc changed another live request"
        assert all(slot == 0 for slot in state.swa_indices[:evicted]), "an evicted token kept an SWA slot"
        live_tail = state.swa_indices[evicted:]
        assert 0 not in live_tail and len(set(live_tail)) == tail, "tail tokens need distinct live SWA slots"
        if side.coordinator is None:
            assert tuple(result.destination.tolist()) == state.full_indices
        else:
            assert tuple(result.destination.tolist()) == state.host_indices[: result.destination.numel()]
        _check_live_disjoint(after.requests)
        live.append(req)

    for req in live:
        side.release(req)
    side.evict_cache()
    assert side.snapshot().free() == side.baseline.free(), "pools did not return to their baseline"


def _config(scenario: Scenario, device: str):
    from harness.targets.sglang import DecodeConfig

    return DecodeConfig(hisparse=scenario.hisparse, page_size=scenario.page, window=scenario.window,
                        radix_cache=scenario.radix_cache, sizes=scenario.sizes, device=device)


def test_swa_prealloc_accounting_sweep(device, record_property):
    # A target that cannot build the hisparse graph on this device (the adapter says which
    # capability) still sweeps the SWAKVPool path; the hisparse cases are left out and recorded.
    with_hisparse = compat.device_missing(device, page_size=HISPARSE_PAGE, hisparse=True) is None
    record_property("hisparse_swept", with_hisparse)
    # Warm-up outside the timing: the first build imports sglang's pool and decode modules.
    for warm in (Scenario(False, 64, 100, False, PoolSizes(), ((300, 1),)),
                 Scenario(True, 256, 128, False, PoolSizes(), ((700, 1),))):
        if with_hisparse or not warm.hisparse:
            run_scenario(warm, device)
    cases = []

    @SWEEP
    @given(scenarios(with_hisparse))
    def sweep(scenario: Scenario) -> None:
        cases.append(scenario)
        run_scenario(scenario, device)

    start = time.perf_counter()
    sweep()
    elapsed = time.perf_counter() - start
    rate = len(cases) / elapsed if elapsed else 0.0
    record_property("hypothesis_cases", len(cases))
    record_property("hypothesis_cases_per_s", round(rate, 1))
    logger.warning("SWA prealloc sweep: %d cases in %.1f s (%.1f cases/s)", len(cases), elapsed, rate)


@pytest.mark.parametrize(
    ("hisparse", "page", "window", "radix_cache", "fill", "tail"),
    [
        (False, 64, 100, False, 300, 108),
        (False, 64, 100, False, 1000, 104),
        (False, 256, 128, False, 385, 129),
        (False, 64, 100, True, 300, 108),
        (True, 256, 128, False, 700, 188),
        (True, 256, 200, False, 512, 256),
    ],
)
def test_swa_tail_len_known_values(decode_side, hisparse, page, window, radix_cache, fill, tail):
    side = decode_side(hisparse=hisparse, page_size=page, window=window, radix_cache=radix_cache)
    req = make_req("known", fill)
    result = side.prealloc(req)
    assert (result.fill_len, result.swa_tail_len) == (fill, tail)
    assert side.snapshot([req]).request("known").swa_evicted_seqlen == fill - tail
    side.release(req)
    side.evict_cache()
    assert side.snapshot().free() == side.baseline.free()


def test_radix_prefix_hit_charges_new_full_pages_and_a_fresh_swa_tail(decode_side):
    # With the decode radix cache a released request's full KV stays in the tree; a later request
    # sharing its prompt reuses those full pages (prefix) and still gets its whole SWA tail fresh.
    page, window = 64, 40
    side = decode_side(page_size=page, window=window, radix_cache=True)
    first = make_req("first", 300)
    side.prealloc(first)
    side.release(first)
    before = side.snapshot()
    assert before.tree_full_evictable == 256  # the committed, page-aligned prefix went into the tree

    second = make_req("second", 400)  # prompt 0..399 extends the first prompt 0..299
    result = side.prealloc(second)

    after = side.snapshot([second])
    state = after.request("second")
    evicted = result.fill_len - result.swa_tail_len
    # Radix mode keeps max(window, page) + 1 tokens before the floor: 399 - 64 = 335 -> 320.
    assert (result.prefix_len, result.swa_tail_len, state.swa_evicted_seqlen) == (256, 80, 320)
    assert after.taken_since(before) == {"full": _pages(400, page) - 256, "swa": _pages(80, page), "req_slots": 1}
    assert all(slot == 0 for slot in state.swa_indices[result.prefix_len:evicted])
    tail = state.swa_indices[evicted:]
    assert 0 not in tail and len(set(tail)) == result.swa_tail_len

    side.release(second)
    side.evict_cache()
    assert side.snapshot().free() == side.baseline.free()


@pytest.mark.parametrize(
    ("hisparse", "page", "window", "prompt_len"),
    [(False, 64, 100, 300), (False, 256, 128, 700), (True, 256, 128, 700)],
)
def test_unaligned_swa_tail_trips_real_assertion_and_leaks_pages(decode_side, record_property, hisparse, page,
                                                                 window, prompt_len):
    side = decode_side(hisparse=hisparse, page_size=page, window=window)
    req = make_req("unaligned", prompt_len)
    fill = side.fill_len(req)
    # Real inputs that bypass the floor: the window start without rounding down to a page.
    unaligned_tail = fill - max(0, fill - window)
    assert (fill - unaligned_tail) % page != 0
    before = side.snapshot()

    with pytest.raises(AssertionError) as raised:
        side.alloc_with_tail(req, unaligned_tail)

    frame = raised.traceback[-1]
    assert frame.path.name == "decode.py" and "sglang" in str(frame.path), "must be sglang's own assertion"
    assert "page_size" in str(frame.statement)
    # sglang allocated before asserting and recorded no SWA eviction: these pages have no owner
    # that could release them.
    leaked = side.snapshot().taken_since(before)
    record_property("leaked_slots", leaked)
    logger.info("unaligned tail %d of fill %d leaked %s", unaligned_tail, fill, leaked)
    assert leaked == {"full": _pages(fill, page), "swa": _pages(unaligned_tail, page), "req_slots": 1}
    assert side.snapshot([req]).request("unaligned").swa_evicted_seqlen == 0
