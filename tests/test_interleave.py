"""One interleaving script on the simulated pair (harness.explore.interleave.SimRun): phases passed in the
servers' order, a hold stops the request there, an abort at a held send frees everything."""

from __future__ import annotations

import pytest

from harness.engines import phases
from harness.explore import interleave as il
from harness.explore.pair import Pair, PairConfig


@pytest.fixture
def pair(tmp_path):
    p = Pair(PairConfig(), tmp_path)
    yield p


def test_an_abort_at_a_held_send_frees_everything_on_the_pair(pair):
    marks = il.SimRun(pair).run(il.abort_at_held_send("a", 40))
    assert [m.phase for m in marks] == [
        "decode.prealloc",
        "decode.metadata",
        "prefill.forwarded",
        "prefill.send",
        "decode.release",
        "decode.released",
    ]
    pair.close()  # every pool back at its baseline, every ledger rule holds


def test_a_request_runs_through_every_phase_in_the_servers_order(pair):
    marks = il.SimRun(pair).run([il.send("b", 70, 2), il.wait("decode.commit", "b")])
    seen = list(dict.fromkeys(m.phase for m in marks))
    assert seen == [
        "decode.prealloc",
        "decode.metadata",
        "prefill.forwarded",
        "prefill.send",
        "transfer.write",
        "transfer.written",
        "prefill.sent",
        "decode.transferred",
        "decode.commit",
        "prefill.release",
    ]
    assert [m.chunk for m in marks if m.phase == "prefill.send"] == list(range(len(pair.reqs["r0"].chunks)))


def test_waiting_past_a_held_phase_says_where_the_request_is_held(pair):
    with pytest.raises(il.ScriptError, match="held at decode.commit"):
        il.SimRun(pair).run([il.send("c", 40, 2), il.hold("decode.commit", "c"), il.wait("prefill.release", "c")])


def test_an_unknown_phase_is_one_line():
    with pytest.raises(phases.PhaseError, match="not one of"):
        il.hold("prefill.nowhere", "a")
