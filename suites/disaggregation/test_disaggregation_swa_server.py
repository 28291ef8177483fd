"""PD disaggregation of a hybrid-SWA model against REAL sglang servers, and the upstream SWA read bug.

Model: ``tiny-mellum-swa`` (random weights, built locally): layers ``[full, sliding×3]``,
``sliding_window=64``, served with ``--page-size 64``, so sglang runs its hybrid-SWA path (SWAKVPool,
FULL+SWA radix cache, and on decode the SWA tail prealloc ``alloc_extend_swa_tail``).

1. The upstream bug (sglang 0.5.23, torch-native attention backend): SWA layers are written at the
   translated SWA slot but read with full-pool indices. :func:`test_unpatched_plain_server_is_consistent`
   asks a plain server *without that patch* for consistency, a strict xfail whose condition is the bug's
   exact symptom (the same prompt gives different tokens once full and SWA indices diverged, or a
   request whose full indices pass the SWA pool's size crashes the server). It XPASSes — and so
   fails — when upstream fixes the bug: then drop the compat patch ``torch-native-swa-read``
   (``harness/engines/server/patches.py``).
2. With the patch (the ``cpu`` topology's default), a plain server is consistent, and PD via the
   router equals it over prompt lengths around the page/window boundaries, repeats and concurrency;
   the decode ledger holds the SWA invariants, derived by the checker from the probe's config event
   (the server's window, page, radix flag and sglang's default eviction interval): the tail keeps the
   window and at most a page more, the floor is fill - tail and page-aligned, charges are whole pages,
   decode keeps the window and evicts within the interval (the floor sglang records and the positions
   each eviction really freed, as the probe read them), every page is returned.
"""

from __future__ import annotations

import concurrent.futures
import functools

import pytest
import requests

from harness.api import (
    CPU_COMPAT_PATCHES,
    ServerClient,
    ServerHTTPError,
    expect,
    ledger,
    prompt_ids,
    reset_server,
    wait_for,
)

#: ``n`` deterministic token ids (this suite's expectations were written with this salt).
prompt = functools.partial(prompt_ids, salt=100_003)


MODEL = "tiny-mellum-swa"
PAGE = WINDOW = 64

# est_time: a test on started servers; the first tests also pay server starts (60-240 s each).
# CI runs it on cpu; on a 2×GPU box: --topology 2-gpu-h100 --model tiny-mellum-swa=PATH (page 64 there too).
pytestmark = [
    pytest.mark.engine(
        "sglang-server", models=(MODEL,), gpu_topologies=("2-gpu-h100",), server_args=("--page-size", str(PAGE))
    ),
    pytest.mark.topology("cpu"),
    pytest.mark.est_time(30),
    pytest.mark.timeout(900),
]
#: The window sglang's scheduler uses: Mellum's ``sliding_window - 1`` (the current token is not counted).
SGLANG_WINDOW = WINDOW - 1
#: sglang 0.5.23's default SGLANG_SWA_EVICTION_INTERVAL: decode evicts once this many tokens slid out.
SWA_EVICTION_INTERVAL = 128
MAX_NEW = 16
PROMPT_LENS = (20, 63, 64, 65, 129, 300, 1000, 3000)
SWA_PATCH = "torch-native-swa-read"
#: The CPU recipe's compat patches without the SWA read fix: upstream's torch-native backend as it is.
WITHOUT_SWA_PATCH = tuple(p for p in CPU_COMPAT_PATCHES if p != SWA_PATCH)


#: Prompts between the two passes of prompt A. Both allocators hand out pages last-freed-first, so full and
#: SWA indices match until SWA pages are freed alone: sglang 0.5.18+ frees a request's out-of-window SWA
#: pages right after its prefill (``SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS``, default on),
#: 0.5.16/0.5.17 only between prefill chunks or by decode's eviction (default off), so short prompts stay in step
#: there and hide the bug. These prompts' full KV stays cached (about 7.2k tokens, past the SWA pool's 6528
#: under the CPU recipe's ``--max-total-tokens 8192``): later full indices exceed every SWA index, which
#: no release can line up (an unpatched read runs off the SWA buffer).
CHURN = (3000, 3000, 1000)


def repeat_after_churn(client: ServerClient) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Greedy tokens of prompt A on a fresh server, then again after churn moved the full pool's indices
    past the SWA pool's size (A's new tail lands there)."""
    a = prompt(300, seed=1)
    first = client.generate(a, MAX_NEW).output_ids
    for i, n in enumerate(CHURN):
        client.generate(prompt(n, seed=10 + i), MAX_NEW)
    return first, client.generate(a, MAX_NEW).output_ids


class TorchNativeSwaReadBug(AssertionError):
    """The upstream bug's symptom: the same prompt diverges once SWA pages were reused, or a long one crashes."""


@pytest.mark.engine("sglang-server", models=(MODEL,))  # no gpu_topologies: the bug is in the CPU (torch-native) backend
@pytest.mark.xfail(
    strict=True,
    raises=TorchNativeSwaReadBug,
    reason=f"sglang's torch-native backend (0.5.16 to 0.5.23) reads SWA layers with full-pool indices; XPASS once "
    f"upstream fixes it: then drop compat patch {SWA_PATCH!r} and this xfail",
)
def test_unpatched_plain_server_is_consistent(sglang_servers):
    """Without the SWA read patch (the CPU recipe's other patches stay: they do not touch attention),
    the same prompt must give the same tokens after churn, and a long prompt must not crash."""
    server = sglang_servers.plain(MODEL, compat_patches=WITHOUT_SWA_PATCH, watch=False)
    client = ServerClient(server.url("http"))
    symptom = ""
    try:
        first, again = repeat_after_churn(client)
        if first != again:
            symptom = f"second pass diverged: {first} then {again}"
        else:
            client.generate(prompt(2000, seed=99), MAX_NEW)
    except (ServerHTTPError, requests.RequestException) as e:
        symptom = f"request failed: {e!r}"
    if not symptom and server.poll():
        symptom = f"server died: {server.poll()}"
    sglang_servers.forget_plain(MODEL, compat_patches=WITHOUT_SWA_PATCH)
    if symptom:
        raise TorchNativeSwaReadBug(symptom)


@pytest.fixture
def plain(request, sglang_servers):
    # The baseline starts together with the PD stack the tests after the first need: one start, not two
    # in a row; a session of plain-server tests alone (a fault or check run) starts the baseline only.
    if any(
        "stack" in getattr(item, "fixturenames", ()) for item in request.session.items if item.module is request.module
    ):
        sglang_servers.pd(MODEL, with_plain=True)
    return ServerClient(sglang_servers.plain(MODEL).url("http"))


@pytest.fixture
def stack(sglang_servers):
    # The plain baseline starts with the stack: every test after the first compares against it.
    return sglang_servers.pd(MODEL, with_plain=True)


def test_patched_plain_server_is_consistent(plain):
    first, again = repeat_after_churn(plain)
    assert first == again


@pytest.mark.parametrize("n", PROMPT_LENS)
def test_pd_greedy_matches_plain(stack, plain, n):
    ids = prompt(n, seed=2)
    want = plain.generate(ids, MAX_NEW).output_ids
    got = stack.client("router").generate(ids, MAX_NEW).output_ids
    assert got == want, f"prompt of {n} tokens: PD {got} != plain {want}"


def test_repeats_and_concurrency_match_plain(stack, plain):
    router = stack.client("router")
    base = prompt(4 * PAGE + 3, seed=3)
    seq = [base, base, base[: 2 * PAGE] + prompt(70, seed=4)]
    assert [router.generate(p, MAX_NEW).output_ids for p in seq] == [plain.generate(p, MAX_NEW).output_ids for p in seq]
    prompts = [prompt(n, seed=20 + i) for i, n in enumerate((30, 64, 65, 128, 200, 333, 500, 90))]
    want = [plain.generate(p, MAX_NEW).output_ids for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: router.generate(p, MAX_NEW).output_ids, prompts))
    assert got == want


#: A prompt and a decode length that carry PD decode through one SWA eviction and the 63 steps whose window
#: reads the page it must keep. Prompt 100: prealloc floor 0; at seq 192 (floor + window + sglang's interval
#: 128) decode evicts to 128 and tokens 93 to 155 read [129, 192); its next eviction (seq 320) is never
#: reached. The plain baseline (radix cache on) evicts at the same step to 64: it keeps max(window, page)
#: rounded up, so a page freed past its floor is below its window and its output stays the reference.
EVICT_PROMPT, EVICT_NEW = 100, 160
#: A request decoding beside it that outlives it and never evicts (seq at most 184 < 192).
HOLD_PROMPT, HOLD_NEW = 4, 180


def test_decode_through_an_swa_eviction_matches_plain(stack, plain, run_dir):
    """Greedy output through a decode-time SWA eviction equals the plain server's, token for token: the
    bytes the window's attention read. A window page freed early (``swa-evict-frees-window``) loses its
    full->SWA mapping, so the next 63 tokens read the padding slot, and the output diverges at token 93.

    The holder joins once decode preallocated the request and outlives it: that release then never
    leaves the SWA pool empty. (Under that fault the release frees the padding page its cleared row
    names; with nothing else held, sglang's bare assert ``available <= size`` stops the decode in the
    step that answers, which can beat the answer out.)"""
    path = run_dir.ledger / f"{stack.decode.name}.jsonl"
    ids = prompt(EVICT_PROMPT, seed=33)
    want = plain.generate(ids, EVICT_NEW).output_ids
    seen = len(ledger.read(path)) if path.exists() else 0
    router = stack.client("router")
    pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="window")
    try:
        probe = pool.submit(router.generate, ids, EVICT_NEW)

        def preallocated() -> bool:
            return any(e.kind == "prealloc" and e.fill_len == EVICT_PROMPT for e in ledger.read(path)[seen:])

        wait_for(lambda: probe.done() or preallocated(), 120, "decode preallocating the request")
        holder = pool.submit(router.generate, prompt(HOLD_PROMPT, seed=34), HOLD_NEW)
        got = probe.result().output_ids
        evicts = [e for e in ledger.read(path)[seen:] if e.kind == "evict" and e.pages.get("swa")]
        assert evicts, f"decode never evicted SWA pages in {EVICT_NEW} new tokens: the test missed its point"
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            where = ", ".join(f"seq {e.fill_len} floor {e.evicted_seqlen}" for e in evicts)
            raise AssertionError(
                f"WindowParity: PD output diverged from the plain server at new token {at} "
                f"(seq {EVICT_PROMPT + at}) after decode's SWA eviction ({where}): "
                f"PD {got[at : at + 4]} != plain {want[at : at + 4]}"
            )
        assert len(holder.result().output_ids) == HOLD_NEW
    finally:
        pool.shutdown(wait=False)


def test_decode_ledger_holds_swa_invariants(sglang_servers, run_dir):
    # No plain baseline needed: in a session of this test alone (a fault or check run) none starts.
    stack = sglang_servers.pd(MODEL)
    # 256 new tokens: more than the eviction interval past the window, so decode evicts SWA pages.
    # A short request first: its release on either server is followed by the long request's busy
    # steps (sglang's busy memory check runs after each), not only by idle ones.
    router = stack.client("router")
    router.generate(prompt(100, seed=31), 4)
    router.generate(prompt(400, seed=30), 256)
    path = run_dir.ledger / f"{stack.decode.name}.jsonl"

    def settled() -> list:
        # The answer can reach the client before decode's scheduler has released the request (a loaded
        # machine showed one such page-leak): judge the books once every preallocated request is released.
        evs = ledger.read(path)
        return (
            evs if {e.rid for e in evs if e.kind == "prealloc"} <= {e.rid for e in evs if e.kind == "release"} else []
        )

    try:
        events = wait_for(settled, 60, "decode releasing every request it preallocated")
    except TimeoutError:
        events = ledger.read(path)  # a release that never comes: the checker below names the leak
    configs = [e for e in events if e.kind == "config"]
    assert configs, "the probe wrote no config event: the checker has no bound to derive"
    config = ledger.LedgerConfig.from_dict(configs[-1].config)
    expect(
        "the decode server's ledger config",
        window=(config.window, SGLANG_WINDOW),
        page_size=(config.page_size, PAGE),
        swa_tail=(config.swa_tail, True),
    )
    assert config.eviction_interval == SWA_EVICTION_INTERVAL, "the servers run sglang's default interval"
    pre = [e for e in events if e.kind == "prealloc" and e.fill_len and e.fill_len > WINDOW + PAGE]
    assert pre, "no prealloc longer than a window in the decode ledger"
    assert all(len(e.pages["swa"]) < len(e.pages["full"]) for e in pre), "SWA tail not smaller than the full KV"
    evicts = [e for e in events if e.kind == "evict" and e.pages.get("swa")]
    assert evicts, "decode never evicted SWA pages while decoding"
    # The window rule judges the positions each eviction really freed: the probe must have read them.
    assert all(e.freed_spans for e in evicts), "an eviction freed SWA pages but the probe read no freed position"
    ledger.assert_clean(ledger.check(events), "of the decode server")
    # Both servers back at their baseline, by their probes' flush (prefill's ledger holds only that).
    for w in (stack.prefill, stack.decode):
        reset_server(w, run_dir.ledger / f"{w.name}.jsonl")
