"""Heterogeneous PD on REAL sglang servers: prefill TP 1, decode TP 2, on CPU (``cpu-tp1-tp2``).

The real-engine twin of ``test_disaggregation_hetero_tp.py``. ``tiny-llama`` has 2 KV heads: each of decode's
two TP ranks owns one and must receive exactly that head's slice of the one prefill rank's KV, over
mooncake (TCP on loopback), through sglang's own unequal-TP transfer path. A rank that got the other head,
or the whole KV at the wrong offset, attends over the wrong keys and values: its greedy tokens leave a
plain server's. So the check is end to end: for prompts around a page, repeated and concurrent, the PD
stack's greedy tokens equal those of a plain (non-PD) server of the decode shape (TP 2) and of TP 1 (the
prefill shape); each decode rank's process ran; both servers are back at their idle baseline.

On CPU sglang 0.5.23 runs a TP 2 server only with the harness's compat patch ``cpu-tp-without-pynccl`` (its
TP group otherwise builds a PyNccl communicator on the CPU device and dies: ``Expected a cuda device, but got:
cpu``) and with each rank bound to a core (``SGLANG_CPU_OMP_THREADS_BIND``, set by the launcher). DP attention
and TP 4 / TP 8 shapes do not run here: 2 cores, and the DP controller's ranks on CPU were not tried.
The per-head byte check runs on the simulated engine (the twin), where the harness reads each rank's pools.

The catalog fault ``hetero-head-slice-first-only`` (every decode rank takes prefill's first head slice) fails
the greedy tests here (decode rank 1 attends over head 0's KV); ``hetero-gqa-head-modulo`` and
``hetero-rank-map-modulo`` change nothing on this shape (one prefill rank, decode TP equal to the KV heads) and
are caught on the simulated TP 4 / TP 8 shapes. Run: ``rerun-test
suites/disaggregation/test_disaggregation_hetero_tp_server.py`` (its marker picks the topology).
"""

from __future__ import annotations

import concurrent.futures
import functools

import pytest

from harness.api import ServerClient, prompt_ids

prompt = functools.partial(prompt_ids, salt=100_019)

MODEL = "tiny-llama"
PAGE = 64
MAX_NEW = 8

pytestmark = [
    # A stack of its own topology (a TP 2 decode and a TP 2 plain server): about 30 s alone and 25 s of a fresh
    # clone's CI, which has no margin for it; run it by name (rerun-test or pytest on this file).
    pytest.mark.explicit("a stack of its own topology (cpu-tp1-tp2): about 30 s, kept out of ./dev test"),
    pytest.mark.engine("sglang-server", models=(MODEL,), server_args=("--page-size", str(PAGE))),
    pytest.mark.topology("cpu-tp1-tp2"),
    pytest.mark.est_time(60),
    pytest.mark.timeout(900),
]


@pytest.fixture
def stack(sglang_servers):
    return sglang_servers.pd(MODEL, with_plain=True)


@pytest.fixture
def plain(sglang_servers):
    return ServerClient(sglang_servers.plain(MODEL).url("http"))


def test_prefill_runs_tp1_and_decode_tp2(stack):
    sizes = {role: stack.client(role).server_info().get("tp_size") for role in ("prefill", "decode")}
    assert sizes == {"prefill": 1, "decode": 2}, sizes


@pytest.mark.parametrize("n", (20, 63, 64, 65, 300))
def test_each_decode_rank_gets_its_head_and_pd_matches_plain(stack, plain, n):
    ids = prompt(n, seed=1)
    want = plain.generate(ids, MAX_NEW).output_ids
    got = stack.client("router").generate(ids, MAX_NEW).output_ids
    assert len(want) == MAX_NEW and got == want, f"prompt of {n} tokens: PD TP1->TP2 {got} != plain TP2 {want}"


def test_concurrent_and_repeated_prompts_match_plain(stack, plain):
    prompts = [prompt(n, seed=10 + i) for i, n in enumerate((30, 64, 129, 200, 65, 400))]
    prompts.append(prompts[2])  # a prefix hit on prefill: the cached pages are sliced the same way
    want = [plain.generate(p, MAX_NEW).output_ids for p in prompts]
    router = stack.client("router")
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: router.generate(p, MAX_NEW).output_ids, prompts))
    assert got == want


def test_both_servers_are_back_at_their_idle_baseline(stack):
    stack.client("router").generate(prompt(300, seed=30), MAX_NEW)
    for role in ("prefill", "decode"):
        client = stack.client(role)
        client.flush_cache()
        for load in client.loads():
            idle = {k: load[k] for k in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens")}
            assert idle == {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0}, (role, load)
