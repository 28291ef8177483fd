"""Phase points (harness.engines.phases, harness.engines.server.hold): a held phase waits for its file
to go and says so, every other request or phase passes at once and is traced, and the status seam forces
two writers of one room to interleave inside sglang's real ``CommonKVManager.update_status``."""

from __future__ import annotations

import threading

import pytest

from harness.engines import phases
from harness.engines.server import hold, races
from harness.engines.server.accounting_probe import COMPONENT_ENV, LEDGER_ENV
from harness.targets.sglang import compat


@pytest.fixture
def points(tmp_path):
    return hold.Points(str(tmp_path / "decode-0.jsonl"), "decode-0", "decode")


def _in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_a_phase_without_a_hold_passes_at_once_and_is_traced(tmp_path, points):
    phases.Hold(tmp_path, "decode.prealloc", "other")
    points.mark("decode.prealloc", "r1", 7)
    points.mark("transfer.ack", room=7)  # the room's request is named from what the trace saw
    marks = phases.read_trace(tmp_path)
    assert [(m.phase, m.rid, m.room) for m in marks] == [("decode.prealloc", "r1", 7), ("transfer.ack", "r1", 7)]
    assert not list(phases.hold_dir(tmp_path).glob("*.held"))


def test_a_held_phase_waits_for_its_release_and_says_it_is_held(tmp_path, points):
    gate = phases.Hold(tmp_path, "prefill.send", "r1", chunk=1)
    done: list[int] = []

    def send(i):
        points.mark("prefill.send", "r1", 3, chunk=i)
        done.append(i)

    send(0)  # chunk 0 is not held
    t = _in_thread(lambda: send(1))
    gate.reached(10)
    assert done == [0] and t.is_alive(), "the held chunk went on before its release"
    gate.release()
    t.join(10)
    assert done == [0, 1] and not t.is_alive()
    gate.release()  # idempotent


def test_a_hold_by_room_holds_the_request_of_that_room(tmp_path, points):
    with phases.Hold(tmp_path, "decode.commit", phases.room_key(9)) as gate:
        t = _in_thread(lambda: points.mark("decode.commit", "r9", 9))
        gate.reached(10)
        assert t.is_alive()
    t.join(10)
    assert not t.is_alive()


def test_a_hold_for_the_other_side_lets_this_side_pass(tmp_path, points):
    phases.Hold(tmp_path, "transfer.status", phases.room_key(4), side="prefill")
    points.mark("transfer.status", room=4)  # decode's points: not held
    assert not list(phases.hold_dir(tmp_path).glob("*.held"))


def test_a_wait_for_a_request_that_lost_its_status_update_ends_at_once(tmp_path, points):
    # sglang's lost update ends the request (the stack watcher aborts it): a hold or a mark it would reach
    # next is never reached, and the wait says why instead of waiting out its bound (120 s in the suites).
    hold = phases.Hold(tmp_path, "transfer.write", "r1", chunk=0)
    by_room = phases.Hold(tmp_path, "transfer.write", phases.room_key(7), chunk=0)
    points.mark("decode.prealloc", "r1", 7)
    points.mark("transfer.lost-update", room=7, hold=False)
    for wait in (
        lambda: hold.reached(60),
        lambda: by_room.reached(60),
        lambda: phases.wait_mark(tmp_path, "decode.commit", rid="r1", timeout_s=60),
    ):
        with pytest.raises(TimeoutError, match="never reached: its room 7 lost its status update"):
            wait()
    other = phases.Hold(tmp_path, "transfer.write", "r2", chunk=0)  # another request waits its bound
    with pytest.raises(TimeoutError, match="not reached within 0.6 s"):
        other.reached(0.6)


def test_bad_phases_and_keys_are_one_line_errors(tmp_path):
    with pytest.raises(phases.PhaseError, match="not one of"):
        phases.Hold(tmp_path, "decode.nowhere", "r1")
    with pytest.raises(phases.PhaseError, match="letters, digits"):
        phases.Hold(tmp_path, "decode.commit", "../escape")


def test_a_hold_never_reached_says_what_the_request_reached(tmp_path, points):
    points.mark("decode.prealloc", "r2", 2)
    with pytest.raises(TimeoutError, match="its last phase decode.prealloc"):
        phases.wait_mark(tmp_path, "decode.commit", rid="r2", timeout_s=0.2)
    with pytest.raises(TimeoutError, match="never reached: decode died"):
        phases.Hold(tmp_path, "decode.commit", "r2").reached(10, died=lambda: "decode died")


def _manager(points):
    """sglang's real KV manager class with only the state ``update_status`` reads (no sockets)."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    mgr = CommonKVManager.__new__(CommonKVManager)
    mgr.request_status = {}
    mgr.deferred_bootstrap = None
    mgr._deferred_ack_targets, mgr._deferred_ack_poisoned_rooms, mgr._staging_outstanding = {}, set(), {}
    hold.watch_status(mgr, points)
    return mgr


def _update(points, mgr, room, status):
    """sglang's own update_status, run as the installed wrapper runs it."""
    hold.write_status(points, mgr, room, status, type(mgr).update_status)


def test_the_status_seam_forces_a_lost_update_in_sglangs_update_status(tmp_path, points):
    compat.require("status-read-through-get")  # the hold sits in the status table's get
    # The interleaving the fresh-clone stall fits: prefill's scheduler opens the room (Bootstrapping)
    # and reads "no room yet"; decode's metadata arrives on the bootstrap thread and writes
    # WaitingForInput; the scheduler then writes what it read against. sglang's own update_status
    # has no lock: the room ends Bootstrapping, decode's metadata is lost, and prefill waits forever.
    from sglang.srt.disaggregation.base import KVPoll

    mgr = _manager(points)
    gate = phases.Hold(tmp_path, "transfer.status", phases.room_key(5), chunk="Bootstrapping", side="decode")
    t = _in_thread(lambda: _update(points, mgr, 5, KVPoll.Bootstrapping))
    gate.reached(10)
    _update(points, mgr, 5, KVPoll.WaitingForInput)  # the bootstrap thread, while the scheduler holds
    assert mgr.request_status[5] == KVPoll.WaitingForInput
    gate.release()
    t.join(10)
    assert mgr.request_status[5] == KVPoll.Bootstrapping, "the status seam no longer reaches the read"
    reads = [m.note for m in phases.read_trace(tmp_path) if m.phase == "transfer.status"]
    assert reads[0] == "read None, writing", reads


def test_without_the_hold_the_same_writes_keep_waiting_for_input(points):
    from sglang.srt.disaggregation.base import KVPoll

    mgr = _manager(points)
    _update(points, mgr, 5, KVPoll.Bootstrapping)
    _update(points, mgr, 5, KVPoll.WaitingForInput)
    assert mgr.request_status[5] == KVPoll.WaitingForInput


@pytest.fixture
def watching(monkeypatch):
    """This process's senders watched, as the installed points make them; its tables its own."""
    monkeypatch.setattr(races, "_watching", True)
    monkeypatch.setattr(races, "_owned", {})
    monkeypatch.setattr(races, "_cleared", {})


def _sender(room, status=None):
    return type("Sender", (), {"bootstrap_room": room, "conclude_state": status})()


def _open(points, mgr, room):
    """What prefill's CommonKVSender.__init__ does to its room, then what the installed points do after it."""
    from sglang.srt.disaggregation.base import KVPoll

    _update(points, mgr, room, KVPoll.Bootstrapping)
    hold.note_opened(_sender(room))


def _clear(points, mgr, room, status):
    """What prefill's CommonKVSender.clear does to its room, then what the installed points do after it."""
    mgr.request_status.pop(room, None)
    hold.note_cleared(points, _sender(room, status))


def _put_back(tmp_path, room) -> list:
    return [m.note for m in phases.read_trace(tmp_path) if m.phase == "transfer.resurrected" and m.room == room]


def test_a_page_list_after_the_rooms_clear_puts_it_back_and_no_sender_holds_it(tmp_path, points, watching):
    # prefill's sender cleared room 9 (an abort beat decode's page list); the page list then lands on the
    # bootstrap thread and sglang's own update_status lets its WaitingForInput create the room again.
    from sglang.srt.disaggregation.base import KVPoll

    mgr = _manager(points)
    _open(points, mgr, 9)
    assert races.owned(9) and races.unowned({9}) == frozenset()
    _clear(points, mgr, 9, KVPoll.Failed)
    _update(points, mgr, 9, KVPoll.WaitingForInput)
    assert mgr.request_status[9] == KVPoll.WaitingForInput, "sglang no longer re-creates a cleared room"
    assert [n.split(" put it back")[0] for n in _put_back(tmp_path, 9)] == ["a WaitingForInput write (MainThread)"]
    assert races.unowned({9}) == {9}
    # decode's page list for a room no sender ever opened (a request prefill refused at its door): held by none
    _update(points, mgr, 10, KVPoll.WaitingForInput)
    assert not _put_back(tmp_path, 10) and races.unowned({10}) == {10}
    # a sender opening a room starts a life of it: counted again
    _open(points, mgr, 9)
    assert races.unowned({9, 10}) == {10}
    races._watching = False  # senders not watched (a release without CommonKVSender): nothing read apart
    assert races.unowned({9, 10}) == frozenset()


def test_a_failed_write_that_read_before_the_clear_puts_the_room_back(tmp_path, points, watching):
    compat.require("status-read-through-get")  # the hold sits in the status table's get
    # A transfer worker's Failed write reads the room (still there), the scheduler's clear pops it, and
    # the write then lands: sglang's update_status writes Failed into a room that no longer exists.
    from sglang.srt.disaggregation.base import KVPoll

    mgr = _manager(points)
    _open(points, mgr, 11)
    gate = phases.Hold(tmp_path, "transfer.status", phases.room_key(11), chunk="Failed", side="decode")
    t = _in_thread(lambda: _update(points, mgr, 11, KVPoll.Failed))
    gate.reached(10)
    _clear(points, mgr, 11, KVPoll.Failed)
    assert 11 not in mgr.request_status
    gate.release()
    t.join(10)
    assert mgr.request_status.get(11) == KVPoll.Failed, "sglang's Failed write no longer lands after the clear"
    assert len(_put_back(tmp_path, 11)) == 1 and races.unowned({11}) == {11}


def test_the_points_install_on_both_servers_with_a_probe_ledger(tmp_path):
    ledger = str(tmp_path / "ledger" / "prefill.jsonl")
    assert not hold.install_from_env({COMPONENT_ENV: "prefill"})
    assert not hold.install_from_env({LEDGER_ENV: ledger, COMPONENT_ENV: "router"})
    assert phases.trace_dir(tmp_path / "ledger") == tmp_path / "ledger" / "trace"
