"""Root cause first: the knock-on table, pair by pair, and what leads a broken ledger's message."""

from __future__ import annotations

import pickle

import pytest

from harness import ledger
from harness.ledger.rules import KNOCK_ONS
from harness.report import timeline

PAIRS = [(rule, follows) for rule, followers in KNOCK_ONS.items() for follows in followers]


def _v(rule: str, seq: int | None, worker: str = "decode-0", rid: str = "r1") -> ledger.Violation:
    return ledger.Violation(rule, f"{rule} broke", seq, worker, rid, "prealloc")


@pytest.mark.parametrize("rule, follows", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_each_knock_on_groups_under_its_cause_on_the_same_worker_and_request(rule, follows):
    cause, after = _v(rule, 3), _v(follows, 9)
    [only] = ledger.root_causes([after, cause])  # given in any order: the earlier one leads
    assert only.root is cause and only.knock_ons == (after,)
    # the end of the run's finding (no event) on the same request follows too
    assert ledger.root_causes([_v(follows, None), cause])[0].knock_ons[0].rule == follows
    # another worker's, or another request's, is a root cause of its own
    for elsewhere in (_v(follows, 9, worker="decode-1"), _v(follows, 9, rid="r2")):
        assert [c.root.rule for c in ledger.root_causes([cause, elsewhere])] == [rule, follows]
    # one that came first does not follow from a later one
    if rule not in KNOCK_ONS.get(follows, ()):
        assert [c.root.rule for c in ledger.root_causes([_v(follows, 1), _v(rule, 2)])] == [follows, rule]


def test_a_pool_wide_finding_follows_any_request_on_its_worker():
    tail, leak = _v("swa-tail-short", 3), _v("page-leak", None, rid="")
    [only] = ledger.root_causes([leak, tail])
    assert only.root is tail and only.knock_ons == (leak,)


def test_a_knock_on_of_a_knock_on_stays_under_the_first_root():
    chain = [_v("swa-tail-short", 1), _v("swa-window-lost", 5), _v("swa-over-window", 7)]
    [only] = ledger.root_causes(reversed(chain))
    assert only.root.rule == "swa-tail-short" and [k.rule for k in only.knock_ons] == [
        "swa-window-lost",
        "swa-over-window",
    ]


def test_a_broken_ledger_says_its_root_cause_first_and_survives_pickling():
    found = [_v("page-leak", None), _v("not-baseline", None, rid=""), _v("swa-tail-short", 4)]
    with pytest.raises(ledger.LedgerBroken) as raised:
        ledger.assert_clean(found, "after prealloc of r1")
    e = raised.value
    lines = str(e).splitlines()
    assert lines[0] == "ledger broken after prealloc of r1: 3 violation(s), 1 root cause(s)"
    assert lines[1].startswith("[swa-tail-short] decode-0#4 rid=r1") and lines[2].startswith("  then [page-leak]")
    back = pickle.loads(pickle.dumps(e))
    assert str(back) == str(e) and back.violations == e.violations and isinstance(back, AssertionError)
    ledger.assert_clean([], "nothing")  # clean: no error


def test_the_report_lists_the_root_cause_first_with_its_knock_ons_under_it():
    # The leak is found at the request's last event, before the short tail of a later prealloc on
    # the same request would come first in time: the root still leads and the leak follows it.
    def ev(seq: int, kind: str, rid: str, ts: float, **kw) -> ledger.Event:
        return ledger.Event(
            seq=seq, ts=ts, kind=kind, rid=rid, component="decode", worker="decode-0", page_size=64, **kw
        )

    config = ledger.LedgerConfig(page_size=64, window=100, swa_tail=True)
    events = [
        ev(0, "config", ledger.CONFIG_RID, 0.0, **ledger.config_event(config, {"full": 64, "swa": 64})),
        ev(
            1,
            "prealloc",
            "r1",
            1.0,
            pages={"full": [1, 2, 3, 4, 5], "swa": [1]},
            fill_len=300,
            swa_tail_len=44,
            evicted_seqlen=256,
            window=100,
        ),
        ev(2, "release", "r1", 2.0, pages={"full": [1, 2, 3, 4]}),
    ]  # a page of each pool kept: a leak
    violations = ledger.check(events)
    rules = {v.rule for v in violations}
    assert "swa-tail-short" in rules and "page-leak" in rules, violations
    [rank] = timeline.build({"decode-0": events})
    marks = sorted(rank.marks, key=lambda m: int(m.label[1:]))
    assert marks[0].rule == "swa-tail-short" and marks[0].follows == ""
    assert all(m.follows == "V1" for m in marks[1:]), [(m.label, m.rule, m.follows) for m in marks]
