"""The ledger checker on hand-built event lists: a balanced run passes, each invariant broken once fails."""

from __future__ import annotations

import dataclasses

import pytest

from harness import ledger
from harness.ledger import Event, LedgerConfig, LedgerWriter, check

P = 64
W = 100
CONFIG = LedgerConfig(page_size=P, window=W, swa_tail=True, eviction_interval=1)
BASELINE = {"full": 640, "swa": 320}


def ev(seq, kind, rid="r0", worker="d0", component="decode", **kw) -> Event:
    kw.setdefault("page_size", P)
    return Event(seq=seq, ts=0.0, kind=kind, rid=rid, component=component, worker=worker, **kw)


def config(config: LedgerConfig = CONFIG, baseline=None, seq=-1, worker="d0") -> Event:
    return ev(seq, "config", rid=ledger.CONFIG_RID, worker=worker, **ledger.config_event(config, baseline or BASELINE))


def balanced() -> list[Event]:
    """fill 300, window 100, page 64: full pages 0-4, SWA tail pages 7,8 (evicted 192); one decode page."""
    return [
        config(),
        ev(
            0,
            "prealloc",
            fill_len=300,
            swa_tail_len=108,
            evicted_seqlen=192,
            pages={"full": (0, 1, 2, 3, 4), "swa": (7, 8)},
            free_before={"full": 640, "swa": 320},
            free_after={"full": 320, "swa": 192},
        ),
        ev(1, "transfer", pages={"full": (0, 1, 2, 3, 4), "swa": (7, 8)}),
        ev(2, "decode_alloc", fill_len=320, evicted_seqlen=192, pages={"full": (), "swa": ()}),
        ev(
            3,
            "decode_alloc",
            fill_len=321,
            evicted_seqlen=192,
            pages={"full": (5,), "swa": (9,)},
            free_before={"full": 320, "swa": 192},
            free_after={"full": 256, "swa": 128},
        ),
        ev(4, "evict", evicted_seqlen=256, pages={"swa": (7,)}, free_before={"swa": 128}, free_after={"swa": 192}),
        ev(
            5,
            "release",
            pages={"full": (0, 1, 2, 3, 4, 5), "swa": (8, 9)},
            free_before={"full": 256, "swa": 192},
            free_after={"full": 640, "swa": 320},
        ),
    ]


def rules(events) -> list[str]:
    return [v.rule for v in check(events)]


def replace(events, i, **kw):
    """``events`` with event seq ``i`` changed (the config event is at index 0, seq -1)."""
    k = next(j for j, e in enumerate(events) if e.seq == i and e.kind != "config")
    e = events[k]
    return events[:k] + [Event(**{**e.__dict__, **kw})] + events[k + 1 :]


def test_balanced_run_has_no_violations():
    assert check(balanced()) == []


def test_leak_when_release_skips_swa_pages():
    evs = replace(balanced(), 5, pages={"full": (0, 1, 2, 3, 4, 5), "swa": ()}, free_after={"full": 640, "swa": 192})
    got = check(evs)
    assert "page-leak" in [v.rule for v in got]
    leak = next(v for v in got if v.rule == "page-leak")
    assert leak.rid == "r0" and "'swa'" in leak.message
    assert "not-baseline" not in [v.rule for v in got]  # pages still held: not idle yet


def test_double_free():
    evs = balanced() + [ev(6, "release", pages={"swa": (8,)})]
    assert "page-double-free" in rules(evs)


def test_double_alloc():
    evs = balanced()[:2] + [ev(1, "prealloc", rid="r1", pages={"full": (4,)})]
    assert "page-double-alloc" in rules(evs)


def test_free_by_other_request():
    evs = balanced()[:2] + [
        ev(1, "prealloc", rid="r1", pages={"full": (9,)}),
        ev(2, "release", rid="r1", pages={"full": (9, 0)}),
    ]
    assert "page-double-free" in rules(evs)


def test_unaligned_eviction_floor():
    evs = replace(balanced(), 0, evicted_seqlen=200, swa_tail_len=100)
    assert "evicted-unaligned" in rules(evs)


def test_negative_eviction_floor():
    evs = replace(balanced(), 4, evicted_seqlen=-64)
    assert "evicted-negative" in rules(evs)


def test_evicted_must_match_fill_minus_tail():
    evs = replace(balanced(), 0, swa_tail_len=144)  # within the tail bounds, but fill - tail = 156 != 192
    assert rules(evs) == ["evicted-mismatch"]


def test_swa_over_window_when_pages_outlive_the_floor():
    # seq 321, floor 192: the live span covers pages 3..5 (3 pages); holding 7, 8, 9 and then 10 is too many
    evs = balanced()[:5] + [ev(4, "decode_alloc", pages={"swa": (10,)})]
    assert "swa-over-window" in rules(evs)


def test_transfer_into_pages_not_held():
    evs = replace(balanced(), 1, pages={"full": (0, 1, 2, 3, 4, 11)})
    assert rules(evs) == ["transfer-unowned"]


def test_not_back_to_baseline_when_idle():
    evs = replace(balanced(), 5, free_after={"full": 640, "swa": 256})
    assert "not-baseline" in rules(evs) or "free-mismatch" in rules(evs)
    # pages balance but the pool did not get its slots back (freed pages the allocator lost)
    evs = [
        ev(0, "prealloc", pages={"full": (0,)}, free_before={"full": 10}, free_after={"full": 9}),
        ev(1, "release", pages={"full": (0,)}, free_after={"full": 9}),
    ]
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
    evs = [
        ev(0, "prealloc", pages={"full": (0, 1)}),
        ev(1, "release", pages={"full": (1,)}),
        ev(2, "evict", rid="<tree>", pages={"full": (0,)}),
    ]
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


def test_a_request_still_in_flight_at_the_end_is_named_with_its_last_phase_not_a_leak():
    # r1 preallocated and decoded a step; its release is not written yet: in flight, not a leak.
    # r2 finished (aborted, the abort recorded with its release) and still holds a page: a leak.
    evs = [
        config(),
        ev(0, "prealloc", rid="r1", pages={"full": (0, 1, 2, 3)}),
        ev(1, "prealloc", rid="r2", pages={"full": (4, 5)}),
        ev(2, "decode_alloc", rid="r1", pages={"full": (6,)}),
        ev(3, "release", rid="r2", pages={"full": (4,)}, note="abort: client gave up"),
    ]
    found = check(evs)
    assert [(v.rule, v.rid) for v in found] == [("page-leak", "r2"), (ledger.IN_FLIGHT, "r1")]
    leak, flying = found
    assert "never freed (still held after its release)" in leak.message
    assert (flying.worker, flying.kind, flying.seq) == ("d0", "decode_alloc", None)
    assert flying.message.startswith("decode request still in flight at the end, last phase decode_alloc (#2)")
    assert "pool 'full': 5 page(s)" in flying.message and "never freed" not in flying.message
    assert flying.headline().startswith("[in-flight-at-end] d0 decode_alloc of r1: decode request still in flight")
    assert ledger.split_in_flight(found) == ([leak], [flying])
    # once its release is written it is neither
    assert rules(evs + [ev(4, "release", rid="r1", pages={"full": (0, 1, 2, 3, 6)})]) == ["page-leak"]


def test_pages_held_across_an_idle_flush_or_by_no_request_are_a_leak_not_in_flight():
    # sglang flushes only an idle server: a request still holding pages at the flush had finished
    idle = {"full": 640}
    evs = [ev(0, "prealloc", rid="r1", window=None, pages={"full": (0, 1)}), reset(1, idle, idle)]
    assert rules(evs) == ["page-leak"]
    # a request that arrived after the flush is in flight again
    assert rules([*evs[1:], ev(2, "prealloc", rid="r2", window=None, pages={"full": 3})]) == [ledger.IN_FLIGHT]
    # a request the caller knows finished (its client got the answer) holds its pages as a leak
    assert rules(evs[:1]) == [ledger.IN_FLIGHT] and [v.rule for v in check(evs[:1], finished=["r1"])] == ["page-leak"]
    # pages no request owns (a rank's stray allocation) are no request in flight
    assert rules([ev(0, "decode_alloc", rid="<unattributed>", pages={"full": (9,)})]) == ["page-leak"]


def test_writer_reader_round_trip(tmp_path):
    path = tmp_path / "ledger" / "d0.jsonl"
    with LedgerWriter(path, worker="d0", component="decode") as w:
        for e in balanced():
            fields = {
                k: v
                for k, v in e.__dict__.items()
                if k not in ("seq", "ts", "kind", "rid", "component", "worker", "page_size")
            }
            w.record(e.kind, e.rid, e.page_size, **fields)
    with open(path, "a") as fh:
        fh.write('{"seq": 99, "kin')  # a worker killed mid-line
    back = ledger.read(path)
    assert [(e.kind, e.pages, e.config) for e in back] == [(e.kind, e.pages, e.config) for e in balanced()]
    assert check(ledger.read_dir(path.parent)) == []


def test_a_writer_closed_without_fsync_leaves_every_event_readable(tmp_path, monkeypatch):
    """``close(sync=False)`` (a scratch ledger, ``harness explore``'s) flushes and closes but never fsyncs."""
    import os

    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", synced.append)
    w = LedgerWriter(tmp_path / "d0.jsonl", worker="d0", component="decode")
    w.record("release", "r0", P, pages={"full": (1, 2)})
    w.close(sync=False)
    w.close()  # closed already: nothing
    assert synced == [] and [(e.kind, e.pages) for e in ledger.read(tmp_path / "d0.jsonl")] == [
        ("release", {"full": (1, 2)})
    ]
    with LedgerWriter(tmp_path / "d1.jsonl", worker="d1", component="decode"):
        pass
    assert len(synced) == 1  # the default still fsyncs


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


# ------------------------------------------------------------------ rules derived from the configuration
# Each rule: the balanced stream passes, and one hand-made stream that breaks it (and only it) fails.


def prealloc(fill, tail, floor, swa, full=None, seq=0, config_=CONFIG, **kw) -> list[Event]:
    full = tuple(range(-(-fill // P))) if full is None else full
    return [
        config(config_),
        ev(
            seq,
            "prealloc",
            fill_len=fill,
            swa_tail_len=tail,
            evicted_seqlen=floor,
            pages={"full": full, "swa": swa},
            **kw,
        ),
    ]


def test_prealloc_rules_pass_on_sglang_values():
    # page 64 / window 100: sglang's own tails for fills 300, 1000, 1; radix on keeps max(W, P) + 1 = 101
    assert rules(prealloc(300, 108, 192, (7, 8))) == [ledger.IN_FLIGHT]  # only its release, not written yet
    assert [r for r in rules(prealloc(1000, 104, 896, (1, 2))) if r != ledger.IN_FLIGHT] == []
    assert [r for r in rules(prealloc(1, 1, 0, (3,))) if r != ledger.IN_FLIGHT] == []
    radix = LedgerConfig(page_size=P, window=W, radix_cache=True, swa_tail=True)
    assert [r for r in rules(prealloc(300, 108, 192, (7, 8), config_=radix)) if r != ledger.IN_FLIGHT] == []


def test_tail_one_page_too_long_stays_aligned_and_is_caught():
    # The review's case: fill 300, tail 172 = 3 pages, floor 128 aligned and == fill - tail, 3 pages
    # within the old ceil((W + P) / P) cap; the exact rule tail < W + P = 164 catches it.
    evs = prealloc(300, 172, 128, (6, 7, 8))
    assert [r for r in rules(evs) if r != ledger.IN_FLIGHT] == ["swa-tail-long"]


def test_tail_too_short_loses_the_window():
    # floor rounded up instead of down: tail 44 < W = 100 (aligned, consistent, within every cap)
    evs = prealloc(300, 44, 256, (8,))
    assert [r for r in rules(evs) if r != ledger.IN_FLIGHT] == ["swa-tail-short"]
    radix = LedgerConfig(page_size=P, window=W, radix_cache=True, swa_tail=True)
    # with the radix cache sglang must keep 101 tokens: tail 100 (floor 200 is unaligned too) and 44 are short
    assert "swa-tail-short" in rules(prealloc(300, 44, 256, (8,), config_=radix))


def test_swa_and_full_charge_from_the_config():
    # tail 108 needs 2 SWA pages; 5 (the whole fill, sglang#24036's bug) is a wrong charge
    evs = prealloc(300, 108, 192, (0, 1, 2, 3, 4))
    assert "swa-charge" in rules(evs)
    evs = prealloc(300, 108, 192, (7, 8), full=(0, 1, 2, 3))
    assert "full-charge" in rules(evs)
    # a prefix of 128 reused from the radix cache: 3 new full pages
    evs = prealloc(300, 108, 192, (7, 8), full=(2, 3, 4), prefix_len=128)
    assert [r for r in rules(evs) if r != ledger.IN_FLIGHT] == []


def test_host_charge_from_compression_and_host_page():
    hisparse = LedgerConfig(page_size=256, window=200, swa_tail=True, host_page=64, compression=4)
    evs = [
        config(hisparse),
        ev(0, "prealloc", page_size=256, fill_len=512, swa_tail_len=256, evicted_seqlen=256, pages={"host": 2}),
    ]
    assert [r for r in rules(evs) if r != ledger.IN_FLIGHT] == []  # 512 // 4 = 128 host tokens = 2 pages
    evs[1] = Event(**{**evs[1].__dict__, "pages": {"host": 8}})  # uncompressed: 512 / 64
    assert [r for r in rules(evs) if r != ledger.IN_FLIGHT] == ["host-charge"]


def test_reservation_must_cover_whole_pages():
    cfg = LedgerConfig(page_size=P, window=W, swa_tail=True, decode_reserve=512, swa_decode_reserve=512)
    ok = prealloc(300, 108, 192, (7, 8), config_=cfg, reserved={"full": 320 + 512, "swa": 128 + 512})
    assert [r for r in rules(ok) if r != ledger.IN_FLIGHT] == []
    # not rounded to pages (sglang#35265): 300 + 512 and 108 + 512, hidden by the reserve unless it is subtracted
    short = prealloc(300, 108, 192, (7, 8), config_=cfg, reserved={"full": 300 + 512, "swa": 108 + 512})
    assert [r for r in rules(short) if r != ledger.IN_FLIGHT] == ["reserve-short", "reserve-short"]


def test_decode_window_lost_when_floor_passes_the_window():
    evs = replace(balanced(), 3, evicted_seqlen=256)  # seq 321: positions 221.. must keep SWA slots
    assert "swa-window-lost" in rules(evs)


# sglang 0.5.16 … 0.5.18 with the decode radix cache (the PD engine's own events on 0.5.18): a request
# of 130 tokens matches a cached prefix of 128, keeps its SWA in the tree, and decoding raises its floor
# to that prefix (free_swa_out_of_window_slots: max(swa_evicted_seqlen, cache_protected_len)).
PRE_0_5_19 = LedgerConfig(page_size=P, window=W, radix_cache=True, swa_tail=True, prefix_swa_in_tree=True)


def _prefix_hit(config_: LedgerConfig, floor: int, fill: int = 132, freed_spans=()) -> list[Event]:
    return [
        config(config_),
        ev(0, "prealloc", fill_len=130, swa_tail_len=130, evicted_seqlen=0, prefix_len=128, pages={"swa": 1}),
        ev(1, "evict", fill_len=fill, evicted_seqlen=floor, freed_spans=freed_spans, pages={"swa": 0}),
    ]


def test_a_floor_raised_to_a_prefix_the_tree_keeps_swa_for_loses_no_window():
    # the hazard first: by the 0.5.19 rule (prefix capped at the window start) floor 128 > 132 - 100 is a loss
    assert "swa-window-lost" in rules(_prefix_hit(dataclasses.replace(PRE_0_5_19, prefix_swa_in_tree=False), 128))
    # before 0.5.19 positions [32, 128) keep their SWA slots in the tree: nothing of the window is lost
    assert "swa-window-lost" not in rules(_prefix_hit(PRE_0_5_19, 128))
    # ... but a floor past the prefix inside the window, or a freed slot inside it, still is
    lost = [v for v in check(_prefix_hit(PRE_0_5_19, 192, fill=200)) if v.rule == "swa-window-lost"]
    assert [v.message for v in lost] == [
        "seq 200: SWA floor 192 > 200 - window 100 and the protected prefix 128 "
        "whose SWA the radix tree keeps: a position inside the window lost its SWA slot"
    ]
    assert "swa-window-lost" in rules(_prefix_hit(PRE_0_5_19, 128, freed_spans=((64, 128),)))
    # the prefix is the request's own prealloc's, forgotten at its release (a later request of the same rid)
    evs = _prefix_hit(PRE_0_5_19, 0)[:2] + [
        ev(1, "release", pages={"swa": 1}),
        ev(2, "decode_alloc", fill_len=132, evicted_seqlen=128, pages={"swa": 0}),
    ]
    assert "swa-window-lost" in rules(evs)


def test_reservation_covers_the_swa_pages_past_a_prefix_the_tree_keeps():
    cfg = dataclasses.replace(PRE_0_5_19, decode_reserve=512, swa_decode_reserve=512)
    # 0.5.18: a prefix hit of 256 leaves the SWA-tail path (tail = fill 270) and charges one SWA page, while
    # admission reserved _swa_tail_len(270) = 142 -> 192 tokens: enough
    hit = prealloc(270, 270, 0, 1, full=1, config_=cfg, prefix_len=256, reserved={"full": 320 + 512, "swa": 192 + 512})
    assert "reserve-short" not in rules(hit)
    # a prefix hit of 64: the whole extension takes SWA, four pages, and the same reservation is short
    short = prealloc(270, 270, 0, 4, full=4, config_=cfg, prefix_len=64, reserved={"full": 320 + 512, "swa": 192 + 512})
    assert [v.message for v in check(short) if v.rule == "reserve-short"] == [
        "pool 'swa': reservation 704 - decode reserve 512 < 256 tokens of whole pages the prealloc charges"
    ]


@pytest.mark.parametrize("interval, floor, late", [(1, 128, True), (128, 128, False), (128, 0, True)])
def test_decode_eviction_late_by_the_interval(interval, floor, late):
    # seq 321: 320 - floor tokens keep SWA slots; interval 1 allows 191, interval 128 allows 227
    cfg = LedgerConfig(page_size=P, window=W, swa_tail=True, eviction_interval=interval)
    evs = [config(cfg), ev(0, "decode_alloc", rid="x", fill_len=321, evicted_seqlen=floor, pages={"swa": 1})]
    assert ("swa-evict-late" in rules(evs)) is late


def test_no_config_means_no_bound():
    evs = [e for e in balanced() if e.kind != "config"]
    assert "no-config" in rules(evs)


def test_alloc_fail_after_admission():
    evs = [config(), ev(0, "alloc_fail", fill_len=300, note=ledger.ADMITTED + " KV cache is full")]
    assert rules(evs) == ["alloc-after-admit"]
    assert rules([config(), ev(0, "alloc_fail", fill_len=300, note="too long")]) == []


def test_baseline_comes_from_the_config_event():
    # the first event already started from a pool that lost a page: the config's baseline catches it
    evs = balanced()
    evs[0] = config(baseline={"full": 704, "swa": 320})
    assert "not-baseline" in rules(evs)


def test_a_field_the_probe_could_not_read_fails_naming_it():
    evs = balanced()
    evs[1] = Event(
        **{
            **evs[1].__dict__,
            "evicted_seqlen": None,
            "note": ledger.UNREADABLE + " evicted_seqlen (AttributeError('kv'))",
        }
    )
    got = [v for v in check(evs) if v.rule == "probe-unreadable"]
    assert len(got) == 1 and "evicted_seqlen (AttributeError('kv'))" in got[0].message


def _evict(freed_spans, floor, fill=321, rid="r0"):
    return ev(4, "evict", rid=rid, fill_len=fill, evicted_seqlen=floor, freed_spans=freed_spans, pages={"swa": ()})


def test_an_eviction_that_freed_window_slots_loses_the_window_whatever_floor_it_recorded():
    # seq 321, window 100: positions 221.. keep SWA slots. The floor (192) is right; the slots freed are not.
    lost = check([config(), _evict(((128, 192), (221, 256)), 192)])
    assert [v.rule for v in lost] == ["swa-window-lost"]
    assert lost[0].headline() == (
        "[swa-window-lost] d0 evict of r0: seq 321: the eviction freed the SWA slots of 35 position(s) inside the "
        "window [221, 321) ([221, 256); recorded floor 192)"
    )
    assert check([config(), _evict(((128, 221),), 192)]) == []  # up to the window's first position: kept


def test_a_steps_eviction_and_allocation_at_one_state_judge_the_floor_once():
    # the simulated engine records a step's evict and decode_alloc at the same (seq, floor)
    evs = [
        config(),
        ev(0, "prealloc", fill_len=300, swa_tail_len=108, evicted_seqlen=192, pages={"swa": 2}),
        ev(1, "evict", fill_len=321, evicted_seqlen=256, pages={"swa": 0}),
        ev(2, "decode_alloc", fill_len=321, evicted_seqlen=256, pages={"swa": 0}),
    ]
    assert [(v.rule, v.seq) for v in check(evs) if v.rule == "swa-window-lost"] == [("swa-window-lost", 1)]


def test_freed_spans_round_trip_through_the_writer(tmp_path):
    path = tmp_path / "d0.jsonl"
    LedgerWriter(path, "d0", "decode").record("evict", "r0", P, fill_len=321, freed_spans=((128, 192),))
    [back] = ledger.read(path)
    assert back.freed_spans == ((128, 192),) and ledger.spans([5, 3, 4, 9]) == ((3, 6), (9, 10))
