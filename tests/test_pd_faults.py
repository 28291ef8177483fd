"""The PD path in this process (no Ray), on real sglang objects: a workload passes clean with the
eviction interval 1 and with sglang's default, and the harness's own runtime fault (one corrupted
KV page) is caught by content verification naming request and page. sglang's faults are source
patches, run through the kill matrix (``harness faults check``) on the PD suites.
"""

from __future__ import annotations

import pytest

from harness import faults, ledger
from harness.engines.sim.decode_rank import DecodeWorker, KVCorruption
from harness.engines.sim.prefill_rank import PrefillWorker
from harness.engines.sim.driver import run
from harness.engines.sim.workload import KVSpec, PDRequest
from pdpair import SPEC, pair  # noqa: F401 - the module's fixture (F811 where a test or fixture takes it)

REQS = [
    PDRequest("r300", 300, decode_steps=150),
    PDRequest("r129", 129, decode_steps=40),
    PDRequest("r64", 64, decode_steps=3),
]


@pytest.fixture
def fresh(pair):  # noqa: F811
    """The pair with fresh pools (a fault may have left pages behind in the previous test)."""
    pair.decode.members[0].live.clear()
    pair.prefill.members[0].reqs.clear()
    pair.configure(SPEC)
    return pair


@pytest.fixture
def inject():
    before = set(faults.active())
    yield lambda name: faults.activate([name])
    # A fault may bring the faults it requires: undo everything this test turned on.
    faults.deactivate([n for n in faults.active() if n not in before])


def rules(violations) -> set[str]:
    return {v.rule for v in violations}


def test_tp_ranks_hold_their_head_shard(tmp_path):
    """A TP4 rank's SWAKVPool stores a quarter of the KV heads: a quarter of TP1's bytes per page."""
    tp1 = DecodeWorker("d-tp1", 0, SPEC, str(tmp_path))
    tp4 = [DecodeWorker(f"d-tp4-r{r}", r, SPEC, str(tmp_path), tp=4) for r in range(4)]
    p4 = PrefillWorker("p-tp4-r3", 3, SPEC, str(tmp_path), tp=4)
    try:
        full1, full4 = tp1.layout()["full"], tp4[0].layout()["full"]
        assert [b // 4 for b in full1] == full4
        assert all(w.layout() == tp4[0].layout() for w in tp4) and p4.layout() == tp4[0].layout()
        with pytest.raises(ValueError, match="TP 3 does not divide"):
            DecodeWorker("d-tp3", 0, SPEC, str(tmp_path), tp=3)
    finally:
        for w in (tp1, *tp4, p4):
            w.close()


def test_clean_run_passes(fresh):
    res = run(fresh, REQS)
    res.assert_clean()
    assert sorted(res.completed) == sorted(r.rid for r in REQS)
    # Each eviction really freed the positions from its old floor to its new one, read from the rows
    # (what the ledger's window rule judges, as it judges the real server probe's).
    floor, evictions = {}, 0
    for e in res.events:
        if e.component == "decode" and e.kind in ("prealloc", "evict") and not e.rid.startswith("<"):
            if e.kind == "evict":
                assert e.freed_spans == ((floor[e.rid], e.evicted_seqlen),), e
                evictions += 1
            floor[e.rid] = e.evicted_seqlen
    assert evictions >= 2, "the workload never evicted while decoding"


def test_clean_run_passes_with_sglangs_default_eviction_interval(fresh):
    # Decode frees SWA slots only every 128 tokens: the ledger's bound follows the configured interval.
    spec = KVSpec(**{**SPEC.__dict__, "eviction_interval": None})
    fresh.configure(spec)
    res = run(fresh, REQS)
    res.assert_clean()
    late = [e for e in res.events if e.kind == "decode_alloc" and e.rid == "r300"]
    assert max(e.fill_len - 1 - e.evicted_seqlen for e in late) > 100 + 64, "decode never held a late window"
    strict = [v for v in ledger.check(_with_interval(res.events, 1)) if v.rule == "swa-evict-late"]
    assert strict, "the same events must break the interval-1 bound (the rule depends on the configuration)"


def _with_interval(events, interval):
    out = []
    for e in events:
        if e.kind == "config" and e.component == "decode":
            e = ledger.Event(**{**e.__dict__, "config": {**e.config, "eviction_interval": interval}})
        out.append(e)
    return out


def test_corrupted_kv_page_is_caught_naming_request_and_page(fresh, inject):
    inject("corrupt-kv-page")
    with pytest.raises(KVCorruption) as info:
        run(fresh, REQS[:1])
    err = info.value
    assert err.rid == "r300" and err.pool == "full" and err.where.position == 0
    assert "request r300" in str(err) and f"page {err.where.page}" in str(err)


def test_kv_corruption_crosses_ray_intact():
    """Raised in a decode rank, re-raised in the driver: it must pickle (Ray ships exceptions that way)."""
    import pickle

    from harness.engines.sim import kvfill

    err = KVCorruption("r3", "swa", kvfill.Mismatch(buffer=1, position=5, page=3, slot=7), "after transfer")
    back = pickle.loads(pickle.dumps(err))
    assert (back.rid, back.pool, back.where, str(back)) == ("r3", "swa", err.where, str(err))


def test_a_page_passed_between_requests_within_a_step_is_not_a_cache_eviction(fresh):
    """Regression (found by a random e2e seed, replayed here): request A's window eviction frees an SWA
    page and request B's decode takes it in the same step. The ledger must show A freeing it and B
    taking it, not a phantom radix-cache eviction that double-frees it."""
    from harness.engines.sim.workload import workload

    spec = KVSpec(kind="swa", page_size=64, window=100, full_tokens=24 * 64, swa_tokens=10 * 64, req_slots=8)
    fresh.configure(spec)
    reqs = workload(
        1972833191, 200, page_size=64, max_prompt=6 * 64, max_steps=12, abort_rate=0.05, prefix="2-gpu-h100-0-"
    )
    res = run(fresh, reqs, chunk_pages=8)
    res.assert_clean()
    assert not [e for e in res.events if e.rid == ledger.CACHE_OWNER], "radix cache off: no cache evictions"
