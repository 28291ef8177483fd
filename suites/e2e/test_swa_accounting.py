"""A seeded randomized workload (several hundred requests) through P→D on both topologies, with the
accounting ledger as the oracle: every page freed exactly once, SWA tails and charges as the
configuration implies, decode windows kept and evicted within the interval, both sides back to
baseline when idle.

The workload comes from ``workload_seed`` (``--workload-seed``, derived per test): a failing run
prints its seed, the gate stores it in ``repro.json``, and ``rerun-test --from`` replays the same
requests. The workload's fingerprint is a JUnit property, so a replay can be compared."""

from __future__ import annotations

import hashlib

import pytest

from harness.api import KVSpec, run, workload

pytestmark = [pytest.mark.topology("2-gpu-h100", "8-gpu-h200"), pytest.mark.est_time(180), pytest.mark.timeout(900)]

PAGE, WINDOW = 64, 100


def fingerprint(reqs) -> str:
    """A short digest of a workload (ids, lengths, steps, aborts): equal seeds, equal fingerprints."""
    text = ";".join(f"{r.rid}:{r.prompt_len}:{r.decode_steps}:{r.abort_after_chunks}" for r in reqs)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.mark.parametrize("radix_cache", [False, True], ids=["radix-off", "radix-on"])
def test_randomized_workload_ledger_balances(pd_pair, pd_report, topology, radix_cache, workload_seed, record_property):
    spec = KVSpec(
        kind="swa",
        page_size=PAGE,
        window=WINDOW,
        radix_cache=radix_cache,
        full_tokens=24 * PAGE,
        swa_tokens=10 * PAGE,
        req_slots=8,
    )
    pair = pd_pair(spec)
    reqs = workload(
        workload_seed,
        200,
        page_size=PAGE,
        max_prompt=6 * PAGE,
        max_steps=12,
        abort_rate=0.05,
        prefix=f"{topology.name}-{int(radix_cache)}-",
    )
    record_property("workload_fingerprint", fingerprint(reqs))
    groups = {r.rid: f"g{i % 7}" for i, r in enumerate(reqs)} if radix_cache else None
    res = run(pair, reqs, groups=groups, chunk_pages=8)
    summary = pd_report(res)
    res.assert_clean()
    assert sorted(res.completed + res.aborted) == sorted(r.rid for r in reqs), "requests lost"
    assert res.waited, "the workload never put the pools under pressure"
    assert summary["ledger"]["requests"] >= len(reqs)
