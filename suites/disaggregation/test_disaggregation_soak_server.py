"""A soak on REAL sglang servers: ``--soak N`` requests (50 by default, a few seconds of requests: the
simulated soak, ``test_disaggregation_soak.py``, is the long one ``./dev test`` runs) through the
session's ``tiny-mellum-swa`` PD stack on CPU (prefill + decode + router, the stack of
``test_disaggregation_failure_paths_server.py`` and ``test_disaggregation_swa_server.py``: same model
and flags, so the soak starts no stack of its own) — prompt lengths at page boundaries, a tenth aborted
through sglang's ``/abort_request`` wherever they are, every third sharing a prefix in prefill's radix
cache — with every pool of both servers back at its baseline exactly after every batch of
:data:`EVERY`, read by the servers' accounting probes after sglang's ``/flush_cache`` and their whole
ledgers checked.

A leak is not a tolerance: each checkpoint must read zero (a slot of any pool of either server, or a
broken ledger rule, fails the soak naming the checkpoint), so the leak's slope over the requests is
zero. ``bench/soak.py --engine server`` runs the same code for 2,000 requests and reports requests/s
and the slope.
"""

from __future__ import annotations

import pytest

from harness.api import soak_stack

MODEL = "tiny-mellum-swa"
PAGE = 64
#: Requests per batch, between checkpoints.
EVERY = 25

pytestmark = [
    pytest.mark.engine(
        "sglang-server", models=(MODEL,), gpu_topologies=("2-gpu-h100",), server_args=("--page-size", str(PAGE))
    ),
    pytest.mark.topology("cpu"),
    pytest.mark.est_time(20),
    pytest.mark.timeout(900),
]


def test_soak_every_pool_of_both_servers_back_at_baseline_after_every_batch(
    sglang_servers, run_dir, server_soak_requests, workload_seed, record_property
):
    n = server_soak_requests
    result = soak_stack(sglang_servers.pd(MODEL), run_dir.ledger, n, every=EVERY, seed=workload_seed, page_size=PAGE)
    record_property("soak", result.summary())
    result.assert_clean()
    assert result.requests == n == result.completed + result.aborted, result.summary()
    assert len(result.checkpoints) == -(-n // EVERY) and result.slope == 0.0, result.summary()
    if n >= 2 * EVERY:  # enough requests that the mix holds both (seeded: it does for 50)
        assert result.aborted, f"no request ended aborted: the soak did not drive the abort path {result.summary()}"
        assert result.prefix_hits, f"no request hit prefill's radix cache: no shared prefix {result.summary()}"
