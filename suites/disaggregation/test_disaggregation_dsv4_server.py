"""DeepSeek-V4 class PD on 8×H200 against REAL sglang servers: TP4 prefill + TP4 decode + router.

The real-engine counterpart of ``test_disaggregation_dsv4.py``: the ``8-gpu-h200`` topology's prefill
and decode roles (each ``--tp 4 --enable-dp-attention --dp-size 4``, i.e. attention-DP 4 inside one
TP4 group, one server process on 4 GPUs) and its router, launched by the harness's launcher; sglang
picks page 256 for DeepSeek-V4. HiSparse on the decode side off and on
(:data:`~harness.engines.server.launcher.HISPARSE_DECODE_ARGS`). Greedy requests at prompt
lengths around the page-256 boundaries must give the same tokens on a repeat and the same tokens as
a plain (non-PD) TP4 server of the same model; the decode server's accounting probe ledger must hold
the conservation invariants; both servers are healthy and back to idle afterwards, and no server
process is left once a stack is stopped.

The plain server cannot run beside the PD stack (the stack holds all 8 GPUs): it runs on the prefill
group's GPUs after the stack stopped (``sglang_servers.plain`` does that on this topology), once for
the module; its answers are the baseline of both HiSparse variants.

Needs 8 real H200s and the model as a local directory (never downloaded)::

    pytest suites/disaggregation/test_disaggregation_dsv4_server.py --topology 8-gpu-h200 --model dsv4=PATH

(or ``HARNESS_MODEL_DSV4=PATH``). Anywhere else every test is skipped saying so.
"""

from __future__ import annotations

import functools
import time

import pytest

from harness.api import HISPARSE_DECODE_ARGS, expect, ledger, prompt_ids


MODEL = "dsv4"
# est_time: the module: three DeepSeek-V4 server starts (PD off, plain, PD on; minutes each) and the requests.
pytestmark = [
    pytest.mark.engine("sglang-server", models=(MODEL,)),
    pytest.mark.topology("8-gpu-h200"),
    pytest.mark.est_time(1500),
    pytest.mark.timeout(3600),
]

PAGE = 256  # sglang's page size for DeepSeek-V4 on CUDA
TP = ATTN_DP = 4
MAX_NEW = 8
#: Around one, two and three pages of 256, and longer prompts.
PROMPT_LENS = (1, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE - 1, 2 * PAGE, 2 * PAGE + 1, 3 * PAGE + 1, 1000, 4000)
#: Token ids drawn from here: ordinary tokens of DeepSeek's vocabulary, clear of the special ones.
TOKEN_RANGE = (1000, 100_000)
#: ``n`` deterministic token ids.
prompt = functools.partial(prompt_ids, salt=100_003, vocab=TOKEN_RANGE)


PROMPTS = {n: prompt(n, seed=1) for n in PROMPT_LENS}


@pytest.fixture(scope="module", params=[False, True], ids=["hisparse-off", "hisparse-on"])
def hisparse(request) -> bool:
    # Module scope: pytest runs every test of one variant before the other, so each stack starts once.
    return request.param


@pytest.fixture
def decode_args(hisparse):
    return {"decode": HISPARSE_DECODE_ARGS} if hisparse else None


@pytest.fixture
def stack(sglang_servers, decode_args):
    return sglang_servers.pd(MODEL, extra_args=decode_args)


@pytest.fixture(scope="module")
def baseline() -> dict[int, tuple[int, ...]]:
    """Plain-server answers per prompt length, filled by the first parity test (the same for both variants)."""
    return {}


def test_stack_ready_as_launched(stack, hisparse):
    workers = stack.client("router").workers()
    assert sorted(w.get("worker_type") for w in workers) == ["decode", "prefill"], workers
    assert all(w.get("is_healthy") for w in workers), workers
    for role in ("prefill", "decode"):
        info = stack.client(role).server_info()
        assert info.get("disaggregation_mode") == role, info.get("disaggregation_mode")
        expect(
            f"{role} server info", tp_size=(info.get("tp_size"), TP), attn_dp_size=(info.get("attn_dp_size"), ATTN_DP)
        )
        assert info.get("page_size") == PAGE, info.get("page_size")
        assert bool(info.get("enable_hisparse")) == (hisparse and role == "decode"), info.get("enable_hisparse")


def test_greedy_around_page_boundaries_is_deterministic(stack):
    router = stack.client("router")
    for n, ids in PROMPTS.items():
        first = router.generate(ids, MAX_NEW).output_ids
        again = router.generate(ids, MAX_NEW).output_ids
        assert len(first) == MAX_NEW, f"prompt of {n} tokens: {len(first)} tokens back"
        assert first == again, f"prompt of {n} tokens: {first} then {again}"


def test_probe_ledger_holds_invariants(stack, run_dir):
    stack.client("router").generate(prompt(3 * PAGE + 7, seed=2), MAX_NEW)
    path = run_dir.ledger / f"{stack.decode.name}.jsonl"
    assert path.exists(), f"the decode server wrote no ledger ({path}); is the probe installed?"
    events = ledger.read(path)
    assert {"prealloc", "release"} <= {e.kind for e in events}, {e.kind for e in events}
    assert all(e.component == "decode" and e.worker == stack.decode.name for e in events)
    preallocs = [e for e in events if e.kind == "prealloc"]
    assert all(e.page_size == PAGE and e.fill_len and e.pages.get("full") for e in preallocs), preallocs[:3]
    ledger.assert_clean(ledger.check(events), "of the decode server")


def test_health_and_idle_pools_back_to_baseline(stack):
    idle = {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0}
    stack.client("router").generate(prompt(2 * PAGE + 3, seed=3), MAX_NEW)
    for role in ("prefill", "decode"):
        c = stack.client(role)
        assert c.health(), f"{role} /health after the workload"
        c.flush_cache()

        def busy() -> list[dict]:
            return [load for load in c.loads() if {k: load.get(k) for k in idle} != idle]

        deadline = time.monotonic() + 60
        while busy() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not busy(), f"{role} DP ranks not back to baseline: {busy()}"


def test_pd_matches_plain_server_and_stops_clean(sglang_servers, stack, decode_args, baseline):
    from harness.api import ServerClient, leftover_processes

    router = stack.client("router")
    got = {n: router.generate(ids, MAX_NEW).output_ids for n, ids in PROMPTS.items()}
    pids = stack.payload_pids()
    if baseline:
        sglang_servers.forget(MODEL, decode_args)
    else:
        # No GPU is left beside the stack: this stops it and starts the plain server on the prefill GPUs.
        plain = ServerClient(sglang_servers.plain(MODEL).url("http"))
        baseline.update({n: plain.generate(ids, MAX_NEW).output_ids for n, ids in PROMPTS.items()})
    assert leftover_processes(pids) == [], "PD server processes left after the stack was stopped"
    diff = {n: (got[n], baseline[n]) for n in PROMPTS if got[n] != baseline[n]}
    assert not diff, f"PD != plain for prompt lengths {sorted(diff)}: {diff}"
