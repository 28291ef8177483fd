"""The ledger checker on hand-built event lists: a balanced run passes, each invariant broken once fails."""

from __future__ import annotations

from harness import ledger
from harness.ledger import Event, LedgerWriter, check

P = 64
W = 100


def ev(seq, kind, rid="r0", worker="d0", component="decode", **kw) -> Event:
    kw.setdefault("page_size", P)
    kw.setdefault("window", W)
    return Event(seq=seq, ts=0.0, kind=kind, rid=rid, component=component, worker=worker, **kw)


def balanced() -> list[Event]:
    """fill 300, window 100, page 64: full pages 0-4, SWA tail pages 7,8 (evicted 192); one decode page."""
    return [
        ev(0, "prealloc", fill_len=300, swa_tail_len=108, evicted_seqlen=192,
           pages={"full": (0, 1, 2, 3, 4), "swa": (7, 8)},
           free_before={"full": 640, "swa": 320}, free_after={"full": 320, "swa": 192}),
        ev(1, "transfer", pages={"full": (0, 1, 2, 3, 4), "swa": (7, 8)}),
        ev(2, "decode_alloc", fill_len=320, pages={"full": (), "swa": ()}),
        ev(3, "decode_alloc", fill_len=321, pages={"full": (5,), "swa": (9,)},
           free_before={"full": 320, "swa": 192}, free_after={"full": 256, "swa": 128}),
        ev(4, "evict", evicted_seqlen=256, pages={"swa": (7,)}, free_before={"swa": 128}, free_after={"swa": 192}),
        ev(5, "release", pages={"full": (0, 1, 2, 3, 4, 5), "swa": (8, 9)},
           free_before={"full": 256, "swa": 192}, free_after={"full": 640, "swa": 320}),
    ]


def rules(events) -> list[str]:
    return [v.rule for v in check(events)]


def replace(events, i, **kw):
    e = events[i]
    return events[:i] + [Event(**{**e.__dict__, **kw})] + events[i + 1:]


def test_balanced_run_has_no_violations():
    assert check(balanced()) == []


def test_leak_when_release_skips_swa_pages():
    evs = replace(balanced(), 5, pages={"full": (0, 1, 2, 3, 4, 5), "swa": ()},
                  free_after={"full": 640, "swa": 192})
    got = check(evs)
    assert "page-leak" in [v.rule for v in got]
    leak = next(v for v in got if v.rule == "page-leak")
    assert leak.rid == "r0" and "'swa'" in leak.message
    assert "not-baseline" not in [v.rule for v in got]  # pages still held: not idle yet


def test_double_free():
    evs = balanced() + [ev(6, "release", pages={"swa": (8,)})]
    assert "page-double-free" in rules(evs)


def test_double_alloc():
    evs = balanced()[:1] + [ev(1, "prealloc", rid="r1", pages={"full": (4,)})]
    assert "page-double-alloc" in rules(evs)


def test_free_by_other_request():
    evs = balanced()[:1] + [ev(1, "prealloc", rid="r1", pages={"full": (9,)}),
                            ev(2, "release", rid="r1", pages={"full": (9, 0)})]
    assert "page-double-free" in rules(evs)


def test_unaligned_eviction_floor():
    evs = replace(balanced(), 0, evicted_seqlen=200, swa_tail_len=100)
    assert "evicted-unaligned" in rules(evs)


def test_negative_eviction_floor():
    evs = replace(balanced(), 4, evicted_seqlen=-64)
    assert "evicted-negative" in rules(evs)


def test_evicted_must_match_fill_minus_tail():
    evs = replace(balanced(), 0, swa_tail_len=44)
    assert rules(evs) == ["evicted-mismatch"]


def test_swa_over_window_when_decode_does_not_evict():
    # bound for window 100, page 64: ceil(164 / 64) = 3 pages; holding 7, 8, 9 and then 10 is too many
    evs = balanced()[:4] + [ev(4, "decode_alloc", pages={"swa": (10,)})]
    assert "swa-over-window" in rules(evs)


def test_transfer_into_pages_not_held():
    evs = replace(balanced(), 1, pages={"full": (0, 1, 2, 3, 4, 11)})
    assert rules(evs) == ["transfer-unowned"]


def test_not_back_to_baseline_when_idle():
    evs = replace(balanced(), 5, free_after={"full": 640, "swa": 256})
    assert "not-baseline" in rules(evs) or "free-mismatch" in rules(evs)
    # pages balance but the pool did not get its slots back (freed pages the allocator lost)
    evs = [ev(0, "prealloc", pages={"full": (0,)}, free_before={"full": 10}, free_after={"full": 9}),
           ev(1, "release", pages={"full": (0,)}, free_after={"full": 9})]
    assert rules(evs) == ["not-baseline"]


def test_free_size_must_move_by_the_pages_named():
    evs = replace(balanced(), 3, free_after={"full": 320, "swa": 128})
    assert rules(evs) == ["free-mismatch"]


def test_counted_pages_balance_and_leak():
    base = [ev(0, "prealloc", pages={"full": 5, "swa": 2}), ev(1, "release", pages={"full": 5, "swa": 2})]
    assert check(base) == []
    assert rules(base[:1] + [ev(1, "release", pages={"full": 5, "swa": 1})]) == ["page-leak"]
    assert "page-double-free" in rules(base + [ev(2, "release", pages={"full": 1})])


def test_cache_retained_pages_freed_by_later_evict():
    evs = [ev(0, "prealloc", pages={"full": (0, 1)}), ev(1, "release", pages={"full": (1,)}),
           ev(2, "evict", rid="<tree>", pages={"full": (0,)})]
    assert check(evs) == []
    assert rules(evs[:2]) == ["page-leak"]


def test_unknown_kind_and_workers_are_separate_books():
    evs = balanced() + [ev(0, "alloc", worker="p0", component="prefill")]
    assert rules(evs) == ["unknown-kind"]
    # the same page ids on another worker are another pool
    other = [Event(**{**e.__dict__, "worker": "d1"}) for e in balanced()]
    assert check(balanced() + other) == []


def test_alloc_fail_pages_must_be_returned():
    evs = [ev(0, "alloc_fail", pages={"swa": (3,)})]
    assert rules(evs) == ["page-leak"]


def test_writer_reader_round_trip(tmp_path):
    path = tmp_path / "ledger" / "d0.jsonl"
    with LedgerWriter(path, worker="d0", component="decode") as w:
        for e in balanced():
            fields = {k: v for k, v in e.__dict__.items() if k not in ("seq", "ts", "kind", "rid", "component", "worker", "page_size")}
            w.record(e.kind, e.rid, e.page_size, **fields)
    with open(path, "a") as fh:
        fh.write('{"seq": 99, "kin')  # a worker killed mid-line
    back = ledger.read(path)
    assert [(e.kind, e.pages) for e in back] == [(e.kind, e.pages) for e in balanced()]
    assert check(ledger.read_dir(path.parent)) == []


def test_summary_counts_and_formats():
    s = ledger.summarise(balanced())
    assert s["requests"] == 1 and s["violations"] == []
    assert s["workers"]["d0"]["pages_taken"] == {"full": 6, "swa": 3}
    assert "d0 (decode)" in ledger.format_summary(s)


def reset(seq, before, after, worker="d0") -> Event:
    return ev(seq, "reset", rid="<flush>", worker=worker, window=None, free_before=before, free_after=after)


def test_reset_of_an_idle_server_balances():
    # After the balanced run every slot is free: the flush finds free + cached == free after it.
    idle = {"full": 640, "swa": 320, "req_slots": 8}
    assert check([*balanced(), reset(6, idle, idle)]) == []


def test_reset_that_finds_slots_neither_free_nor_cached_is_a_leak():
    found = rules([reset(0, {"full": 576, "swa": 320, "req_slots": 8}, {"full": 640, "swa": 320, "req_slots": 8})])
    assert found == ["reset-leak"]


def test_reset_drops_pages_a_prefix_cache_kept():
    # A released request left its pages in the cache (never evicted): the flush frees them, no leak.
    evs = [
        ev(0, "prealloc", pages={"full": (0, 1)}, window=None, free_before={"full": 640}, free_after={"full": 512}),
        ev(1, "release", pages={}, window=None),
        reset(2, {"full": 640}, {"full": 640}),
    ]
    assert check(evs) == []
    assert rules(evs[:2]) == ["page-leak"]
