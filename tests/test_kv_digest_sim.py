"""The KV-content rules on real bytes, in one in-process PD pair on sglang's real pools (the simulated engine's
ranks, no Ray): a clean run commits what was sent; the harness's ``corrupt-kv-page`` fault breaks
``kv-content``; a late write of a released request into pages another request now holds breaks
``write-after-free`` (by its landing time and by the bytes the new owner commits)."""

from __future__ import annotations

import pytest

from harness import faults, ledger
from harness.engines.sim.decode_rank import KVCorruption
from harness.engines.sim.driver import run
from harness.engines.sim.kv_transfer import plan
from harness.engines.sim.workload import KVSpec, PDRequest
from pdpair import SPEC, pair  # noqa: F401 - the module's fixture (F811 where a test or fixture takes it)


@pytest.fixture
def fresh(pair):  # noqa: F811
    pair.decode.members[0].live.clear()
    pair.prefill.members[0].reqs.clear()
    pair.configure(SPEC)
    return pair


def _content(violations):
    return [v for v in violations if v.rule in ledger.CONTENT_RULES]


def test_a_clean_run_commits_what_prefill_sent(fresh):
    marks = fresh.ledger_marks()
    res = run(fresh, [PDRequest("a300", 300, decode_steps=4), PDRequest("a129", 129, decode_steps=2)])
    res.assert_clean()
    events = fresh.events_since(marks)
    kinds = {e.kind for e in events}
    assert {"kv_sent", "kv_dest", "kv_commit", "kv_landed"} <= kinds, kinds
    commits = {e.content["room"] for e in events if e.kind == "kv_commit"}
    assert commits == {f"{r}:{pool}:0" for r in ("a300", "a129") for pool in ("full", "swa")}
    assert _content(ledger.check(events)) == []


def test_corrupt_kv_page_breaks_kv_content_naming_the_request(fresh):
    faults.activate(["corrupt-kv-page"])
    try:
        with pytest.raises(KVCorruption) as info:
            run(fresh, [PDRequest("c300", 300, decode_steps=2)])
    finally:
        faults.deactivate(["corrupt-kv-page"])
    found = _content(info.value.violations)
    assert [v.rule for v in found] == ["kv-content"], found
    assert found[0].rid == "c300" and "room c300:full:0: 1 of 5 page(s) differ" in found[0].message


def test_a_late_write_after_the_release_is_write_after_free(fresh):
    prefill, decode = fresh.prefill.members[0], fresh.decode.members[0]
    fresh.configure(KVSpec(**{**SPEC.__dict__, "full_tokens": 2 * 64, "swa_tokens": 4 * 64}))  # two full pages
    marks = fresh.ledger_marks()
    # A is preallocated, prefilled and sent, then aborted (released) on both sides; B gets its pages (the only
    # ones) and receives its own KV; then A's transfer writes once more, late, before B commits.
    dst_a = decode.admit("late-a", 100, 2)
    src_a = prefill.prefill("late-a", 100)
    (chunk_a,) = plan([src_a], [dst_a], 8)
    data_a = [a.copy() for a in prefill.read_chunk("late-a", chunk_a.src())]  # what A's transfer carries
    decode.write_chunk("late-a", chunk_a.dst(), data_a)
    decode.abort("late-a")
    prefill.release("late-a")
    dst_b = decode.admit("late-b", 100, 2)
    assert dst_b["full"] == dst_a["full"], "B must reuse A's pages for the late write to hit it"
    src_b = prefill.prefill("late-b", 100)
    (chunk_b,) = plan([src_b], [dst_b], 8)
    decode.write_chunk("late-b", chunk_b.dst(), prefill.read_chunk("late-b", chunk_b.src()))
    decode.write_chunk("late-a", chunk_a.dst(), data_a)  # the late write
    with pytest.raises(KVCorruption):  # the rank's own check sees B's bytes changed; the ledger names who
        decode.commit("late-b", sorted(dst_b["full"].values()), sorted(dst_b["swa"].values()))
    found = _content(ledger.check(fresh.events_since(marks)))
    rules = {(v.rule, v.kind) for v in found}
    assert ("write-after-free", "kv_landed") in rules and ("write-after-free", "kv_commit") in rules, found
    late = next(v for v in found if v.rule == "write-after-free" and v.kind == "kv_landed")
    assert "late writer room late-a:full:0 (late-a)" in late.message and "new owner: late-b" in late.message
    bytes_ = next(v for v in found if v.rule == "write-after-free" and v.kind == "kv_commit")
    assert "late writer room late-a:full:0" in bytes_.message and "new owner: late-b" in bytes_.message
    prefill.release("late-b")
    decode.abort("late-b")
