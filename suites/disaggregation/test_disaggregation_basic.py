"""1P1D over Ray on the 2-GPU H100 topology: hybrid-SWA pools, real prealloc/decode/release paths.

Each test runs a workload through a prefill worker and a decode worker (real sglang allocators on
the worker's device: CUDA when it has one, else CPU), with every KV byte verified on arrival and
through decode, and the accounting ledger of both sides as the oracle.

The failure paths of the real stack's ``test_disaggregation_failure_paths_server.py`` that the simulated
engine has too get the same test here, each reached deterministically by the request's own marker (an
abort after some transfer chunks or decode steps, a transfer that fails after some chunks, a retraction
after some decode steps): the ledger first proves the hazard happened in that phase, then every pool of
both ranks must be back at its baseline and the pair must still serve a clean request.
"""

from __future__ import annotations

import pytest

from harness.api import KVSpec, PDRequest, expect, require_capability, run

pytestmark = [pytest.mark.topology("2-gpu-h100"), pytest.mark.est_time(90), pytest.mark.timeout(900)]

PAGE, WINDOW = 64, 100
SPEC = KVSpec(kind="swa", page_size=PAGE, window=WINDOW, full_tokens=40 * PAGE, swa_tokens=16 * PAGE, req_slots=8)


def _ids(reqs):
    return sorted(r.rid for r in reqs)


def _events(res, component, rid, kind):
    return [e for e in res.events if e.component == component and e.rid == rid and e.kind == kind]


def _pages(event):
    return sum(len(p) for p in event.pages.values())


def _serves(pair, rid):
    """The pair still serves a clean request after a failure path, and its books balance."""
    res = run(pair, [PDRequest(rid, 5 * PAGE + 3, decode_steps=4)])
    res.assert_clean()
    assert res.completed == [rid], res.summary()


def test_mixed_prompt_lengths_around_page_boundaries(pd_pair, pd_report):
    pair = pd_pair(SPEC)
    lengths = [
        1,
        PAGE - 1,
        PAGE,
        PAGE + 1,
        WINDOW,
        2 * PAGE - 1,
        2 * PAGE,
        2 * PAGE + 1,
        3 * PAGE,
        3 * PAGE + 1,
        300,
        5 * PAGE - 1,
        10 * PAGE,
    ]
    reqs = [PDRequest(f"len{n}", n, decode_steps=3) for n in lengths]
    res = run(pair, reqs)
    pd_report(res)
    res.assert_clean()
    assert sorted(res.completed) == _ids(reqs)
    tails = {e.rid: e for e in res.events if e.component == "decode" and e.kind == "prealloc"}
    # sglang's own numbers for page 64 / window 100 (reference measurements): fill 300 -> tail 108.
    for rid, fill, tail, evicted in (("len300", 300, 108, 192), ("len1", 1, 1, 0)):
        ev = tails[rid]
        expect(
            f"decode prealloc of {rid}",
            fill_len=(ev.fill_len, fill),
            swa_tail_len=(ev.swa_tail_len, tail),
            evicted_seqlen=(ev.evicted_seqlen, evicted),
        )


def test_concurrent_requests_decode_together(pd_pair, pd_report):
    pair = pd_pair(SPEC)
    reqs = [PDRequest(f"c{i}", 90 + 37 * i, decode_steps=20 + 5 * i) for i in range(8)]
    res = run(pair, reqs)
    pd_report(res)
    res.assert_clean()
    assert sorted(res.completed) == _ids(reqs)
    assert res.max_running >= 4, f"decode batch never held several requests: {res.summary()}"


@pytest.mark.parametrize("interval", [1, None], ids=["evict-every-token", "evict-sglang-default"])
def test_long_decode_keeps_the_window_and_evicts_within_the_interval(pd_pair, pd_report, interval):
    # Decode well past window + sglang's default interval (128), so SWA slots are freed while decoding
    # either way; the ledger's decode rules follow the configured interval (swa-evict-late,
    # swa-window-lost) and every step's window bytes are verified.
    spec = KVSpec(
        kind="swa",
        page_size=PAGE,
        window=WINDOW,
        full_tokens=40 * PAGE,
        swa_tokens=24 * PAGE,
        req_slots=8,
        eviction_interval=interval,
    )
    pair = pd_pair(spec)
    reqs = [PDRequest(f"long{i}", 150 + 61 * i, decode_steps=260 + 7 * i) for i in range(3)]
    res = run(pair, reqs)
    pd_report(res)
    res.assert_clean()
    assert sorted(res.completed) == _ids(reqs)
    evicted = [e for e in res.events if e.component == "decode" and e.kind == "evict" and e.pages.get("swa")]
    assert evicted, "decode never freed an SWA page"


def test_pool_pressure_requests_wait_in_prealloc_queue_none_lost(pd_pair, pd_report):
    small = KVSpec(kind="swa", page_size=PAGE, window=WINDOW, full_tokens=14 * PAGE, swa_tokens=8 * PAGE, req_slots=4)
    pair = pd_pair(small)
    reqs = [PDRequest(f"p{i}", 250 + 13 * i, decode_steps=10) for i in range(16)]
    res = run(pair, reqs)
    pd_report(res)
    res.assert_clean()
    assert res.waited, "no request ever waited: the pools were not under pressure"
    assert sorted(res.completed) == _ids(reqs), "a request was lost under pool pressure"


def test_abort_mid_transfer_releases_both_sides(pd_pair, pd_report):
    pair = pd_pair(SPEC)
    reqs = [PDRequest(f"a{i}", 6 * PAGE + i, decode_steps=4, abort_after_chunks=1 if i % 2 else None) for i in range(6)]
    res = run(pair, reqs, chunk_pages=1)
    pd_report(res)
    res.assert_clean()
    assert sorted(res.aborted) == ["a1", "a3", "a5"]
    assert sorted(res.completed) == ["a0", "a2", "a4"]
    releases = {(e.component, e.rid) for e in res.events if e.kind == "release" and e.rid in res.aborted}
    assert releases == {(side, rid) for side in ("prefill", "decode") for rid in res.aborted}
    for rid in res.aborted:  # aborted mid-transfer, proven: prefill shipped fewer pages than decode awaited
        (prealloc,), (shipped,) = _events(res, "decode", rid, "prealloc"), _events(res, "prefill", rid, "transfer")
        assert 0 < _pages(shipped) < _pages(prealloc), f"{rid}: shipped {_pages(shipped)} of {_pages(prealloc)} pages"
    _serves(pair, "after-abort-mid-transfer")


def test_failed_transfer_mid_flight_decode_releases_what_it_preallocated(pd_pair, pd_report):
    # The twin of the real stack's failed and timed-out transfers: the transfer of every other request
    # fails after its first chunk, and decode gives it up through sglang's own failed-transfer path
    # (DecodeTransferQueue.pop_transferred on KVPoll.Failed: the path of sgl#6258 / #9817 / #7130).
    pair = pd_pair(SPEC)
    reqs = [PDRequest(f"f{i}", 6 * PAGE + i, decode_steps=4, fail_after_chunks=1 if i % 2 else None) for i in range(4)]
    res = run(pair, reqs, chunk_pages=1)
    pd_report(res)
    assert sorted(res.failed) == ["f1", "f3"] and sorted(res.completed) == ["f0", "f2"], res.summary()
    # The hazard, proven in the ledger: the transfer stopped part-way (prefill shipped fewer pages than
    # decode preallocated), and decode released the request as a failed transfer without ever
    # committing or decoding it.
    for rid in res.failed:
        (prealloc,), (shipped,) = _events(res, "decode", rid, "prealloc"), _events(res, "prefill", rid, "transfer")
        (release,) = _events(res, "decode", rid, "release")
        assert 0 < _pages(shipped) < _pages(prealloc), f"{rid}: shipped {_pages(shipped)} of {_pages(prealloc)} pages"
        assert release.note.startswith("failed transfer"), release
        assert not _events(res, "decode", rid, "transfer") and not _events(res, "decode", rid, "decode_alloc")
    res.assert_clean()  # every pool of both ranks back at its baseline, the books balanced
    _serves(pair, "after-failed-transfer")


def test_abort_mid_decode_frees_every_page(pd_pair, pd_report):
    # The twin of the real stack's abort mid-decode: a request aborted once it decoded past its window
    # (SWA pages already evicted), beside one that keeps decoding.
    pair = pd_pair(SPEC)
    reqs = [PDRequest("mid", 150, decode_steps=200, abort_after_steps=40), PDRequest("beside", 200, decode_steps=60)]
    res = run(pair, reqs)
    pd_report(res)
    assert res.aborted == ["mid"] and res.completed == ["beside"], res.summary()
    # The hazard, proven: the aborted request had decoded and slid SWA pages out of its window first.
    (release,) = _events(res, "decode", "mid", "release")
    evicted = [e for e in _events(res, "decode", "mid", "evict") if e.pages.get("swa")]
    assert release.note == "abort" and evicted and evicted[0].seq < release.seq, "not aborted mid-decode"
    assert len(_events(res, "decode", "mid", "decode_alloc")) == 40
    res.assert_clean()
    _serves(pair, "after-abort-mid-decode")


def test_retraction_resumes_with_its_kv_restored_and_leaves_no_kv(pd_pair, pd_report):
    # The twin of the real stack's retraction: a request retracted mid-decode (SWA pages already slid out
    # of its window), as decode retracts one under pool pressure: sglang's release_req backs its KV up and
    # releases its pages, resume_retracted_reqs preallocates it again and restores the backup (the path
    # of sgl#40309). Every restored byte is verified at its new pages, and the window at every step after.
    # A target without it (through 0.5.18) skips before any request runs: a request left live on the
    # pair's decode rank would fail the next test's configure.
    require_capability("decode-retraction")
    pair = pd_pair(SPEC)
    reqs = [PDRequest("back", 150, decode_steps=80, retract_after_steps=30), PDRequest("beside", 200, decode_steps=50)]
    res = run(pair, reqs)
    pd_report(res)
    assert res.retracted == ["back"] and sorted(res.completed) == ["back", "beside"], res.summary()
    # The hazard, proven: released as a retraction mid-decode, then preallocated again past its prompt.
    first, resumed = _events(res, "decode", "back", "prealloc")
    retraction, final = _events(res, "decode", "back", "release")
    assert retraction.note == "retract" and resumed.note == "resume", (retraction, resumed)
    assert first.seq < retraction.seq < resumed.seq < final.seq
    assert resumed.fill_len == 150 + 30, f"resumed at fill {resumed.fill_len}, not where it was retracted"
    assert any(e.pages.get("swa") and e.seq < retraction.seq for e in _events(res, "decode", "back", "evict")), (
        "retracted before it evicted any SWA page"
    )
    res.assert_clean()
    _serves(pair, "after-retraction")


@pytest.mark.parametrize("radix_cache", [False, True], ids=["radix-off", "radix-on"])
def test_radix_cache(pd_pair, pd_report, radix_cache):
    spec = KVSpec(
        kind="swa",
        page_size=PAGE,
        window=WINDOW,
        radix_cache=radix_cache,
        full_tokens=32 * PAGE,
        swa_tokens=12 * PAGE,
        req_slots=8,
    )
    pair = pd_pair(spec)
    reqs = [PDRequest(f"x{i}", 130 + 70 * (i % 4), decode_steps=5) for i in range(12)]
    groups = {r.rid: "shared" if i % 2 == 0 else r.rid for i, r in enumerate(reqs)}
    res = run(pair, reqs, groups=groups)
    pd_report(res)
    res.assert_clean()
    assert sorted(res.completed) == _ids(reqs)
    hits = [e.rid for e in res.events if e.component == "decode" and e.kind == "prealloc" and e.note != "prefix 0"]
    assert bool(hits) == radix_cache, f"prefix hits {hits} with radix_cache={radix_cache}"
