"""``harness explore`` on the simulated engine: a short seeded exploration of clean sglang raises nothing, a
catalog fault is found and shrunk to a few steps with a repro file, and a replay is byte-exact.

The faulted run is a subprocess: a source-patch fault needs a patched sglang copy first on the import path
before sglang is imported, which this process has already done."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.api import ExplorePair as Pair
from harness.api import ExplorePairConfig as PairConfig
from harness.api import ExploreSession as Session
from harness.api import ExploreFinding as Finding
from harness.api import ExploreStep as Step
from harness.api import explore_shrink_by_replay as shrink_by_replay
from harness.api import explore_replay as replay
from harness.api import harness_main as main
from harness.api import ledger
from harness.api import rerun_test_main as rerun_main

pytestmark = [pytest.mark.timeout(240)]

BATCH = 25  # schedules per Hypothesis run (harness.explore.machine.BATCH)

CONFIG = PairConfig(
    page_size=16,
    window=24,
    full_pages=160,
    swa_pages=128,
    req_slots=4,
    radix_cache=True,
    eviction_interval=1,
    chunk_pages=1,
)


def test_short_exploration_of_clean_sglang_raises_nothing(tmp_path):
    """The fixed-seed exploration CI runs: 25 schedules (bounded by examples, not minutes)."""
    session = Session(20260, tmp_path, examples=25)
    finding = session.run()
    assert finding is None, "\n".join(finding.lines())
    assert session.progress.schedules >= 25 and session.progress.steps > 50


def test_the_time_budget_holds_within_a_batch(tmp_path):
    """A clock that jumps past the budget once 7 steps have run: the session stops before the 8th step, inside
    its first batch (25 schedules), instead of finishing the batch (what a check between batches does)."""
    holder: list = []
    session = Session(5, tmp_path, seconds=60.0, clock=lambda: 1e9 if holder and holder[0].progress.steps >= 7 else 0.0)
    holder.append(session)
    assert session.run() is None
    assert session.stopped == "time, mid-batch"
    assert session.progress.steps == 7 and 1 <= session.progress.schedules < BATCH, session.progress.line()


def test_a_budget_spent_while_hypothesis_replays_a_schedule_is_a_time_stop_not_a_flaky_batch(tmp_path, monkeypatch):
    """A budget spent inside a schedule Hypothesis is replaying reaches the session as Hypothesis's
    ``FlakyStrategyDefinition`` ("the second run stopped drawing earlier"), not as BudgetSpent (what
    ``harness explore --seed 2 --minutes 1`` met at its deadline). Planted here as it happens: the batch's
    step sees the budget spent (BudgetSpent, caught inside Hypothesis), and Hypothesis raises the Flaky in its
    place. The session stops on time, mid-batch; it called the batch abandoned before. (Reaching it through
    Hypothesis's own replay depends on where the deadline lands: a fake clock at a fixed step did it in one
    process and not in an xdist worker of a fresh clone's CI.)"""
    from hypothesis.errors import FlakyStrategyDefinition

    expired = {"now": False}
    session = Session(5, tmp_path, seconds=60.0, clock=lambda: 1e9 if expired["now"] else 0.0)

    def batch_met_the_deadline_in_a_replay(self, n):
        expired["now"] = True
        try:
            self.check_budget()  # the step's own check, inside Hypothesis's run
        except BaseException:  # noqa: BLE001 - Hypothesis's tree catches it and raises the Flaky instead
            pass
        raise FlakyStrategyDefinition("Inconsistent data generation! the second run stopped drawing earlier")

    monkeypatch.setattr(Session, "_run_batch", batch_met_the_deadline_in_a_replay)
    assert session.run() is None
    assert session.stopped == "time, mid-batch" and [b.outcome for b in session.batches] == ["time, mid-batch"]


def schedule(run_dir: Path) -> tuple[list, list[str]]:
    """A schedule through every operation, run once: a shared prompt, chunked transfers, decode with SWA
    eviction, retract and resume, an abort mid-transfer, a failed transfer, a flush of the radix cache."""
    pair = Pair(CONFIG, run_dir)
    steps: list = []

    def do(op: str, **args) -> str:
        steps.append((op, args))
        out = pair.apply(op, **args).outcome
        pair.check()
        return out

    def through(rid: str) -> None:
        do("prealloc", rid=rid)
        do("prefill", rid=rid)
        while rid in pair.candidates("transfer"):
            do("transfer", rid=rid)
        do("commit", rid=rid)

    do("submit", prompt_len=47, group=0, steps=3)
    through("r0")
    assert do("decode", n=3) == "finished r0"  # its KV goes to the radix cache
    do("submit", prompt_len=49, group=0, steps=6)
    through("r1")
    do("submit", prompt_len=33, group=0, steps=3)
    do("prefill", rid="r2")
    do("prealloc", rid="r2")
    do("transfer", rid="r2")
    do("abort", rid="r2")
    do("submit", prompt_len=16, group=1, steps=2)
    do("prealloc", rid="r3")
    do("fail", rid="r3")
    do("retract", rid="r1")
    assert do("resume") == "resumed r1"
    do("decode", n=4)
    do("flush")
    pair.close()
    return steps, pair.log


def test_replay_is_byte_exact(tmp_path):
    steps, log = schedule(tmp_path)
    first = replay(CONFIG, steps, tmp_path)
    second = replay(CONFIG, steps, tmp_path)
    assert first.failure is None, first.failure
    assert [s.op for s in first.steps] == [op for op, _ in steps]
    assert first.log == log and first.log_bytes() == second.log_bytes()


def test_a_rule_broken_midway_breaks_the_check_after_its_step_as_the_full_check_says(tmp_path):
    """The pair judges the ledger's rules over each step's new events (harness/explore/watch.py): an event that
    breaks one midway (a transfer naming a page its request does not hold, as a buggy rank would write it) breaks
    the check after that step, with the message of ``ledger.check`` over every event."""
    pair = Pair(CONFIG, tmp_path)
    pair.apply("submit", prompt_len=47, group=0, steps=3)
    for op in ("prealloc", "prefill", "transfer"):
        pair.apply(op, rid="r0")
        pair.check()
    pair.decode.ledger.record("transfer", "r0", CONFIG.page_size, pages={"full": (CONFIG.full_pages - 1,)})
    pair.apply("transfer", rid="r0")
    with pytest.raises(AssertionError) as broken:
        pair.check()
    want = [v for v in ledger.check(pair.events()) if v.rule not in ("page-leak", "in-flight-at-end")]
    assert [v.rule for v in want] == ["transfer-unowned"]
    assert str(broken.value) == "ledger: " + "; ".join(str(v) for v in want)
    with pytest.raises(AssertionError, match="transfer-unowned"):
        pair.close()


def test_a_catalog_fault_is_found_and_shrunk_to_a_repro(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("HARNESS_FAULTS", None)
    cmd = [
        str(Path(sys.executable).with_name("harness")),  # the installed command, as a user runs it
        "explore",
        "--fault",
        "release-leaks-swa",
        "--seed",
        "1",
        "--examples",  # bounded by schedules, not time: a loaded CI machine runs the same ones
        "300",
        "--run-dir",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=200)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    repro = Path(next(line for line in lines if line.startswith("repro: ")).removeprefix("repro: "))
    data = json.loads(repro.read_text())
    assert data["faults"] == ["release-leaks-swa"] and 1 <= len(data["steps"]) <= 10, done.stdout
    assert "\n  1. " in done.stdout and "\n  => " in done.stdout, done.stdout


def test_more_retracted_requests_than_slots_resume_a_slotful_at_a_time_at_the_end(tmp_path):
    """Four retracted requests on two request slots: the end checks resume two, abort them, resume the rest
    (resuming once left two retracted and called it a failure of clean sglang)."""
    pair = Pair(PairConfig(page_size=16, window=24, full_pages=160, swa_pages=128, req_slots=2), tmp_path)
    for rid in ("r0", "r1", "r2", "r3"):
        pair.apply("submit", prompt_len=40, group=0, steps=6)
        for op in ("prealloc", "prefill", "transfer", "transfer", "transfer", "commit"):
            pair.apply(op, rid=rid)
        pair.apply("retract", rid=rid)
        pair.check()
    assert pair.retracted() == ["r0", "r1", "r2", "r3"]
    pair.close()


def test_a_second_shrinking_pass_drops_the_steps_the_failure_does_not_need(tmp_path):
    """What a failing schedule becomes when Hypothesis's own shrinking stops early: steps dropped, last first,
    while a replay still fails the same way (here an operation on a request that is not there); a dropped
    submit renames the requests after it one down, as the pair numbers them (r9 ends as r7)."""
    steps = [
        Step("submit", {"prompt_len": 20, "group": 0, "steps": 1}),
        Step("submit", {"prompt_len": 30, "group": 1, "steps": 1}),
        Step("prealloc", {"rid": "r0"}),
        Step("prealloc", {"rid": "r9"}),
    ]
    failure = "step 4 (prealloc): ValueError: prealloc r9: not a request this operation can act on now"
    found = Finding(seed=0, config=CONFIG, steps=steps, failure=failure, at_end=False)
    shrunk = shrink_by_replay(found, tmp_path)
    assert [(s.op, s.args) for s in shrunk.steps] == [("prealloc", {"rid": "r7"})], shrunk.lines()
    assert shrunk.failure == "step 1 (prealloc): ValueError: prealloc r7: not a request this operation can act on now"


def test_a_budget_spent_while_hypothesis_shrinks_still_gets_the_replay_pass(tmp_path):
    """The budget runs out while Hypothesis shrinks: the shortest failing schedule seen is the finding, and a
    long one is still shortened by replay (a 1- and a 3-minute run of prealloc-no-swa-evict ended on 13 steps
    with two probes and two repeated waits a replay drops)."""
    failure = "step 12 (prealloc): ValueError: prealloc r20: not a request this operation can act on now"
    steps = [Step("submit", {"prompt_len": 20 + i, "group": 0, "steps": 1}) for i in range(11)]
    session = Session(0, tmp_path, seconds=60.0)
    session.best = Finding(0, CONFIG, [*steps, Step("prealloc", {"rid": "r20"})], failure, at_end=False)
    assert session._stopped_mid_batch() == "time, mid-batch"
    found = session.finding
    assert found is not None and not found.shrunk
    assert [(s.op, s.args) for s in found.steps] == [("prealloc", {"rid": "r9"})], found.lines()
    assert "shortened by replay when over 10 steps" in found.lines()[-1]


def test_rerun_test_from_replays_an_explore_repro_byte_exactly(tmp_path, capsys, monkeypatch):
    """A repro that exploration wrote (a runtime fault, so this process can apply it), replayed three times by
    ``rerun-test --from``: each breaks again with the same failure and writes the same event bytes, the
    bytes the exploration recorded."""
    monkeypatch.delenv("HARNESS_FAULTS", raising=False)
    found = tmp_path / "found"
    argv = ["explore", "--fault", "corrupt-kv-page", "--seed", "1", "--examples", "200", "--run-dir", str(found)]
    assert main(argv) == 1
    repro = found / "explore-repro.json"
    recorded = json.loads(repro.read_text())
    summary = (found / "report" / "summary.md").read_text()  # the report: what ran, and the shrunk schedule
    assert "## Schedules run" in summary and "## Shrunk schedule" in summary, summary
    assert "| raised KVCorruption |" in summary, summary
    assert (found / "report" / "index.html").is_file()
    codes, events = [], []
    for i in range(3):
        codes.append(rerun_main(["--from", str(repro), "--run-dir", str(tmp_path / f"replay-{i}")]))
        events.append((tmp_path / f"replay-{i}" / "explore-events.jsonl").read_bytes())
    out = capsys.readouterr().out
    assert codes == [1, 1, 1], out
    assert events[0] == events[1] == events[2] == (found / "explore-events.jsonl").read_bytes()
    assert hashlib.sha256(events[0]).hexdigest() == recorded["events_sha256"] and recorded["events"] > 3
    assert out.count("REPRODUCED: the schedule breaks again (the same failure)") == 3, out


def test_rerun_test_from_an_unusable_explore_repro_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "explore-repro.json"
    bad.write_text(json.dumps({"version": 99, "kind": "explore", "seed": 1, "config": {}, "steps": []}))
    assert rerun_main(["--from", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not an explore repro file (version 99" in err[0], err


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert main(["explore", "--engine", "sglang-server", "--topology", "2-gpu-h100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "real-server schedules run the CPU stack" in err[0]
    assert main(["explore", "--topology", "no-such-topology"]) == 2
