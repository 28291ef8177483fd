"""Every resource besides KV pages (issue 47 item 3): each reader of ``compat.pdstate`` over sglang's real
objects; the probe's flush carrying them with their baselines; and each rule failing on a real leak of one
(a metadata slot really held, a tree lock really taken, a KV-manager room left behind), named in the finding.
The simulated ranks carry request rows and tree locks the same way (``not-baseline`` names them)."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest

from harness import ledger
from harness.engines.sim import DecodeConfig, DecodeSide, make_req
from harness.ledger.resources import RESOURCES, baselines
from harness.targets.sglang.compat import pdstate


def _kv_manager(component: str):
    """A real ``CommonKVManager`` with its per-room tables as its ``__init__`` makes them, without the
    sockets, threads and bootstrap registration it opens."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    m = CommonKVManager.__new__(CommonKVManager)
    m.request_status, m.failure_records = {}, {}
    m._deferred_ack_targets, m._deferred_ack_poisoned_rooms, m._staging_outstanding = {}, set(), defaultdict(int)
    if component == "prefill":
        m.transfer_infos, m.req_to_decode_prefix_len = {}, {}
    else:
        m.addr_to_rooms_tracker, m.prefill_response_tracker, m.required_prefill_response_num_table = (
            defaultdict(set),
            {},
            {},
        )
    return m


def test_request_rows_are_read_from_the_req_to_token_pool():
    side = DecodeSide(DecodeConfig(page_size=16, window=40))
    assert pdstate.request_rows(side.req_to_token_pool) == (8, 8)
    req = make_req("r", 100, output_len=3)
    side.prealloc(req)
    assert pdstate.request_rows(side.req_to_token_pool) == (7, 8)
    side.release(req)
    assert pdstate.request_rows(side.req_to_token_pool) == (8, 8)


def test_metadata_slots_are_read_from_sglangs_allocator():
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator

    allocator = ReqToMetadataIdxAllocator(4)
    assert pdstate.metadata_slots(allocator) == (4, 4)
    idx = allocator.alloc()
    assert pdstate.metadata_slots(allocator) == (3, 4)
    allocator.free(idx)
    assert pdstate.metadata_slots(allocator) == (4, 4)


def _lock_cached_prefix(side: DecodeSide, n: int):
    """Cache a request's ``n`` tokens in the radix tree (its release) and lock them as a prefix hit does
    (sglang's ``match_prefix`` and ``inc_lock_ref``); returns the lock's ``IncLockRefResult``."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cached = make_req("cached", n, output_len=1)
    side.prealloc(cached)
    side.release(cached)
    match = side.tree_cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", range(n)))))
    node = match.last_device_node
    return side.tree_cache.inc_lock_ref(getattr(node, "id", node))


def test_tree_locks_are_read_from_the_radix_cache():
    side = DecodeSide(DecodeConfig(page_size=16, window=40, radix_cache=True))
    assert pdstate.tree_locked(side.tree_cache) == (0, 0)
    lock = _lock_cached_prefix(side, 200)
    locked, base = pdstate.tree_locked(side.tree_cache)
    assert locked >= lock.delta > 0 and base == 0 and side.snapshot().resources()["tree_locked"] == locked
    side.tree_cache.dec_lock_ref(lock.node_id, lock.to_dec_params())
    assert pdstate.tree_locked(side.tree_cache)[0] == 0


def test_kv_manager_rooms_are_read_on_both_sides():
    from sglang.srt.disaggregation.base.conn import KVPoll

    prefill = _kv_manager("prefill")
    prefill.update_status(7, KVPoll.Bootstrapping)  # sglang's own opening write of a room
    prefill.transfer_infos[7] = {}
    assert pdstate.kv_rooms(prefill, "prefill") == {"kv_request_status": (1, 0), "kv_transfer_infos": (1, 0)}
    decode = _kv_manager("decode")
    decode.update_status(7, KVPoll.Bootstrapping)
    decode.addr_to_rooms_tracker["p:1"].add(7)
    decode.prefill_response_tracker[8] = set()
    assert pdstate.kv_rooms(decode, "decode") == {"kv_request_status": (1, 0), "kv_bootstrap_rooms": (2, 0)}
    decode.update_status(7, KVPoll.Success)
    decode.request_status.pop(7)  # what a receiver's clear() pops
    decode.addr_to_rooms_tracker["p:1"].discard(7)
    decode.prefill_response_tracker.pop(8)
    assert pdstate.kv_rooms(decode, "decode") == {"kv_request_status": (0, 0), "kv_bootstrap_rooms": (0, 0)}


def test_hisparse_host_slots_are_read_from_the_coordinator():
    side = DecodeSide(DecodeConfig(hisparse=True, page_size=256, window=128))
    free, size = pdstate.host_slots(side.coordinator)
    assert free == size > 0
    req = make_req("h", 600, output_len=1)
    side.prealloc(req)
    assert pdstate.host_slots(side.coordinator)[0] < size
    side.release(req)
    assert pdstate.host_slots(side.coordinator) == (size, size)


# ------------------------------------------------------------------- the probe's flush and the rules


@pytest.fixture
def server(tmp_path):
    """A decode scheduler's objects on real sglang pools, its flush wrapped by the probe."""
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator

    from harness.engines.server import accounting_probe as probe_mod

    side = DecodeSide(DecodeConfig(page_size=16, window=40, radix_cache=True))
    sched = types.SimpleNamespace(
        token_to_kv_pool_allocator=side.allocator,
        tree_cache=side.tree_cache,
        req_to_token_pool=side.req_to_token_pool,
        req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(4),
        disagg_decode_prealloc_queue=types.SimpleNamespace(kv_manager=_kv_manager("decode")),
    )

    def flush(s):  # what sglang's Scheduler.flush_cache does to an idle server's state
        s.tree_cache.reset()
        s.req_to_token_pool.clear()
        s.token_to_kv_pool_allocator.clear()
        return True

    path = tmp_path / "decode.jsonl"
    wrapped = probe_mod._wrap_flush(probe_mod.Probe(str(path), "decode-0", "decode"), flush)
    return types.SimpleNamespace(
        side=side, sched=sched, flush=lambda: wrapped(sched), events=lambda: ledger.read(path), path=path
    )


def _found(events) -> set[tuple[str, str]]:
    """(rule, resource) of each finding."""
    return {(v.rule, name) for v in ledger.check(events) for name in RESOURCES if f"'{name}'" in v.message}


def test_a_clean_flush_carries_every_resource_at_its_baseline(server):
    req = make_req("r", 100, output_len=3)
    server.side.prealloc(req)
    server.side.release(req)
    assert server.flush() is True
    (reset,) = server.events()
    assert dict(reset.baseline) == {
        "req_slots": 8,
        "metadata_slots": 4,
        "tree_locked": 0,
        "kv_request_status": 0,
        "kv_bootstrap_rooms": 0,
    }
    assert {k: reset.free_after[k] for k in reset.baseline} == dict(reset.baseline)
    assert ledger.check(server.events()) == [] and "lacks" not in reset.note
    assert all(r.at_baseline for r in baselines(server.events()))


def test_a_metadata_slot_really_held_is_not_baseline(server):
    server.flush()
    server.sched.req_to_metadata_buffer_idx_allocator.alloc()  # taken for a request that never gives it back
    server.flush()
    assert _found(server.events()) == {("not-baseline", "metadata_slots")}
    (row,) = [r for r in baselines(server.events()) if r.resource == "metadata_slots"]
    assert (row.baseline, row.last, row.at_baseline) == (4, 3, False)
    from harness.report import page  # the report's baseline table flags it

    shown = {r["resource"]: (r["baseline"], r["last"], r["bad"]) for r in page._resources(server.events())}
    assert shown["metadata_slots"] == (4, 3, True) and shown["req_slots"] == (8, 8, False)


def test_rooms_no_sender_holds_are_named_apart_and_only_they_are_not_counted(monkeypatch):
    from sglang.srt.disaggregation.base.conn import KVPoll

    from harness.engines.server import races, resources

    monkeypatch.setattr(races, "_watching", True)
    monkeypatch.setattr(races, "_owned", {})

    prefill = _kv_manager("prefill")
    for room in (7, 8):
        prefill.update_status(room, KVPoll.WaitingForInput)
        prefill.transfer_infos[room] = {}
    races.note_opened(8)  # room 8's sender never cleared it: a leak, still counted; room 7 no sender holds
    apart = races.unowned(pdstate.room_keys(prefill))
    assert apart == {7}
    assert pdstate.kv_rooms(prefill, "prefill", apart) == {"kv_request_status": (1, 0), "kv_transfer_infos": (1, 0)}
    note = resources.note(resources.Readings(resurrected=[7]))
    assert races.kept("flush_cache" + note) == [7] and races.kept("flush_cache") == []


def test_a_test_is_told_only_of_the_rooms_a_reset_during_it_named_first(tmp_path):
    import time

    from harness.engines.server import races
    from harness.ledger import LedgerWriter

    with LedgerWriter(tmp_path / "prefill.jsonl", "prefill", "prefill") as w:
        w.record("reset", "<flush>", 64, note="flush_cache" + races.note([7]))
        since = time.time()
        w.record("kv_sent", "r1", 64, note=races.note([9]))  # not a reset: not read
        w.record("reset", "<flush>", 64, note="flush_cache" + races.note([7, 8]))
    assert races.kept_since(tmp_path, since) == ["prefill room 8"]
    assert races.kept_since(tmp_path, time.time()) == []


def test_a_room_left_in_the_kv_manager_is_not_baseline(server):
    from sglang.srt.disaggregation.base.conn import KVPoll

    manager = server.sched.disagg_decode_prealloc_queue.kv_manager
    manager.update_status(11, KVPoll.Bootstrapping)
    manager.addr_to_rooms_tracker["p:1"].add(11)
    server.flush()
    assert _found(server.events()) == {("not-baseline", "kv_request_status"), ("not-baseline", "kv_bootstrap_rooms")}


def test_a_tree_lock_no_request_holds_is_a_reset_leak(server):
    """The flush resets the tree (hiding the lock): only the reading before it shows the leak."""
    _lock_cached_prefix(server.side, 200)  # a prefix hit's lock whose request never unlocks it
    server.flush()
    assert _found(server.events()) == {("reset-leak", "tree_locked")}


def test_a_release_without_the_resource_says_so_in_one_line(server):
    del server.sched.req_to_metadata_buffer_idx_allocator
    server.sched.disagg_decode_prealloc_queue = None
    assert server.flush() is True
    (reset,) = server.events()
    assert "metadata_slots" not in reset.free_after and "kv_request_status" not in reset.free_after
    assert "lacks metadata-buffer slots: no SimpleNamespace.req_to_metadata_buffer_idx_allocator" in reset.note
    assert "KV manager per-room state" in reset.note and ledger.check(server.events()) == []


def test_the_simulated_ranks_name_a_request_row_held_on_an_idle_worker(tmp_path):
    """A decode rank's events carry request rows and tree locks: a row really held on a rank whose
    requests are all released is ``not-baseline``, named."""
    from harness.engines.sim.decode_rank import DecodeWorker
    from harness.engines.sim.workload import KVSpec

    worker = DecodeWorker("d0", 0, KVSpec(device="cpu"), str(tmp_path))
    worker.side.req_to_token_pool.alloc([make_req("stray", 10)])  # a row no request of the rank holds
    worker.admit("r", 100, 1)
    worker.abort("r")
    events = [ledger.Event.from_dict(e) for e in worker.ledger_events()]
    assert ("not-baseline", "req_slots") in _found(events)
