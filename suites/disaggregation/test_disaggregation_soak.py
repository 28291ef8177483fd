"""A soak over Ray on the 2-GPU H100 topology: ``--soak N`` requests (300 by default) through one PD
pair with hybrid-SWA pools and the radix cache on — prompt lengths at page boundaries, aborts
mid-transfer, shared prefixes — with every pool back at its baseline exactly after every batch.

A leak is not a tolerance: each checkpoint must read zero, so the leak's slope over the requests is
zero; a leak of one slot after the 250th request fails the soak naming that checkpoint.
``bench/soak.py`` runs the same code for 10,000 requests and reports requests/s and the slope.
"""

from __future__ import annotations

import pytest

from harness.api import KVSpec, soak

pytestmark = [pytest.mark.topology("2-gpu-h100"), pytest.mark.est_time(40), pytest.mark.timeout(1800)]

PAGE, WINDOW = 64, 100
SPEC = KVSpec(
    kind="swa",
    page_size=PAGE,
    window=WINDOW,
    radix_cache=True,
    full_tokens=48 * PAGE,
    swa_tokens=16 * PAGE,
    req_slots=8,
)


def test_soak_every_pool_back_at_baseline_after_every_batch(pd_pair, soak_requests, workload_seed, record_property):
    result = soak(pd_pair(SPEC), soak_requests, every=50, seed=workload_seed)
    record_property("soak", result.summary())
    result.assert_clean()
    assert result.requests == soak_requests == result.completed + result.aborted, result.summary()
    assert result.aborted, "no request was aborted: the soak did not drive the abort path"
    assert result.prefix_hits, "no request hit the radix cache: the soak did not drive shared prefixes"
    assert len(result.checkpoints) == -(-soak_requests // 50) and result.slope == 0.0, result.summary()
