"""Failure paths of PD disaggregation on REAL sglang servers: what aborts, failed transfers, dead peers,
probes and hostile input leave behind on the servers that survive them.

A duplicate ``bootstrap_room`` is a strict xfail of sglang 0.5.23's own behaviour (the first request
is never answered once a second reuses its room, aborting both then frees every page; or, on a loaded
machine, prefill's scheduler dies of it and decode frees what it held): it XPASSes, and so fails, once
upstream refuses the duplicate or serves both.

The SWA / PD leaks sglang shipped live on these paths (decode-side leaks after failed or aborted
transfers, sgl#6258 / #9817 / #7130; health requests pinning KV, sgl#28652; a duplicate
``bootstrap_room`` crashing both schedulers, sgl#40125). Each test first reaches its phase
deterministically and proves, from the probe's ledger, that the hazard happened there:

* a request is *held* before prefill sends its KV (``hold``: prefill has computed and holds the KV,
  decode has preallocated its pages — the ledger's ``prealloc`` — and nothing was sent yet);
* a request is *mid-decode* once the decode ledger shows it evicting SWA pages that slid out of its
  window (at least one eviction interval decoded);
* a transfer has *timed out* once decode released the held request with sglang's own abort message
  ("timed out ... in KVPoll.WaitingForInput"), which the probe records with the release.

Then it checks, through the servers' probes and the ledger — never sglang's own counters — that every
pool of every surviving server is back at its baseline within :data:`RESET_S` (:func:`reset_server`:
sglang's ``/flush_cache``, the probe's ``reset`` event, the whole ledger checked: ``page-leak``,
``reset-leak``, ``not-baseline``, ...), and that the stack still serves a clean request, or, where a
server was killed, is replaced (the next test starts a fresh one; the JUnit property
``stack_replaced`` says so).

Model: ``tiny-mellum-swa`` (hybrid SWA, window and page 64), the servers of
``test_disaggregation_swa_server.py`` (same model and flags: one stack for both in a session). On a
GPU box: ``--topology 2-gpu-h100 --model tiny-mellum-swa=PATH``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import random
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import pytest
import requests

from harness.api import (
    EnvSwitch,
    ResetError,
    ServerHTTPError,
    WorkerDied,
    finish_reason,
    ledger,
    new_rid,
    phases,
    prompt_ids,
    reset_server,
    stalls,
    wait_for,
)

MODEL = "tiny-mellum-swa"
PAGE = 64

pytestmark = [
    pytest.mark.engine(
        "sglang-server", models=(MODEL,), gpu_topologies=("2-gpu-h100",), server_args=("--page-size", str(PAGE))
    ),
    pytest.mark.topology("cpu"),
    pytest.mark.est_time(15),
    pytest.mark.timeout(900),
]

#: Seconds a surviving server has to be back at its baseline after the failure (a dead peer is
#: noticed through mooncake's heartbeat: a few seconds; aborted transfers drain at once).
RESET_S = 90.0
#: Seconds to wait for a phase to show in the ledger (a request reaching it on a loaded machine).
PHASE_S = 120.0
#: Seconds decode has to release a failed or aborted transfer's pages (on CPU: a missed 1 s heartbeat,
#: then at most the 5 s deferred-release wait, launcher.CPU_ENV; loopback acknowledges at once).
RELEASE_S = 30.0
#: Seconds past decode's deferred-release timeout (``PdStack.deferred_release_s``) that a release may
#: still take once decode answered the request it gave up: a scheduler pass or two on a loaded runner
#: (well under one), with room to spare: 5 s was too little on a loaded runner (a fresh-clone CI run
#: saw decode release a dead prefill's transfer more than 10 s after answering). A fault that skips
#: the release waits all of it out.
RELEASE_MARGIN_S = 10.0
#: Seconds between looks at a ledger or a hold while waiting for a phase.
POLL_S = 0.05


@pytest.fixture
def stack(sglang_servers):
    return sglang_servers.pd(MODEL)


class Ledger:
    """The probe's ledger of one server, read as it grows."""

    def __init__(self, run_dir, worker):
        self.path = Path(run_dir.ledger) / f"{worker.name}.jsonl"

    def events(self, rid: str | None = None, kind: str | None = None) -> list:
        evs = ledger.read(self.path) if self.path.exists() else []
        return [e for e in evs if (rid is None or e.rid == rid) and (kind is None or e.kind == kind)]

    def wait(self, what: str, rid: str, kind: str, timeout_s: float = PHASE_S) -> list:
        """The events of ``rid`` of ``kind``, once there is one (else the test fails naming ``what``)."""
        return wait_for(
            lambda: self.events(rid, kind),
            timeout_s,
            f"{what} (a {kind} event of {rid} in {self.path.name})",
            interval=POLL_S,
        )

    def released(
        self, what: str, rid: str, *, answered: concurrent.futures.Future, grace_s: float, timeout_s: float = RELEASE_S
    ) -> list:
        """The release of ``rid``, once written; if it never comes, the ledger's own verdict fails
        the test (``page-leak``: the pages it preallocated were never freed). ``answered``: decode's
        answer to the request's client; the wait also ends ``grace_s`` (:func:`release_grace`) after
        that answer came (decode answers a request it gave up, and releases its pages at once or,
        deferred, within its deferred-release timeout)."""
        answered_at: float | None = None

        def release() -> list:
            nonlocal answered_at
            got = self.events(rid, "release")
            if got or not answered.done():
                return got
            answered_at = answered_at or time.monotonic()
            if time.monotonic() - answered_at > grace_s:
                raise TimeoutError(f"{what}: decode answered the request {grace_s:g} s ago and still holds its pages")
            return got

        try:
            return wait_for(release, timeout_s, what, interval=POLL_S)
        except TimeoutError:
            # Answered, the request finished: the pages it still holds are a leak, not a request in flight.
            finished = [rid] if answered.done() else []
            ledger.assert_clean(
                ledger.check(self.events(), finished=finished), f"of {self.path.stem}: {what} never came"
            )
        pytest.fail(
            f"{what}: no release of {rid} in {self.path.name} within {timeout_s:g} s, and the ledger "
            "sees nothing wrong (was it ever preallocated?)"
        )


def release_grace(stack) -> float:
    """Seconds decode may take to release a request's pages after answering it as failed or aborted."""
    return stack.deferred_release_s + RELEASE_MARGIN_S


def wait_until(what: str, ok: Callable[[], bool], timeout_s: float = PHASE_S) -> None:
    wait_for(ok, timeout_s, what, interval=POLL_S)


def in_background(fn: Callable[[], Any]) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="client")
    try:
        return pool.submit(fn)
    finally:
        pool.shutdown(wait=False)


def outcome(future: concurrent.futures.Future, timeout_s: float = PHASE_S) -> Any:
    """What the client got: a Generation, or the HTTP error / connection error it raised."""
    try:
        return future.result(timeout=timeout_s)
    except (ServerHTTPError, requests.RequestException) as e:
        return e


def decoded_before(decode: Ledger, rid: str, release) -> bool:
    """Whether ``rid`` gained decode pages before ``release`` (its first release; a retry of the
    same rid by the router may decode later)."""
    return any(e.seq < release.seq for e in decode.events(rid, "decode_alloc"))


def direct(
    stack, ids: list[int], max_new: int, rid: str, *, room: int | None = None, timeout_s: float = PHASE_S
) -> tuple[concurrent.futures.Future, concurrent.futures.Future]:
    """One PD request sent to prefill and decode directly, without the router's retries (a retry would
    bring the request back under the same rid): the clients' futures, prefill's then decode's."""
    return stack.direct(ids, max_new, rid, room=room, timeout_s=timeout_s)


class InFlight(NamedTuple):
    rid: str
    to_prefill: concurrent.futures.Future
    to_decode: concurrent.futures.Future
    decode: Ledger


@contextlib.contextmanager
def in_flight(stack, run_dir, what: str, seed: int) -> Iterator[InFlight]:
    """A request with its KV in flight, proven: prefill computed it and holds the KV unsent (its hold),
    decode preallocated its pages (its ledger). Sent to the servers directly (:func:`direct`); the hold
    is released on leaving, so prefill's send goes on into whatever the test did meanwhile."""
    rid = new_rid(what)
    decode = Ledger(run_dir, stack.decode)
    gate = phases.Hold(run_dir.ledger, "prefill.send", rid)
    try:
        to_prefill, to_decode = direct(stack, prompt_ids(200, seed=seed), 8, rid)
        gate.reached(PHASE_S)
        decode.wait("decode's prealloc", rid, "prealloc")
        yield InFlight(rid, to_prefill, to_decode, decode)
    finally:
        gate.release()


def back_at_baseline(run_dir, *servers) -> None:
    """Each server drains, flushes, and its whole ledger balances (``reset_server``), within RESET_S."""
    for w in servers:
        reset_server(w, Path(run_dir.ledger) / f"{w.name}.jsonl", timeout_s=RESET_S)


def serves(stack) -> None:
    got = stack.client("router").generate(prompt_ids(150, seed=99), 4)
    assert len(got.output_ids) == 4, got


# ------------------------------------------------------------------ a decode pool that admission must ration

#: Decode's full pool on the tight stack (sglang sizes its SWA pool from it) and its decode reserve
#: (sglang's default: 512): a 300-token request's admission charges 320 + 128 full tokens, so two fit
#: and the rest must wait. A small pool makes the retraction below come after a few hundred decode
#: steps, not a thousand.
TIGHT_DECODE_TOKENS, TIGHT_DECODE_RESERVE = 1024, 128
#: Requests sent at once to the tight stack.
PRESSURE_REQUESTS = 6


#: Decode's ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (sglang's default: 300 s) for the one transfer that must
#: time out: how long decode waits, once it sent prefill the pages to write, for the transfer to complete.
#: sglang reads it once, at the server's start; the harness's switch (``EnvSwitch``, engines/server/env_switch.py)
#: sets this decode server's copy at each poll, so only this test's window has it short, and every other transfer
#: keeps sglang's 300 s (the stack once started with 20 s for all: on a loaded runner, long enough for
#: the tight tests' own transfers, and a 20 s wait this test paid in full).
TRANSFER_TIMEOUT_S = 2
TIMEOUT_VAR = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"


#: The tight stack's own flags (decode's only).
TIGHT = {
    "extra_args": {
        "decode": (
            "--max-total-tokens",
            str(TIGHT_DECODE_TOKENS),
            "--num-reserved-decode-tokens",
            str(TIGHT_DECODE_RESERVE),
        )
    },
}


@pytest.fixture
def tight(sglang_servers):
    return sglang_servers.pd(MODEL, **TIGHT)


def test_admission_rations_a_tight_decode_pool_and_charges_whole_pages(tight, run_dir):
    # Admission, not the allocator, decides: more requests arrive than decode's pool can reserve for,
    # so some wait in the prealloc queue until others release. The probe records what admission charged
    # each request (sglang's _prealloc_required_tokens); the ledger holds it against the whole pages the
    # prealloc then took (reserve-short) and every page against its release.
    rids = [new_rid(f"pressure-{i}") for i in range(PRESSURE_REQUESTS)]
    decode = Ledger(run_dir, tight.decode)
    with concurrent.futures.ThreadPoolExecutor(PRESSURE_REQUESTS) as pool:
        answers = list(
            pool.map(
                lambda i: tight.client("router").generate(
                    prompt_ids(300, seed=20 + i), 8, extra={"rid": rids[i]}, timeout_s=PHASE_S
                ),
                range(PRESSURE_REQUESTS),
            )
        )
    assert all(len(a.output_ids) == 8 for a in answers), [len(a.output_ids) for a in answers]
    mine = [e for e in decode.events() if e.rid in rids and e.kind in ("prealloc", "release")]
    preallocs = [e for e in mine if e.kind == "prealloc"]
    assert {e.rid for e in preallocs} == set(rids), "a request was never preallocated on decode"
    for e in preallocs:  # what admission charged, recorded by the probe for the ledger's reserve rule
        assert set(e.reserved) == {"full", "swa"} and e.reserved["full"] > int(e.fill_len or 0), e
    # The hazard, proven in the ledger's order: never all of them held at once, and some preallocated
    # only after another request gave its pages back (they waited in the prealloc queue).
    held, most = set(), 0
    for e in mine:
        (held.add if e.kind == "prealloc" else held.discard)(e.rid)
        most = max(most, len(held))
    first_release = min(e.seq for e in mine if e.kind == "release")
    waited = [e.rid for e in preallocs if e.seq > first_release]
    assert most < PRESSURE_REQUESTS and waited, (
        f"admission never held a request back: {most} of {PRESSURE_REQUESTS} preallocated at once"
    )
    back_at_baseline(run_dir, tight.decode, tight.prefill)
    serves(tight)


#: Prompt and new tokens of each request of the retraction test: admission lets two in together (it
#: keeps room for one request's whole growth, and for each the decode reserve), but both grown (100 +
#: 500 tokens each) outgrow the tight pool's 1024, so decode must retract one; one alone fits.
RETRACT_PROMPT, RETRACT_NEW = 100, 500


def test_retraction_under_decode_pool_pressure_resumes_and_leaves_no_kv(tight, run_dir):
    # Two requests admitted together outgrow decode's pool while they decode: sglang retracts one
    # (its KV backed up, its pages released), resumes it once the other finished (prealloc again, the
    # backup restored: resume_retracted_reqs, the path of sgl#40309), and every page comes back.
    # Not asserted: greedy parity with the prompt served alone. Two requests decoded together diverge from
    # the same prompts served alone on this CPU stack with no retraction at all (token 286 of request 0),
    # and not from SWA eviction (the same with decode's eviction off, and on a plain server): there the
    # tiny random model's two best tokens tie exactly in bf16 when served alone, and the batch's numerics
    # (one bf16 step, 0.004 in logprob) break the tie the other way. Parity would not isolate the resume.
    #
    # The two must decode together, which timing alone does not give on a loaded machine (the second came
    # so late that the first finished before the pool ran short). Holds line them up, none of them in a
    # thread the other request needs: (1) prefill holds the first before its KV send until decode has
    # preallocated the second; (2) decode's scheduler holds the first, transferred, until the second's KV
    # has landed too (its Success is written by decode's transfer thread, not the scheduler); released,
    # the scheduler commits both, and they decode side by side.
    rids = [new_rid(f"retract-{i}") for i in range(2)]
    decode = Ledger(run_dir, tight.decode)
    router = tight.client("router")
    led = run_dir.ledger
    at_send = phases.Hold(led, "prefill.send", rids[0])
    at_transferred = phases.Hold(led, "decode.transferred", rids[0])
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        answers = [
            pool.submit(
                router.generate,
                prompt_ids(RETRACT_PROMPT, seed=40 + i),
                RETRACT_NEW,
                extra={"rid": rids[i]},
                timeout_s=3 * PHASE_S,
            )
            for i in range(2)
        ]
        at_send.reached(PHASE_S)
        phases.wait_mark(led, "decode.prealloc", rid=rids[1], timeout_s=PHASE_S)
        at_send.release()
        at_transferred.reached(PHASE_S)
        phases.wait_mark(
            led,
            "transfer.status",
            rid=rids[1],
            timeout_s=PHASE_S,
            where=lambda m: m.worker == tight.decode.name and m.note.startswith("wrote, now Success"),
        )
    finally:
        at_send.release()
        at_transferred.release()
        pool.shutdown(wait=False)
    lengths = [len(a.result(timeout=3 * PHASE_S).output_ids) for a in answers]
    assert lengths == [RETRACT_NEW] * 2, lengths
    # The hazard, proven: a request released mid-decode and preallocated again for the rest (retracted,
    # then resumed), its second prealloc charged for what it had decoded.
    retracted = [r for r in rids if len(decode.events(r, "prealloc")) > 1]
    assert retracted, "no request was retracted: the pool never ran short while decoding"
    for r in retracted:
        first, resumed = decode.events(r, "prealloc")[:2]
        released = decode.events(r, "release")[0]
        assert first.seq < released.seq < resumed.seq, f"{r}: not released before its second prealloc"
        assert int(resumed.fill_len or 0) > RETRACT_PROMPT, (
            f"{r} resumed at fill {resumed.fill_len}, not past its prompt"
        )
    back_at_baseline(run_dir, tight.decode, tight.prefill)
    serves(tight)


def test_transfer_timeout_decode_gives_up_and_both_sides_release(tight, run_dir):
    # Prefill holds the request before its KV send for longer than decode waits for a transfer: decode
    # gives it up (sglang's waiting timeout: the receiver fails, pop_transferred aborts the request and
    # releases what it preallocated, the path of sgl#6258 / #9817) and tells prefill, which, once the
    # hold lets it send, finds the transfer aborted and frees its KV too.
    with in_flight(tight, run_dir, "transfer-timeout", seed=7) as req:
        # Once decode's page list is on its way (its status then WaitingForInput, the transfer's clock running),
        # decode's waiting timeout is switched short for this window.
        phases.wait_mark(run_dir.ledger, "decode.metadata", rid=req.rid, timeout_s=PHASE_S)
        with EnvSwitch(run_dir.ledger, TIMEOUT_VAR, str(TRANSFER_TIMEOUT_S), server=tight.decode.name):
            first = req.decode.released(
                "decode giving the transfer up",
                req.rid,
                timeout_s=TRANSFER_TIMEOUT_S + RELEASE_S,
                answered=req.to_decode,
                grace_s=release_grace(tight),
            )[0]
    # The hazard, proven: decode released the request because its transfer timed out (sglang's abort
    # message, recorded with the release), while prefill still held the KV unsent, and never decoded it.
    assert "timed out" in first.note and "WaitingForInput" in first.note, (
        f"decode released {req.rid} for another reason than the transfer timeout: {first.note!r}"
    )
    assert not decoded_before(req.decode, req.rid, first), "the timed-out request decoded"
    answer = outcome(req.to_decode)
    assert isinstance(answer, Exception) or finish_reason(answer) == "abort", f"decode answered {answer}"
    # Prefill, let go, sends into the transfer decode gave up: it fails the request (and frees its KV,
    # which its reset below checks) rather than answering it.
    answer = outcome(req.to_prefill)
    assert isinstance(answer, ServerHTTPError), f"prefill answered {answer} for a transfer decode gave up"
    back_at_baseline(run_dir, tight.decode, tight.prefill)
    serves(tight)


# ------------------------------------------------------------------ an input one side refuses (decode: the tight stack)

#: Seconds the client gives a refused request's answer (a refusal is answered in well under one; beyond
#: this, the stack is waiting on something that will not come, and the test says what).
REFUSAL_ANSWER_S = 5.0
#: The harness's stall bound in the prefill-refusal test (its default: 60 s), for the same reason.
REFUSAL_STALL_S = 5.0


class RefusalNotPassedOn(AssertionError):
    """One side refused a request and the other went on waiting for it."""


@pytest.mark.xfail(
    strict=True,
    raises=RefusalNotPassedOn,
    reason="sglang 0.5.23's PD router (sgl-model-gateway) holds decode's refusal until prefill answers too, and "
    "prefill waits for decode's page list until its bootstrap timeout (300 s): the client hangs (not filed upstream)",
)
def test_an_input_decode_refuses_is_one_error_and_prefill_lets_it_go(tight, run_dir):
    # The tight stack's decode pool (TIGHT_DECODE_TOKENS) is smaller than prefill's, so an input one page
    # longer than it is one decode's scheduler refuses (sglang's validate_input_length) and prefill admits.
    # Through the router, the client must get the refusal at once, decode take nothing for it, and prefill
    # let its half go: both servers idle and at baseline within RESET_S, and the stack still serves.
    rid = new_rid("refused-by-decode")
    ids = prompt_ids(TIGHT_DECODE_TOKENS + PAGE, seed=23)
    try:
        answer: Any = tight.client("router").generate(ids, 2, extra={"rid": rid}, timeout_s=REFUSAL_ANSWER_S)
    except ServerHTTPError as e:
        answer = e
    except requests.Timeout:
        # the client's disconnect reaches prefill through the router: prefill aborts its half
        back_at_baseline(run_dir, tight.decode, tight.prefill)
        refused = tight.decode.tail(200).count("exceeds the maximum allowed length")
        raise RefusalNotPassedOn(
            f"no answer within {REFUSAL_ANSWER_S:g} s for an input decode refused ({refused} refusal line(s) in "
            "decode's log): the router waited for prefill, which waited for decode's page list"
        ) from None
    assert isinstance(answer, ServerHTTPError) and "exceeds the maximum allowed length" in str(answer), answer
    assert not Ledger(run_dir, tight.decode).events(rid, "prealloc"), "decode preallocated an input it refused"
    back_at_baseline(run_dir, tight.decode, tight.prefill)
    serves(tight)


def test_decode_killed_while_prefill_holds_kv_prefill_releases(sglang_servers, tight, run_dir, record_property):
    # The tight stack's last test: its prefill runs with the shared stack's flags (only decode's differ,
    # and decode is what dies), so the kill spends that stack rather than a fresh one.
    stack = tight
    try:
        with in_flight(stack, run_dir, "decode-killed", seed=5) as req:
            # Still watched: the harness must fail this test fast, naming decode with its log tail
            # (raised into the wait below), not leave it waiting on a stack that lost a server.
            with pytest.raises(WorkerDied) as exc:
                killed_at = time.monotonic()
                os.kill(stack.decode.info.payload_pid, signal.SIGKILL)
                wait_until("the harness raising decode's death into the test", lambda: False, timeout_s=60)
            died = exc.value
            record_property("decode_kill_to_worker_died_s", round(time.monotonic() - killed_at, 3))
            assert died.name == stack.decode.name and "killed by SIGKILL" in died.cause, died
            assert died.tail.strip(), "WorkerDied carries no log tail"
        # Released: prefill now sends to a dead decode; its transfer must fail and free the KV.
        answer = outcome(req.to_prefill)
        assert isinstance(answer, Exception) or finish_reason(answer) == "abort", (
            f"prefill answered {answer} for a request whose decode died"
        )
        back_at_baseline(run_dir, stack.prefill)
    finally:
        record_property("stack_replaced", "decode killed: the tight stack is spent")
        sglang_servers.forget(MODEL, **TIGHT)


# ------------------------------------------------------------------ the stack survives these


def test_abort_mid_decode_frees_every_page(stack, run_dir):
    rid = new_rid("abort-decode")
    decode = Ledger(run_dir, stack.decode)
    request = in_background(lambda: stack.client("router").generate(prompt_ids(300, seed=1), 3000, extra={"rid": rid}))
    # Mid-decode, proven: decode already slid SWA pages out of the window for this request.
    decode.wait("decoding past the window", rid, "evict")
    stack.client("decode").abort(rid)
    result = outcome(request)
    if not isinstance(result, Exception):
        assert finish_reason(result) == "abort" or len(result.output_ids) < 3000, "the abort did not stop the decode"
    released = decode.released("the aborted request's release", rid, answered=request, grace_s=release_grace(stack))
    assert released[-1].seq > decode.events(rid, "evict")[0].seq
    back_at_baseline(run_dir, stack.decode, stack.prefill)
    serves(stack)


def test_abort_while_kv_in_flight_frees_both_sides(stack, run_dir):
    with in_flight(stack, run_dir, "abort-transfer", seed=2) as req:
        stack.client("decode").abort(req.rid)
    # Released: prefill now sends into a transfer decode gave up.
    first = req.decode.released(
        "decode releasing the aborted transfer's pages", req.rid, answered=req.to_decode, grace_s=release_grace(stack)
    )[0]
    assert not decoded_before(req.decode, req.rid, first), "the aborted request decoded"
    answer = outcome(req.to_decode)
    assert isinstance(answer, Exception) or finish_reason(answer) == "abort", f"decode answered {answer}"
    outcome(req.to_prefill)  # it must answer (either way)
    back_at_baseline(run_dir, stack.decode, stack.prefill)
    serves(stack)


def test_health_probes_repeated_leave_no_kv(stack, run_dir):
    # sglang's /health_generate runs one real request (on PD servers with its fake bootstrap) and
    # polls for it once a second: the probes go ten at a time, as a load balancer's would.
    rounds, at_once = 2, 10
    with concurrent.futures.ThreadPoolExecutor(2 * at_once) as pool:
        for _ in range(rounds):
            probes = [
                pool.submit(stack.client(role).health_generate, 60)
                for role in ("prefill", "decode")
                for _ in range(at_once)
            ]
            for probe in probes:
                probe.result()
    for role in ("prefill", "decode"):
        assert stack.client(role).health(), f"{role} /health after the probes"
    decode = Ledger(run_dir, stack.decode)
    health = {e.rid for e in decode.events(kind="prealloc") if e.rid.startswith("HEALTH_CHECK")}
    assert len(health) >= rounds * at_once, (
        f"decode preallocated for {len(health)} of {rounds * at_once} health requests"
    )
    released = {e.rid for e in decode.events(kind="release")}
    assert health <= released, f"health requests never released: {sorted(health - released)[:3]}"
    back_at_baseline(run_dir, stack.decode, stack.prefill)
    serves(stack)


# ------------------------------------------------------------------ an input prefill refuses


@pytest.mark.xfail(
    strict=True,
    raises=RefusalNotPassedOn,
    reason="sglang 0.5.23: prefill refuses an input at its door (no sender, nothing sent to decode), while decode, "
    "having preallocated, waits for the KV until its transfer timeout (300 s); decode's page list then opens a room "
    "in prefill's KV manager that nothing clears (not filed upstream)",
)
@pytest.mark.stall_bound(REFUSAL_STALL_S)
def test_an_input_prefill_refuses_after_decodes_prealloc_is_a_fast_error_and_nothing_held(stack, run_dir, request):
    # Prefill refuses the request at its door (an input past its largest, sent to prefill alone: what a
    # prefill configured shorter than its decode does) while decode holds right after preallocating for it.
    # Decode must then learn that nothing will come (not wait out its transfer timeout) and neither side
    # may keep anything of the request.
    rid, led = new_rid("refused-by-prefill"), run_dir.ledger
    room = random.Random(rid).randrange(1 << 62)
    longest = int(stack.client("prefill").server_info()["max_req_input_len"])
    prealloc = phases.Hold(led, "decode.prealloc", rid)
    try:
        to_prefill, to_decode = stack.direct(
            prompt_ids(200, seed=24),
            4,
            rid,
            room=room,
            timeout_s=3 * PHASE_S,
            prefill_ids=prompt_ids(longest + PAGE, seed=25),
        )
        prealloc.reached(PHASE_S)
        refused = outcome(to_prefill)  # prefill answers while decode still holds after its prealloc
    finally:
        prealloc.release()
    assert isinstance(refused, ServerHTTPError) and refused.status == 400, f"prefill answered {refused!r}"
    answer = outcome(to_decode, 3 * PHASE_S)
    back_at_baseline(run_dir, stack.decode, stack.prefill)
    if stalls(request.node):
        raise RefusalNotPassedOn(
            f"prefill refused the input, and decode was never told: {stalls(request.node)[0].line()}"
        )
    assert isinstance(answer, Exception) or finish_reason(answer) == "abort", f"decode answered {answer!r}"
    serves(stack)


#: Seconds decode has to give an unresolvable bootstrap address up: sglang does after 15 attempts, one
#: a second, to fetch prefill's parallel info from it (about 16 s here), and logs that it did.
BOOTSTRAP_GIVE_UP_S = 60.0
#: Seconds decode then has to fail the request (the next pass of its bootstrap queue: well under one;
#: a fault that never fails it waits all of it out).
FAIL_AFTER_GIVE_UP_S = 5.0
#: Seconds between looks at decode's log for the give-up line.
LOG_POLL_S = 0.5


def test_malformed_bootstrap_address_fails_the_request_not_the_server(stack, run_dir):
    rid = new_rid("bad-bootstrap")
    decode = stack.client("decode", timeout_s=60)
    host = f"no-such-host-{rid.rsplit('-', 1)[1]}.invalid"  # this request's own: the log line names it
    body = {
        "rid": rid,
        "bootstrap_host": host,
        "bootstrap_port": 1,
        "bootstrap_room": random.Random(rid).randrange(1 << 62),
    }
    answer = in_background(lambda: decode.generate(prompt_ids(100, seed=3), 4, extra=body, timeout_s=PHASE_S))
    # The hazard, proven: sglang's bootstrap gave the address up after its retries (its own log line);
    # from then on decode must fail the request, so a hang is told in seconds, not after a long wait.
    try:
        # Each look reads decode's log tail: twice a second, not at the ledgers' POLL_S.
        wait_for(
            lambda: stack.decode_gave_up_bootstrap(f"{host}:1"),
            BOOTSTRAP_GIVE_UP_S,
            f"decode giving the bootstrap address {host}:1 up",
            interval=LOG_POLL_S,
        )
        got = outcome(answer, timeout_s=FAIL_AFTER_GIVE_UP_S)
    except TimeoutError as e:  # the wait's, or the answer's (concurrent.futures.TimeoutError is TimeoutError)
        decode.abort(rid)
        when = str(e) or f"it gave the address up, then waited {FAIL_AFTER_GIVE_UP_S:g} s"
        pytest.fail(
            f"decode never failed {rid}, whose bootstrap address does not resolve ({when}): "
            "a malformed address hangs the request",
            pytrace=False,
        )
    assert isinstance(got, ServerHTTPError) and got.status >= 400, (
        f"decode answered {got!r} for an unreachable bootstrap address"
    )
    assert decode.health(), "decode is not healthy after the malformed bootstrap address"
    back_at_baseline(run_dir, stack.decode, stack.prefill)
    serves(stack)


class DuplicateRoomBug(AssertionError):
    """Requests sharing one bootstrap_room broke the stack in one of the two ways sglang 0.5.23 does
    (sgl#40125 class); which one is a race (:class:`DuplicateRoomHang`, :class:`DuplicateRoomCrash`)."""


class DuplicateRoomHang(DuplicateRoomBug):
    """Requests sharing one bootstrap_room did not all answer (the symptom on a quiet machine)."""


class DuplicateRoomDoubleWrite(DuplicateRoomBug):
    """Prefill sent both requests of the shared room into one set of decode pages (the KV digests'
    ``[kv-write-once]``): the second request's KV overwrites the first's."""


class DuplicateRoomCrash(DuplicateRoomBug):
    """A server's scheduler died of the shared room (the symptom when the second request is still in
    prefill's bootstrap queue as the first one's transfer starts: a loaded machine)."""


#: Seconds each request of the duplicate-room test has to answer (a clean one takes well under one).
#: sglang 0.5.23 hangs the first request on a quiet machine, so the test waits this out in every run.
ANSWER_S = 5.0
#: What sglang 0.5.23's prefill raises in its bootstrap queue (``pop_bootstrapped``) when the second
#: request of a room polls the state of the first one's transfer; the scheduler then dies.
DUPLICATE_ROOM_CRASH = "Unexpected poll state"


@pytest.mark.xfail(
    strict=True,
    raises=DuplicateRoomBug,
    reason="sglang 0.5.23: a request whose bootstrap_room a second request reuses while its KV is in "
    "transfer is never answered, or prefill sends both requests' KV into the room's one set of decode "
    "pages ([kv-write-once]), or, when the second is still bootstrapping as the first one's transfer "
    "starts, prefill's scheduler dies (sgl#40125 class: a duplicate client bootstrap_room); the surviving "
    "servers free every page; XPASS once upstream refuses the duplicate or serves both",
)
def test_duplicate_bootstrap_room_answers_and_leaves_no_kv(sglang_servers, stack, run_dir, record_property):
    # Two different requests under one bootstrap_room (a client bug or a hostile one): each server may
    # refuse or fail them, but must answer, stay up and give every page back. The first is held
    # before its KV send, so the second reaches both servers while the room is in use.
    try:
        _duplicate_room(stack, run_dir)
    except WorkerDied as died:
        if DUPLICATE_ROOM_CRASH not in died.tail:
            raise
        # The known crash: what the servers that survived it hold is checked all the same (a dead peer's
        # transfers must be given up and their pages freed), then the stack is replaced.
        try:
            back_at_baseline(run_dir, *(w for w in (stack.prefill, stack.decode) if w.name != died.name))
        finally:
            record_property("stack_replaced", f"{died.name} died of the duplicate bootstrap_room")
            sglang_servers.forget(MODEL)
        said = next(ln.strip() for ln in died.tail.splitlines() if DUPLICATE_ROOM_CRASH in ln)
        raise DuplicateRoomCrash(f"{died.name} died: {said}") from died


def _duplicate_room(stack, run_dir) -> None:
    room = random.Random("duplicate-room").randrange(1 << 62)
    rids = [new_rid(f"same-room-{i}") for i in range(2)]
    decode = Ledger(run_dir, stack.decode)
    gate = phases.Hold(run_dir.ledger, "prefill.send", rids[0])
    futures: list[concurrent.futures.Future] = []

    def send(i: int) -> None:
        futures.extend(
            direct(stack, prompt_ids(120 + 70 * i, seed=6 + i), 4, rids[i], room=room, timeout_s=3 * ANSWER_S)
        )

    try:
        send(0)
        gate.reached(PHASE_S)
        decode.wait("decode's prealloc of the first request", rids[0], "prealloc")
        send(1)
        # The hazard, proven before the held send goes on: decode preallocated the second request too,
        # under the room the first one holds (or answered it: refused the duplicate). Without this wait
        # the outcome was a race: on a loaded runner the second request reached the servers only after
        # the first one's transfer (both served: XPASS) or while it ran (prefill's scheduler died).
        to_decode = futures[-1]  # the second request's to decode (each send adds prefill's, then decode's)
        wait_until(
            "decode preallocating (or answering) the second request under the room in use",
            lambda: to_decode.done() or bool(decode.events(rids[1], "prealloc")),
        )
    finally:
        gate.release()
    done, pending = concurrent.futures.wait(futures, timeout=ANSWER_S)
    hung = len(pending)
    if hung:
        # Not answered: the clients give up the way a router would (sglang's /abort_request), and what
        # the servers then hold is checked all the same before the known symptom is raised.
        for rid in rids:
            for role in ("prefill", "decode"):
                stack.client(role).abort(rid)
        concurrent.futures.wait(futures, timeout=ANSWER_S)
    for role in ("prefill", "decode"):
        assert stack.client(role).health(), f"{role} is not healthy after a duplicate bootstrap_room"
    try:
        back_at_baseline(run_dir, stack.decode, stack.prefill)
    except ResetError as e:
        # The only finding allowed is the known one: both requests' KV written into the room's pages.
        found = str(e).split(": ledger after the reset: ", 1)[-1].split("; ")
        if not all("[kv-write-once]" in f and f"room {room}:" in f for f in found):
            raise
        raise DuplicateRoomDoubleWrite(f"bootstrap_room {room}: {found[0]}") from e
    if hung:
        raise DuplicateRoomHang(f"{hung} of 4 requests under bootstrap_room {room} not answered within {ANSWER_S:g} s")
    serves(stack)


# ------------------------------------------------------------------ this spends the shared stack
# It kills a server of the shared stack, so it runs after every other test of the model in the session
# (``spends_stack``: the SWA and soak server suites share this stack too). The tight stack's tests come
# first in this module and its decode kill spends it last; the shared stack, started ahead while the
# previous model's tests run, then serves everything else. A session starts each stack once.


@pytest.mark.spends_stack
def test_prefill_killed_while_kv_in_flight_decode_releases(sglang_servers, stack, run_dir, record_property):
    try:
        with in_flight(stack, run_dir, "prefill-killed", seed=4) as req:
            sglang_servers.kill(MODEL, "prefill")
        # Decode must give back what it preallocated for a prefill that will never send, and answer.
        first = req.decode.released(
            "decode releasing the dead prefill's transfer",
            req.rid,
            answered=req.to_decode,
            grace_s=release_grace(stack),
        )[0]
        assert not decoded_before(req.decode, req.rid, first), "the request decoded without its KV"
        answer = outcome(req.to_decode)
        assert isinstance(answer, ServerHTTPError), f"decode answered {answer} for a request whose prefill died"
        back_at_baseline(run_dir, stack.decode)
    finally:
        record_property("stack_replaced", "prefill killed: the next test starts a fresh stack")
        sglang_servers.forget(MODEL)


# ------------------------------------------------------------------ decode before its prefill registers

#: Seconds a restarted prefill has to reach its registration (its start: import and model load).
REGISTER_S = 120.0
#: Seconds decode has to ask the new prefill's bootstrap server, once it has the request: sglang asks at
#: once, then once a second (0.5.23: 15 tries, then it fails the request).
ASKED_S = 10.0


def _bootstrap_status(addr: str) -> int | None:
    """What a prefill's bootstrap server answers decode's first question (its parallel info: every rank
    -1, as ``try_ensure_parallel_info`` asks): 200 once the prefill registered, 503 before; None: no
    answer (not listening yet)."""
    query = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    try:
        return requests.get(f"http://{addr}/route?{query}", timeout=2).status_code
    except requests.RequestException:
        return None


def test_decode_asks_a_prefill_that_has_not_registered_and_serves_once_it_has(sglang_servers, run_dir):
    """sgl#19288's ground: a prefill restarts while decode keeps running, and decode gets a request for
    it while its bootstrap server answers but its scheduler has not registered yet. Held at its
    registration (proof: the hold's marker, and its bootstrap server answering 503), the new prefill
    cannot be asked for parallel info; decode must say so (proof: its ``decode.prefill-info`` mark, not
    ready), keep asking, and once the prefill registered serve the request with the KV it sends:
    the tokens the router's path gives for the same prompt, both servers back at baseline. The router
    swaps the old prefill for the new one, and the stack serves on (the next tests use it)."""
    rid = new_rid("before-register")
    ids = prompt_ids(2 * PAGE + 5, seed=11)
    body: dict[str, Any] = {
        "rid": rid,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_room": random.Random(rid).randrange(1 << 62),
    }
    sent: dict[str, Any] = {}

    def while_starting(old, prefill) -> None:
        addr = f"127.0.0.1:{prefill.ports['bootstrap']}"
        with phases.Hold(run_dir.ledger, "prefill.register", prefill.name) as hold:
            hold.reached(REGISTER_S, died=prefill.poll)
            wait_until(f"{addr} answering 503 (up, not registered)", lambda: _bootstrap_status(addr) == 503, ASKED_S)
            body["bootstrap_port"] = prefill.ports["bootstrap"]
            decode = old.client("decode")
            sent["decode"] = in_background(lambda: decode.generate(ids, 8, extra=body, timeout_s=PHASE_S))
            wait_until(
                f"decode asking {addr} for its prefill's parallel info and told not ready",
                lambda: f"{addr} not ready" in _prefill_info_notes(run_dir),
                ASKED_S,
            )
        sent["addr"] = addr

    stack = sglang_servers.replace(MODEL, "prefill", while_starting=while_starting)
    to_prefill = in_background(lambda: stack.client("prefill").generate(ids, 8, extra=body, timeout_s=PHASE_S))
    got, prefill_said = outcome(sent["decode"]), outcome(to_prefill)
    assert not isinstance(got, Exception), f"decode failed the request its prefill registered late for: {got!r}"
    assert not isinstance(prefill_said, Exception), f"the new prefill failed its leg: {prefill_said!r}"
    notes = _prefill_info_notes(run_dir)
    addr = sent["addr"]
    assert f"{addr} ready" in notes[notes.index(f"{addr} not ready") :], f"decode never got {addr}'s info: {notes}"
    want = stack.client("router").generate(ids, 8).output_ids
    assert got.output_ids == want, (
        f"late-registered prefill's KV decoded to {got.output_ids}, the router's path to {want}"
    )
    back_at_baseline(run_dir, stack.decode, stack.prefill)


def _prefill_info_notes(run_dir) -> list[str]:
    """Decode's answers from bootstrap servers it had no parallel info of, in order (``ADDR ready``,
    ``ADDR not ready``)."""
    return [m.note for m in phases.read_trace(run_dir.ledger) if m.phase == "decode.prefill-info"]
