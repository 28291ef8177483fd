"""The phase trace's verdicts (harness.engines.phases): a stalled request's story (lost status update,
lost message), deferred releases before the drain ack, and chunk writes still running at a release."""

from __future__ import annotations

from harness.engines.phases import Mark, early_releases, release_outcomes, stall_story, writes_after_release

T0 = 1000.0


def m(t, worker, phase, rid="r", room=7, chunk=None, note=""):
    return Mark(T0 + t, worker, phase, rid, room, chunk, note)


def _opening(*status_writes):
    return [
        m(0.01, "decode-0", "decode.prealloc"),
        m(0.02, "prefill-0", "transfer.status", rid="", chunk="Bootstrapping", note="read None, writing"),
        m(0.03, "decode-0", "decode.metadata"),
        *status_writes,
    ]


def test_a_lost_status_update_is_named_with_both_writes():
    marks = _opening(
        m(0.05, "prefill-0", "transfer.status", rid="", chunk="WaitingForInput", note="wrote, now WaitingForInput"),
        m(0.06, "prefill-0", "transfer.status", rid="", chunk="Bootstrapping", note="wrote, now Bootstrapping"),
    )
    story = stall_story(marks, "r", T0)
    assert story.startswith("prefill never reached it; decode decode.metadata at +0.03 s"), story
    assert "a lost status update (WaitingForInput written at +0.05 s, then Bootstrapping over it at +0.06 s)" in story


def test_a_lost_message_is_named_when_prefill_never_wrote_waiting_for_input():
    marks = _opening(
        m(0.04, "prefill-0", "transfer.status", rid="", chunk="Bootstrapping", note="wrote, now Bootstrapping")
    )
    story = stall_story(marks, "r", T0)
    assert "a lost message: decode sent its page list at +0.03 s, prefill never wrote WaitingForInput" in story


def test_a_request_that_moved_on_gets_only_its_sides():
    marks = _opening(
        m(0.04, "prefill-0", "transfer.status", rid="", chunk="Bootstrapping", note="wrote, now Bootstrapping"),
        m(0.05, "prefill-0", "transfer.status", rid="", chunk="WaitingForInput", note="wrote, now WaitingForInput"),
        m(0.20, "prefill-0", "prefill.send", chunk=0),
    )
    assert stall_story(marks, "r", T0) == "prefill prefill.send at +0.20 s; decode decode.metadata at +0.03 s"
    assert stall_story(marks, "other", T0) == ""


def test_a_release_by_timeout_before_its_timeout_is_early():
    marks = [m(0.0, "decode-0", "decode.defer"), m(0.5, "decode-0", "decode.released", note="timeout")]
    assert early_releases(marks, 5.0) == [
        "decode-0 released room 7 (r) by timeout 0.50 s after deferring it (its timeout: 5 s), "
        "with no drain ack from prefill"
    ]
    assert early_releases(marks, 0.4) == []
    assert release_outcomes(marks) == {"timeout": 1}


def test_a_release_while_a_write_runs_is_named_and_a_finished_write_is_not():
    write = [m(0.0, "prefill-0", "transfer.write", chunk=0)]
    done = [m(0.1, "prefill-0", "transfer.written", chunk=0)]
    released = [m(0.2, "decode-0", "decode.release"), m(0.21, "decode-0", "decode.released", note="timeout")]
    assert writes_after_release(write + released) == [
        "room 7 (r): decode released it (timeout) while prefill's write of chunk 0 was still running"
    ]
    assert writes_after_release(write + done + released) == []


def test_a_release_is_judged_when_it_frees_not_when_sglang_observes_it():
    # A fresh clone's trace: _do_release freed the pages at +5.17 s, waited, and its outcome was observed at
    # +6.32 s, after the write returned (+6.28 s): the write ran into freed pages all the same.
    marks = [
        m(0.10, "prefill-2", "transfer.write", chunk=0),
        m(0.16, "decode-2", "decode.defer"),
        m(5.17, "decode-2", "decode.release"),
        m(6.28, "prefill-2", "transfer.written", chunk=0),
        m(6.32, "decode-2", "decode.released", note="timeout"),
    ]
    assert writes_after_release(marks) == [
        "room 7 (r): decode released it (timeout) while prefill's write of chunk 0 was still running"
    ]


def test_the_lost_update_a_fresh_clone_hit_by_chance_is_a_known_race():
    # The trace of a CI run's stalled test_cached_prefix_repeats_match_plain (room and times as written):
    # both of prefill's threads read "no room", the bootstrap thread wrote WaitingForInput, the scheduler
    # Bootstrapping over it; decode had sent its page list; nothing more until the client gave up at 120 s.
    from harness.plugins.explain import known_race

    marks = [
        m(0.06, "decode", "transfer.status", rid="", chunk="WaitingForInput", note="wrote, now WaitingForInput"),
        m(0.07, "decode", "decode.prealloc"),
        m(0.07, "decode", "decode.metadata"),
        m(0.08, "prefill", "transfer.status", rid="", chunk="Bootstrapping", note="read None, writing"),
        m(0.08, "prefill", "transfer.status", rid="", chunk="WaitingForInput", note="read None, writing"),
        m(0.08, "prefill", "transfer.status", rid="", chunk="WaitingForInput", note="wrote, now WaitingForInput"),
        m(0.081, "prefill", "transfer.status", rid="", chunk="Bootstrapping", note="wrote, now Bootstrapping"),
    ]
    story = stall_story(marks, "r", T0)
    assert story == (
        "prefill never reached it; decode decode.metadata at +0.07 s; room 7 stuck at Bootstrapping: a lost "
        "status update (WaitingForInput written at +0.08 s, then Bootstrapping over it at +0.08 s)"
    )
    assert "update_status" in known_race("stall", f"stall: request r: {story}")
    assert known_race("ledger", f"ledger [page-leak] ...; {story}") is None
    assert known_race("stall", "stall: request r: prefill never reached it; decode decode.metadata at +0.07 s") is None
