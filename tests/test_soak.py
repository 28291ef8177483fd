"""The soak's verdict (:mod:`harness.engines.soak_driver`, which both engines drive): a leak at any checkpoint fails
it, naming where, and the slope is exact; the first leak ends the soak; ``--soak`` takes a positive
count. The soak itself runs as suites (``suites/disaggregation/test_disaggregation_soak.py`` on the
simulated engine, ``test_disaggregation_soak_server.py`` on a real CPU stack)."""

from __future__ import annotations

from dataclasses import replace

import subprocess
import sys
from pathlib import Path

import pytest

from harness.engines.interface import BatchOutcome, Checkpoint, LeakError
from harness.engines.soak_driver import SoakResult, drive, mix

REPO = Path(__file__).resolve().parent.parent


def _result(leaks: list[int]) -> SoakResult:
    return SoakResult(
        requests=50 * len(leaks),
        completed=50 * len(leaks),
        wall_s=2.0,
        checkpoints=[Checkpoint(50 * (i + 1), {"full": 0, "swa": leak, "live": 0}, 0) for i, leak in enumerate(leaks)],
    )


def test_a_balanced_soak_has_slope_zero_and_passes():
    result = _result([0] * 6)
    result.assert_clean()
    assert result.slope == 0.0 and result.requests_per_s == 150.0
    assert result.summary()["max_leak"] == 0


def test_one_slot_not_back_at_one_checkpoint_fails_naming_it():
    result = _result([0, 0, 0, 0, 1, 1])
    with pytest.raises(LeakError, match=r"leak after 250 requests \(checkpoint 5 of 6\): \{'swa': 1\} slot\(s\)"):
        result.assert_clean()
    assert result.slope > 0
    assert _result([0, 64, 128, 192]).slope == pytest.approx(1280.0)  # 64 slots per 50 requests


def test_a_checkpoint_whose_own_check_failed_fails_the_soak_without_a_slot_leaked():
    result = _result([0, 0])
    result.checkpoints[1] = Checkpoint(100, {"decode.swa": 0}, 0, "decode: ledger after the reset: [page-leak] ...")
    with pytest.raises(LeakError, match=r"after 100 requests \(checkpoint 2 of 2\).*\[page-leak\]"):
        result.assert_clean()


class _Engine:
    """Leaks ``leak_at`` slots from the batch ending at request 30 on."""

    def __init__(self, leak_at: int) -> None:
        self.batches: list[list] = []
        self.leak_at = leak_at

    def run_batch(self, requests):
        self.batches.append(list(requests))
        return BatchOutcome(len(requests) - sum(r.abort for r in requests), sum(r.abort for r in requests))

    def checkpoint(self, requests):
        return Checkpoint(requests, {"swa": self.leak_at if requests >= 30 else 0})


def test_drive_runs_the_seeded_mix_in_batches_and_stops_at_the_first_leak():
    engine = _Engine(0)
    clean = drive(engine, 45, every=10, seed=12, page_size=64, max_prompt=256)
    assert [len(b) for b in engine.batches] == [10, 10, 10, 10, 5]
    assert engine.batches[1] == mix(
        13, 10, page_size=64, max_prompt=256, max_new=8, abort_rate=0.1, prefix="s1-", groups=1
    )
    # Seed 12 draws no abort for the first batch: its longest request is aborted, so every batch drives the path.
    assert not any(r.abort for r in mix(12, 10, page_size=64, max_prompt=256, abort_rate=0.1))
    first = mix(12, 10, page_size=64, max_prompt=256, abort_rate=0.1, prefix="s0-", groups=1)
    longest = max(range(10), key=lambda i: first[i].length)
    assert [r.abort for r in engine.batches[0]] == [i == longest for i in range(10)]
    assert [replace(r, abort=False) for r in engine.batches[0]] == first
    assert all(any(r.abort for r in b) for b in engine.batches)
    assert [c.requests for c in clean.checkpoints] == [10, 20, 30, 40, 45] and clean.slope == 0.0
    assert clean.completed + clean.aborted == 45
    leaky = _Engine(1)
    result = drive(leaky, 45, every=10, seed=12, page_size=64, max_prompt=256)
    assert len(leaky.batches) == 3 and result.checkpoints[-1].requests == 30
    with pytest.raises(LeakError, match="leak after 30 requests"):
        result.assert_clean()


def test_the_mix_puts_lengths_at_page_boundaries_and_every_third_request_in_a_prefix_group():
    reqs = mix(0, 300, page_size=64, max_prompt=256, abort_rate=0.1, prefix="s0-", groups=3)
    assert all(1 <= r.length <= 256 and 1 <= r.new_tokens <= 8 for r in reqs)
    assert sum(r.length % 64 in (63, 0, 1) for r in reqs) > 200
    assert {r.group for r in reqs[::3]} == {"s0-g0", "s0-g1", "s0-g2"} and not any(
        r.group for i, r in enumerate(reqs) if i % 3
    )
    assert 10 < sum(r.abort for r in reqs) < 60


def test_soak_needs_a_positive_count():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--soak",
            "0",
            "--co",
            "-q",
            "suites/disaggregation/test_disaggregation_soak.py",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "--soak 0: a soak needs at least 1 request; give a positive number" in proc.stderr


def test_the_mix_draws_the_simulated_engines_workload():
    # harness.engines.sim.workload.workload (the e2e suites' requests) is the soak's mix as PD requests: same draw.
    from harness.engines.sim.workload import workload

    soak = mix(7, 300, page_size=64, max_prompt=384, max_new=12, abort_rate=0.1, prefix="s0-", groups=3)
    sim = workload(7, 300, page_size=64, max_prompt=384, max_steps=12, abort_rate=0.1, prefix="s0-")
    assert [(r.rid, r.length, r.new_tokens, r.abort) for r in soak] == [
        (w.rid, w.prompt_len, w.decode_steps, w.abort_after_chunks is not None) for w in sim
    ]


def test_no_server_rid_of_a_soak_is_a_prefix_of_another():
    # sglang's /abort_request aborts every rid that starts with the one given: a real-stack soak that
    # aborted s9-1 while s9-11 was in flight lost s9-11 too (bench/soak.py --engine server, 1 in 2,000).
    from harness.engines.server.server_soak import server_rid

    rids = sorted(
        server_rid("t", r.rid)
        for b in range(12)
        for r in mix(b, 120, page_size=64, max_prompt=256, abort_rate=0.1, prefix=f"s{b}-", groups=3)
    )
    assert len(set(rids)) == len(rids)
    assert not [(a, b) for a, b in zip(rids, rids[1:]) if b.startswith(a)]
