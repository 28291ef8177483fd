"""``LedgerWatch`` (harness/explore/watch.py), the ledger's rules judged over a schedule's new events only, gives
what ``ledger.check`` over every event gives (less the end-of-run rules), after every step: on a schedule whose
rules break midway (a page taken twice, bytes committed that prefill never sent), across two writers.

Each test fails if the watch judged only the new events (a fresh walk per step, or the content rules over the
new events alone: the broken rules below need an earlier step's events), or skipped the content rules on a
step that wrote decode events only (the bad commit comes alone)."""

from __future__ import annotations

from harness import ledger
from harness.explore.watch import LedgerWatch
from harness.ledger import Event, LedgerConfig

P = 64
END_RULES = frozenset({"page-leak", "in-flight-at-end"})  # as harness.explore.pair judges them only at the end
CONFIG = LedgerConfig(page_size=P, window=100, swa_tail=True, eviction_interval=1)


class Writer:
    """One worker's events, numbered as a ``LedgerWriter`` numbers them."""

    def __init__(self, worker: str, component: str) -> None:
        self.worker, self.component, self.events = worker, component, []

    def __call__(self, kind: str, rid: str, ts: float, **fields) -> None:
        seq = len(self.events)
        self.events.append(Event(seq, ts, kind, rid, self.component, self.worker, page_size=P, **fields))


def schedule() -> tuple[Writer, Writer, list[tuple[int, int]]]:
    """A prefill and a decode worker's events, and where each step ends (the events each had written then):
    step 3 takes a page another request holds (``page-double-alloc``), step 5 commits bytes other than those
    prefill sent in step 4 (``kv-content``), step 6 leaves a request holding pages (an end-only rule)."""
    pre, dec = Writer("p0", "prefill"), Writer("d0", "decode")
    ends: list[tuple[int, int]] = []

    def step() -> None:
        ends.append((len(pre.events), len(dec.events)))

    baseline = {"full": 640, "swa": 320}
    for w in (pre, dec):
        w("config", ledger.CONFIG_RID, 0.0, **ledger.config_event(CONFIG, baseline))
    step()
    dec("decode_alloc", "a", 1.0, pages={"full": (1, 2)}, free_before={"full": 640}, free_after={"full": 512})
    dec("kv_dest", "a", 1.1, content={"room": 1, "dst": [1, 2]})
    step()
    pre("decode_alloc", "pa", 2.0, pages={"full": (10, 11)}, free_before={"full": 640}, free_after={"full": 512})
    dec("decode_alloc", "b", 2.1, pages={"full": (2, 3)}, free_before={"full": 512}, free_after={"full": 384})
    step()  # page 2 taken by b while a holds it
    step()  # nothing written
    pre("kv_sent", "pa", 4.0, content={"room": 1, "at": 0, "src": [10, 11], "digests": [[7, 8]]})
    pre("kv_landed", "pa", 4.1, content={"room": 1, "at": 0, "src": [10, 11], "dst": [1, 2], "t0": 4.0})
    step()
    dec("kv_commit", "a", 5.0, content={"room": 1, "dst": [1, 2], "digests": [[7, 9]]})
    step()  # page 2 of room 1 holds other bytes than prefill sent
    pre("release", "pa", 6.0, pages={"full": (10, 11)}, free_before={"full": 512}, free_after={"full": 640})
    dec("release", "a", 6.1, pages={"full": (1,)}, free_before={"full": 384}, free_after={"full": 448})
    step()
    return pre, dec, ends


def full(writers: tuple[list[Event], ...]) -> list[ledger.Violation]:
    return [v for v in ledger.check([e for evs in writers for e in evs]) if v.rule not in END_RULES]


def test_the_watch_gives_the_full_checks_findings_after_every_step_of_a_schedule_that_breaks_midway():
    pre, dec, ends = schedule()
    watch = LedgerWatch(END_RULES)
    seen: list[list[str]] = []
    for step, (n_pre, n_dec) in enumerate(ends, 1):
        writers = (pre.events[:n_pre], dec.events[:n_dec])
        got = watch.violations(writers)
        assert got == full(writers), f"after step {step}"
        seen.append(sorted({v.rule for v in got}))
    assert seen == [
        [],
        [],
        ["page-double-alloc"],
        ["page-double-alloc"],
        ["page-double-alloc"],
        ["kv-content", "page-double-alloc"],
        ["kv-content", "page-double-alloc"],
    ]
    assert watch.walked == len(pre.events) + len(dec.events)  # each event walked once, never the log again
    assert {v.rule for v in ledger.check(pre.events + dec.events)} & END_RULES  # broken, and left to the end


def test_a_workers_seq_going_back_falls_back_to_the_full_check():
    """A second writer of the same worker (a restarted one numbers from 0 again): ``check`` sorts the worker's
    events by seq, so the watch cannot walk them as they come; it gives ``check``'s findings all the same."""
    pre, dec, _ = schedule()
    again = Writer("d0", "decode")
    writers = (pre.events, dec.events, again.events)
    watch = LedgerWatch(END_RULES)
    assert watch.violations(writers) == full(writers)
    again("decode_alloc", "c", 7.0, pages={"full": (2,)}, free_before={"full": 448}, free_after={"full": 384})
    got = watch.violations(writers)
    assert got == full(writers) and [v.rule for v in got].count("page-double-alloc") == 2
