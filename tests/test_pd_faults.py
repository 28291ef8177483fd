"""Injected faults on the PD path are caught: the same workload passes clean, and each fault from
the catalog (applied in-process to sglang / the transfer) makes the run fail with the evidence
named — ledger violations, sglang's assertion, or content verification naming request and page.

The prefill and decode payloads run in this process (no Ray), on real sglang objects.
"""

from __future__ import annotations

import pytest

from harness import faults, ledger
from harness.pd.decode import DecodeWorker, KVCorruption, PreallocError, WindowLost
from harness.pd.prefill import PrefillWorker
from harness.pd.ranks import Ranks
from harness.pd.run import PDPair, run
from harness.pd.spec import KVSpec, PDRequest

SPEC = KVSpec(kind="swa", page_size=64, window=100, full_tokens=32 * 64, swa_tokens=12 * 64, req_slots=8)
REQS = [PDRequest("r300", 300, decode_steps=150), PDRequest("r129", 129, decode_steps=40),
        PDRequest("r64", 64, decode_steps=3)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_SWA_EVICTION_INTERVAL", "1")
        run_dir = str(tmp_path_factory.mktemp("pd-faults"))
        prefill, decode = PrefillWorker("prefill-0", 0, SPEC, run_dir), DecodeWorker("decode-0", 0, SPEC, run_dir)
        p = PDPair(Ranks([prefill]), Ranks([decode]))
        yield p
        prefill.close()
        decode.close()


@pytest.fixture
def fresh(pair):
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


def test_unaligned_swa_tail_is_caught(fresh, inject):
    inject("swa-tail-unaligned")
    marks = fresh.ledger_marks()
    with pytest.raises(PreallocError, match="r300"):
        run(fresh, REQS[:1])
    events = fresh.events_since(marks)
    assert [e.kind for e in events] == ["alloc_fail"]
    got = ledger.check(events)
    assert "page-leak" in rules(got) and {v.rid for v in got} == {"r300"}


def test_unaligned_swa_tail_without_sglang_assert_is_caught_by_ledger_and_content(fresh, inject):
    inject("swa-tail-unaligned-noassert")
    marks = fresh.ledger_marks()
    # The SWA pages the transfer fills (page-floored window, as sglang's metadata names them) no
    # longer line up with the unaligned tail: the window's bytes are wrong on arrival.
    with pytest.raises((KVCorruption, WindowLost), match="r300"):
        run(fresh, REQS[:1])
    prealloc = [e for e in fresh.events_since(marks) if e.kind == "prealloc" and e.component == "decode"]
    assert prealloc[0].evicted_seqlen % 64 != 0
    assert "evicted-unaligned" in rules(ledger.check(prealloc))


def test_release_skipping_swa_pages_is_caught(fresh, inject):
    inject("release-leaks-swa")
    res = run(fresh, REQS)
    leaks = [v for v in res.violations if v.rule == "page-leak"]
    assert leaks and all("'swa'" in v.message for v in leaks)
    assert any("not back to baseline" in p for p in res.problems)
    with pytest.raises(AssertionError, match="page-leak"):
        res.assert_clean()


def test_decode_step_without_window_eviction_is_caught(fresh, inject):
    inject("decode-skips-swa-evict")
    res = run(fresh, REQS)
    over = [v for v in res.violations if v.rule == "swa-over-window"]
    assert over and over[0].rid == "r300"


def test_corrupted_kv_page_is_caught_naming_request_and_page(fresh, inject):
    inject("corrupt-kv-page")
    with pytest.raises(KVCorruption) as info:
        run(fresh, REQS[:1])
    err = info.value
    assert err.rid == "r300" and err.pool == "full" and err.where.position == 0
    assert "request r300" in str(err) and f"page {err.where.page}" in str(err)
