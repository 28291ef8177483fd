"""The KV-content rules (harness/ledger/content.py) over hand-built event streams: a clean room, then each
rule broken on its own (``kv-content``, ``kv-write-once``, ``write-after-free``), through ``ledger.check``."""

from __future__ import annotations

import itertools

from harness import ledger
from harness.ledger import Event

_seq = itertools.count()


def ev(kind, rid, worker, component, ts, **fields):
    return Event(seq=next(_seq), ts=ts, kind=kind, rid=rid, component=component, worker=worker, page_size=64, **fields)


def D(kind, rid, ts, **fields):
    return ev(kind, rid, "d0", "decode", ts, **fields)


def P(kind, rid, ts, **fields):
    return ev(kind, rid, "p0", "prefill", ts, **fields)


def room_events(room, rid, dst, digests, t0, *, src=None, released=None):
    """One clean room: decode preallocates ``dst``, prefill sends and lands them, decode commits the same
    bytes (``digests``: per buffer, per page), then releases at ``released``."""
    src = src or [100 + p for p in dst]
    out = [
        D("prealloc", rid, t0, fill_len=64 * len(dst), pages={"full": tuple(dst)}),
        D("kv_dest", rid, t0 + 0.1, content={"room": room, "dst": dst}),
        P("kv_sent", "p" + rid, t0 + 0.2, content={"room": room, "at": 0, "src": src, "digests": digests}),
        P("kv_landed", "p" + rid, t0 + 0.3, content={"room": room, "at": 0, "src": src, "dst": dst, "t0": t0 + 0.25}),
        D("kv_commit", rid, t0 + 0.4, content={"room": room, "dst": dst, "digests": digests}),
    ]
    if released is not None:
        out.append(D("release", rid, released, pages={"full": tuple(dst)}))
    return out


def rules(events):
    return [v.rule for v in ledger.check(events)]


def content_rules(events):
    return [v for v in ledger.check(events) if v.rule in ledger.CONTENT_RULES]


def test_clean_rooms_break_no_rule():
    events = room_events(1, "a", [3, 4], [[11, 12], [21, 22]], 0.0, released=1.0)
    events += room_events(2, "b", [3, 4], [[31, 32], [41, 42]], 2.0, released=3.0)
    assert content_rules(events) == []
    assert set(ledger.CONTENT_RULES) <= set(ledger.RULES)


def test_decode_only_events_are_not_judged():
    # The source was not read (a decode ledger alone): nothing to compare, no finding.
    events = [e for e in room_events(1, "a", [3], [[11]], 0.0) if e.component == "decode"]
    events[-1] = D("kv_commit", "a", 0.4, content={"room": 1, "dst": [3], "digests": [[99]]})
    assert content_rules(events) == []


def test_kv_content_a_committed_page_differs_from_what_was_sent():
    events = room_events(1, "a", [3, 4], [[11, 12], [21, 22]], 0.0)
    events[-1] = D("kv_commit", "a", 0.4, content={"room": 1, "dst": [3, 4], "digests": [[11, 12], [21, 99]]})
    (v,) = content_rules(events)
    assert v.rule == "kv-content" and v.rid == "a" and v.kind == "kv_commit"
    assert "1 of 2 page(s) differ" in v.message and "prefill 104 -> decode 4" in v.message


def test_kv_content_names_the_canary_a_page_never_written_holds():
    events = room_events(1, "a", [3], [[11]], 0.0)
    events[-1] = D("kv_commit", "a", 0.4, content={"room": 1, "dst": [3], "digests": [[7]], "canary": [7]})
    (v,) = content_rules(events)
    assert v.rule == "kv-content" and "the canary (never written)" in v.message


def test_kv_write_once_a_page_sent_twice():
    events = room_events(1, "a", [3, 4], [[11, 12]], 0.0)
    events.insert(3, P("kv_sent", "pa", 0.21, content={"room": 1, "at": 1, "src": [104], "digests": [[12]]}))
    (v,) = content_rules(events)
    assert v.rule == "kv-write-once" and "page 1 of the request sent twice" in v.message


def test_kv_write_once_a_landing_outside_its_destination_names_the_holder():
    events = room_events(1, "a", [3], [[11]], 0.0) + room_events(2, "b", [5], [[21]], 0.0)
    events.append(P("kv_landed", "pa", 0.35, content={"room": 1, "at": 0, "src": [103], "dst": [5], "t0": 0.3}))
    found = content_rules(events)
    assert [v.rule for v in found] == ["kv-write-once"]
    assert "wrote decode page 5, not its own destination (held by b)" in found[0].message


def test_kv_write_once_a_commit_with_a_page_never_sent():
    events = room_events(1, "a", [3, 4], [[11]], 0.0, src=[103])
    events[-1] = D("kv_commit", "a", 0.4, content={"room": 1, "dst": [3, 4], "digests": [[11, 0]]})
    (v,) = content_rules(events)
    assert v.rule == "kv-write-once" and "1 destination page(s) its source never sent (e.g. [4])" in v.message


def test_write_after_free_a_landing_after_the_release_names_the_room_and_the_new_owner():
    events = room_events(7, "a", [3], [[11]], 0.0)
    # a's request is released at 0.35 and b takes page 3; a's transfer lands on it at 0.5.
    events.insert(4, D("release", "a", 0.26, pages={"full": (3,)}))
    events.insert(5, D("prealloc", "b", 0.27, fill_len=64, pages={"full": (3,)}))
    found = content_rules(events)
    assert [v.rule for v in found][:1] == ["write-after-free"], found
    v = found[0]
    assert v.worker == "p0" and "late writer room 7 (a)" in v.message and "new owner: b" in v.message


def test_write_after_free_another_rooms_bytes_in_a_committed_page():
    # a held page 3 and was released; b got page 3; a's late write replaced b's bytes after b's landing.
    events = room_events(1, "a", [3], [[11]], 0.0, released=0.5)
    b = room_events(2, "b", [3], [[21]], 1.0)
    b[-1] = D("kv_commit", "b", 1.4, content={"room": 2, "dst": [3], "digests": [[11]]})
    (v,) = content_rules(events + b)
    assert v.rule == "write-after-free" and v.rid == "b"
    assert "late writer room 1" in v.message and "new owner: b (room 2)" in v.message


def test_write_after_free_a_canary_lost_while_the_page_was_free():
    events = room_events(1, "a", [3], [[11]], 0.0, released=0.5)
    b = room_events(2, "b", [3], [[21]], 1.0)
    canary = {"pages": [3], "digests": [[11]], "expect": [7]}
    b[1] = D("kv_dest", "b", 1.1, content={"room": 2, "dst": [3], "canary": canary})
    (v,) = content_rules(events + b)
    assert v.rule == "write-after-free" and v.kind == "kv_dest"
    assert "decode page 3 lost its canary while free: late writer room 1; new owner: b (room 2)" in v.message


def test_events_round_trip_their_content():
    e = room_events(1, "a", [3], [[2**64 - 1]], 0.0)[2]
    assert Event.from_dict(__import__("json").loads(e.to_json())) == e


def test_a_room_key_used_again_is_a_new_room():
    # The simulated engine's rooms are rid:pool:shard; a later test running the same rid is a new room.
    first = room_events("r0:full:0", "r0", [3], [[11]], 0.0, released=1.0)
    again = room_events("r0:full:0", "r0", [5], [[21]], 2.0, released=3.0)
    assert content_rules(first + again) == []
