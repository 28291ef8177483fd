"""Chunked prefill on REAL sglang servers (``--chunked-prefill-size`` of one page), and sglang's own test
hooks as fault sources on the same stack. Every step is proven by the phase trace or sglang's log, never by
sleeping; one stack for the module (the hooks are switched on in the running servers, after warm-up).

* Chunk *i* is sent after its forward and before chunk *i+1*'s (``prefill.forwarded`` / ``prefill.send``,
  one each per chunk, in order): the sgl#33970 class is a non-final chunk read before its forward wrote it.
* Each chunk's pages as prefill sent them are the pages decode committed (the KV digests, per chunk).
* An abort while prefill holds the final chunk's send (the sgl#34149 class): ``abort`` on both legs, no
  token, both servers back at their baseline.
* sglang's random transfer failure, fired on a request in flight: answered as failed, nothing held after.
* sglang's forced retraction, fired on two requests decoding: the retracted one resumes to the same tokens.
"""

from __future__ import annotations

import random

import pytest

from harness.api import (
    EnvSwitch,
    ServerHTTPError,
    answer_of,
    ledger,
    new_rid,
    phases,
    prompt_ids,
    reset_server,
    testhooks,
)

MODEL = "tiny-llama"
PAGE = 64
#: One page per chunk: a 200-token prompt is four chunks (64, 64, 64, 8), three of them non-final.
CHUNK = 64

pytestmark = [
    pytest.mark.engine(
        "sglang-server",
        models=(MODEL,),
        gpu_topologies=("2-gpu-h100",),
        server_args=("--page-size", str(PAGE)),
    ),
    pytest.mark.topology("cpu"),
    pytest.mark.est_time(20),
    pytest.mark.timeout(600),
]

#: Seconds for a phase to be reached on a loaded machine (a bound, never a wait: holds end the waits).
PHASE_S = 120.0
#: Seconds a server has to be back at its baseline after a test.
RESET_S = 90.0


class ChunkSentBeforeForward(AssertionError):
    """Prefill sent a chunk's KV before the forward that writes it ran (the sgl#33970 class)."""


def chunks_of(n: int) -> int:
    return -(-n // CHUNK)


#: The chunk size rides on the stack's own flags, not the module's server_args: the basic suite's stack
#: pool (same model, same page) then starts it in place of its shared stack, as it does any stack of
#: its own; a pool of its own asked Ray for a second placement of the same name and failed.
CHUNKED = {role: ("--chunked-prefill-size", str(CHUNK)) for role in ("prefill", "decode")}


@pytest.fixture
def stack(sglang_servers):
    return sglang_servers.pd(MODEL, extra_args=CHUNKED)


def _reset(stack, led) -> None:
    for w in (stack.decode, stack.prefill):
        reset_server(w, f"{led}/{w.name}.jsonl", timeout_s=RESET_S)


def _chunk_marks(led, rid: str, phase: str, worker: str) -> list:
    return [m for m in phases.marks_of(phases.read_trace(led), rid) if m.phase == phase and m.worker.startswith(worker)]


def _content(led, stack, room: int) -> tuple[list, object]:
    """Prefill's ``kv_sent`` events of ``room`` (one per chunk send) and decode's ``kv_commit``."""
    sent = [
        e
        for e in ledger.read(f"{led}/{stack.prefill.name}.jsonl")
        if e.kind == "kv_sent" and e.content.get("room") == room
    ]
    commits = [
        e
        for e in ledger.read(f"{led}/{stack.decode.name}.jsonl")
        if e.kind == "kv_commit" and e.content.get("room") == room
    ]
    assert len(commits) == 1, f"room {room}: {len(commits)} kv_commit events (the KV digest probe is off?)"
    return sent, commits[0]


def test_each_chunk_is_sent_after_its_forward_and_lands_as_sent(stack, run_dir):
    rid, led, n = new_rid("chunks"), run_dir.ledger, 200
    room = random.Random(rid).randrange(1 << 62)
    to_prefill, to_decode = stack.direct(prompt_ids(n, seed=11), 4, rid, room=room, timeout_s=3 * PHASE_S)
    answer = answer_of(to_decode, PHASE_S)
    assert not isinstance(answer, Exception) and len(answer.output_ids) == 4, answer
    answer_of(to_prefill, PHASE_S)
    phases.wait_mark(led, "decode.commit", rid=rid, timeout_s=PHASE_S)
    phases.wait_mark(led, "prefill.release", rid=rid, timeout_s=PHASE_S)
    # 1. one forward and one send per chunk, each send after its own forward and before the next one.
    want = chunks_of(n)
    forwards = _chunk_marks(led, rid, "prefill.forwarded", stack.prefill.name)
    sends = _chunk_marks(led, rid, "prefill.send", stack.prefill.name)
    assert [m.chunk for m in forwards] == list(range(want)), f"forwards {[m.chunk for m in forwards]}"
    assert [m.chunk for m in sends] == list(range(want)), f"sends {[m.chunk for m in sends]}"
    events = sorted([*forwards, *sends], key=lambda m: m.t)  # one scheduler thread wrote both, in this order
    story = [f"{'fwd' if m.phase == 'prefill.forwarded' else 'send'}#{m.chunk}" for m in events]
    for i in range(want):
        if story.index(f"send#{i}") < story.index(f"fwd#{i}"):
            raise ChunkSentBeforeForward(f"{rid}: chunk {i} of {want} sent before its forward: {' '.join(story)}")
    assert story == [s for i in range(want) for s in (f"fwd#{i}", f"send#{i}")], " ".join(story)
    # 2. per chunk, the pages prefill sent are what decode committed (the digests, buffer by buffer).
    sent, commit = _content(led, stack, room)
    assert len(sent) == want, f"{len(sent)} kv_sent events for {want} chunks"
    dst, committed = commit.content["dst"], commit.content["digests"]
    for i, ev in enumerate(sent):
        at, src, digests = ev.content["at"], ev.content["src"], ev.content["digests"]
        assert at == i and len(src) == 1, f"chunk {i}: sent {len(src)} page(s) at ordinal {at}"
        for b, per_buffer in enumerate(digests):
            assert per_buffer[0] == committed[b][at], (
                f"chunk {i}: buffer {b} of prefill page {src[0]} differs from decode page {dst[at]} at its commit"
            )
    _reset(stack, led)


def _not_aborted(answer, rid: str) -> str:
    """Why ``answer`` is not an abort with no token ('' when it is one). sglang answers a request whose
    finish is an abort with a status code (one caught in transfer) with that HTTP status and the abort's
    message (its tokenizer manager raises for a finish of type ``abort``): no token can follow it."""
    if isinstance(answer, ServerHTTPError):
        said = answer.body.lower()
        return "" if answer.status >= 400 and (rid in answer.body or "abort" in said) else f"error: {answer}"
    if isinstance(answer, Exception):
        return f"{type(answer).__name__}: {answer}"
    finish = str((answer.meta.get("finish_reason") or {}).get("type", ""))
    if finish != "abort":
        return f"finish reason {finish!r} after {len(answer.output_ids)} token(s)"
    return f"{len(answer.output_ids)} token(s) with its abort" if answer.output_ids else ""


def test_an_abort_racing_the_final_chunk_ends_both_legs_as_abort(stack, run_dir):
    # Prefill holds the request at its final chunk's send (the first three chunks went); the client
    # aborts it on both legs. Decode gives its transfer up (its release deferred until prefill's drain
    # ack), prefill's KV manager hears of it; then the final chunk's send goes on, against an aborted room.
    rid, led, n = new_rid("abort-last-chunk"), run_dir.ledger, 200
    room = random.Random(rid).randrange(1 << 62)
    last = chunks_of(n) - 1
    final = phases.Hold(led, "prefill.send", rid, chunk=last)
    try:
        to_prefill, to_decode = stack.direct(prompt_ids(n, seed=12), 8, rid, room=room, timeout_s=3 * PHASE_S)
        final.reached(PHASE_S)
        assert [m.chunk for m in _chunk_marks(led, rid, "prefill.send", stack.prefill.name)] == list(range(last + 1))
        stack.client("decode").abort(rid)
        stack.client("prefill").abort(rid)
        phases.wait_mark(led, "decode.defer", rid=rid, timeout_s=PHASE_S)
        phases.wait_mark(led, "transfer.abort", room=room, timeout_s=PHASE_S)
        assert not _chunk_marks(led, rid, "decode.commit", stack.decode.name), "decode committed a held transfer"
    finally:
        final.release()
    on_decode, on_prefill = answer_of(to_decode, PHASE_S), answer_of(to_prefill, PHASE_S)
    legs = (("decode", on_decode), ("prefill", on_prefill))
    wrong = {leg: _not_aborted(a, rid) for leg, a in legs if _not_aborted(a, rid)}
    assert not wrong, f"not an abort with no token: {wrong}"
    phases.wait_mark(led, "decode.released", rid=rid, timeout_s=PHASE_S)
    phases.wait_mark(led, "prefill.release", rid=rid, timeout_s=PHASE_S)
    assert not _chunk_marks(led, rid, "decode.commit", stack.decode.name), "decode committed an aborted request"
    _reset(stack, led)


# ------------------------------------------------------------------ sglang's own test hooks


def _hook(capability: str):
    hook = testhooks.hook_of(capability)
    if hook is None:
        pytest.skip(testhooks.hook_missing(capability))
    return hook


def _log(worker) -> str:
    return worker.log_path.read_text(encoding="utf-8", errors="replace")


def test_sglang_transfer_failure_hook_fails_the_request_and_leaves_nothing_held(stack, run_dir):
    # Prefill holds the request before its first chunk goes, so decode is polling a transfer that has not
    # landed; decode's polls then answer Failed (sglang's hook, decode only) until decode has failed it.
    hook = _hook("transfer-failure")
    rid, led = new_rid("hook-fail"), run_dir.ledger
    room = random.Random(rid).randrange(1 << 62)
    sending = phases.Hold(led, "prefill.send", rid, chunk=0)
    try:
        to_prefill, to_decode = stack.direct(prompt_ids(200, seed=13), 4, rid, room=room, timeout_s=3 * PHASE_S)
        sending.reached(PHASE_S)
        with EnvSwitch(led, hook.env, "1", side="decode"):
            phases.wait_mark(led, "decode.defer", rid=rid, timeout_s=PHASE_S)
    finally:
        sending.release()
    on_decode = answer_of(to_decode, PHASE_S)
    answer_of(to_prefill, PHASE_S)
    assert isinstance(on_decode, ServerHTTPError), f"decode served a request whose transfer failed: {on_decode}"
    # sglang's own words for an injected failure (its log has them at debug level only): its receiver saw
    # none, the poll said Failed.
    proof = testhooks.fired_lines(hook, on_decode.body, rid)
    assert proof, f"decode's answer is not {hook.env} failing {rid}: {on_decode.body[:300]}"
    phases.wait_mark(led, "decode.released", rid=rid, timeout_s=PHASE_S)
    phases.wait_mark(led, "prefill.release", rid=rid, timeout_s=PHASE_S)
    assert not _chunk_marks(led, rid, "decode.commit", stack.decode.name), "decode committed a failed transfer"
    _reset(stack, led)  # nothing held on either side: [reset-leak], [not-baseline] otherwise
    after = stack.client("router").generate(prompt_ids(150, seed=14), 4, timeout_s=PHASE_S)
    assert len(after.output_ids) == 4, f"the stack does not serve again after the failure: {after}"
    _reset(stack, led)


def test_sglang_forced_retraction_hook_resumes_to_the_same_tokens(stack, run_dir):
    # Two requests decode together while decode retracts one every third forward (sglang's hook; a batch
    # of one is never retracted). Each must resume from its restored KV to the tokens it gives unretracted.
    # Together for sure: decode holds the first before its commit until prefill has sent all of the second.
    hook = _hook("forced-retraction")
    led, new = run_dir.ledger, 12
    prompts = [prompt_ids(150, seed=15), prompt_ids(170, seed=16)]
    client = stack.client("router")
    plain = [client.generate(p, new, timeout_s=PHASE_S).output_ids for p in prompts]
    _reset(stack, led)
    seen = len(testhooks.fired_lines(hook, _log(stack.decode)))
    rids = [new_rid("hook-retract") for _ in prompts]
    first = phases.Hold(led, "decode.transferred", rids[0])
    with EnvSwitch(led, hook.env, "1", side="decode"):
        try:
            futures = [stack.direct(p, new, r, timeout_s=3 * PHASE_S)[1] for p, r in zip(prompts, rids)]
            first.reached(PHASE_S)
            phases.wait_mark(led, "prefill.sent", rid=rids[1], timeout_s=PHASE_S)
        finally:
            first.release()
        retracted = [answer_of(f, PHASE_S) for f in futures]
    fired = testhooks.fired_lines(hook, _log(stack.decode))[seen:]
    assert fired, f"decode's log has no retraction of {hook.env} while {rids} decoded: the hook did not fire"
    for rid, got, want in zip(rids, retracted, plain):
        assert not isinstance(got, Exception), f"{rid} failed under retraction: {got}"
        assert got.output_ids == want, f"{rid}: {got.output_ids} after a retraction, {want} without"
    _reset(stack, led)
