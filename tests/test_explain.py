"""Failures that explain themselves: each evidence class gives a first line that names it, and what
the evidence names (rule, request, suspect function, sglang frame), through Ray and into the
summary line and the JUnit message (:mod:`harness.plugins.explain`)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
import time
from pathlib import Path

import pytest

from harness import ledger
from harness.engines.sim.errors import KVCorruption, PDError, PreallocError, WindowLost
from harness.engines.sim.kvfill import Mismatch
from harness.plugins.explain import CLASSES, clean, headline, sglang_frames, stall_line
from harness.targets.sglang import selection
from harness.workers import WorkerDied

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.est_time(25)

ROOT = Path(selection.current().root)
TAIL = ledger.Violation(
    "swa-tail-short",
    "fill 300: tail 44 < min(W_eff 100, fill) = 100: the window loses KV",
    3,
    "decode-0",
    "r0-300",
    "prealloc",
)
LEAK = ledger.Violation("page-leak", "pool 'swa': 1 page(s) never freed", None, "decode-0", "r0-300")


def _raised_in_sglang(message: str) -> AssertionError:
    """An AssertionError whose innermost frame is a function of a file under ``sglang/``."""
    code = compile(
        f"def alloc_extend_swa_tail():\n    assert False, {message!r}\n",
        "/x/sglang/srt/mem_cache/allocator/swa.py",
        "exec",
    )
    scope: dict = {}
    exec(code, scope)
    try:
        scope["alloc_extend_swa_tail"]()
    except AssertionError as e:
        return e
    raise RuntimeError("not raised")


def test_a_ledger_failure_leads_with_its_root_cause_and_the_suspect_in_the_target():
    kind, line = headline(ledger.LedgerBroken([LEAK, TAIL], "after prealloc of r0-300"), root=ROOT)
    assert kind == "ledger"
    assert line.startswith("ledger [swa-tail-short] decode-0 prealloc of r0-300: fill 300: tail 44 < min(W_eff 100")
    assert "(+1 more: page-leak)" in line
    assert "| suspect: sglang/srt/disaggregation/decode.py DecodePreallocQueue._swa_tail_len" in line
    # The PD run's own error carries its violations too.
    assert headline(PDError("2 ledger violation(s)", violations=[LEAK, TAIL]))[1].startswith("ledger [swa-tail-short]")


def test_a_refused_prealloc_leads_over_the_leaks_it_left_but_not_over_an_earlier_rule():
    # sglang refused a prealloc mid-run (its tail was -1) and kept the page it had taken; the end of the
    # run found that page leaked. The refusal leads, with its suspects, then what the ledger found.
    refused = PreallocError("decode prealloc of v255 (fill 255, swa tail -1) failed")
    refused.violations = (LEAK,)  # type: ignore[attr-defined]  # as the PD run attaches the ledger's verdict
    kind, line = headline(refused, root=ROOT)
    assert kind == "prealloc"
    assert line.startswith(
        "prealloc PreallocError: decode prealloc of v255 (fill 255, swa tail -1) failed | suspect: "
        "sglang/srt/disaggregation/decode.py DecodePreallocQueue._pre_alloc"
    )
    assert "DecodePreallocQueue._swa_tail_len" in line
    assert line.endswith("; the ledger then found [page-leak] decode-0 r0-300: pool 'swa': 1 page(s) never freed")
    # A rule broken at an event (before the refusal) is still the root cause, and leads.
    refused.violations = (LEAK, TAIL)  # type: ignore[attr-defined]
    kind, line = headline(refused, root=ROOT)
    assert (
        kind == "ledger"
        and line.startswith("ledger [swa-tail-short] ")
        and "it stopped the run as PreallocError" in line
    )


def test_a_kv_mismatch_names_the_request_and_position():
    kind, line = headline(KVCorruption("r7", "swa", Mismatch(2, 130, 2, 2), "after transfer"), root=ROOT)
    assert (
        kind == "kv" and line.startswith("kv KVCorruption: KV corruption in request r7: swa") and "position 130" in line
    )
    kind, line = headline(WindowLost("request r3: position 250 inside the window [200, 300) has no SWA slot"))
    assert kind == "kv" and "position 250" in line and "| suspect: sglang/srt/managers/schedule_batch.py" in line


def test_a_worker_death_names_the_worker_its_cause_and_the_last_sglang_frame():
    tail = (
        'Traceback (most recent call last):\n  File "/v/site-packages/sglang/srt/managers/scheduler.py", line 3000, '
        "in event_loop_normal\nRuntimeError: boom"
    )
    kind, line = headline(WorkerDied("decode-0", "subprocess pid 12 (python) exit code 1", tail))
    assert kind == "worker-death"
    assert line == (
        "worker-death decode-0: subprocess pid 12 (python) exit code 1 | last sglang frame: "
        "sglang/srt/managers/scheduler.py:3000 in event_loop_normal"
    )


def test_sglangs_own_assert_names_the_frame_that_raised_it():
    kind, line = headline(_raised_in_sglang("swa_tail_len <= extend_num_tokens"))
    assert kind == "sglang-assert"
    assert line == (
        "sglang-assert AssertionError: swa_tail_len <= extend_num_tokens | at "
        "sglang/srt/mem_cache/allocator/swa.py:2 in alloc_extend_swa_tail"
    )


def test_a_timeout_names_the_last_sglang_frame_of_the_workers_logs():
    log = '  File "/v/sglang/srt/disaggregation/decode.py", line 2300, in pop_preallocated\n'
    kind, line = headline(TimeoutError("worker decode-0: step() did not return within 60 s"), logs=[log])
    assert kind == "timeout"
    assert line.endswith("| last sglang frame: sglang/srt/disaggregation/decode.py:2300 in pop_preallocated")


def test_the_others_and_the_helpers():
    assert headline(AssertionError("swa_tail_len 44 != 108")) == ("assertion", "assertion swa_tail_len 44 != 108")
    assert (
        headline(AssertionError("free pages 3 != 4\nassert 3 == 4"))[1] == "assertion free pages 3 != 4 | assert 3 == 4"
    )
    assert headline(AssertionError())[1] == "assertion AssertionError"
    assert headline(KeyError("x"))[0] == "error"
    assert clean("\x1b[36mray::a\x1b[39m\n b") == "ray::a b"
    assert sglang_frames("nothing here") == []
    # the harness's own adapter package is not sglang, though its path says sglang/
    assert sglang_frames('  File "/repo/harness/targets/sglang/server/stack.py", line 162, in _forked') == []
    assert headline(ValueError("y" * 1000))[1].endswith("…") and len(headline(ValueError("y" * 1000))[1]) == 400
    assert set(CLASSES) >= {"ledger", "kv", "worker-death", "timeout", "sglang-assert", "assertion", "error"}


RAY_TESTS = """
import sys
import time

import pytest
import ray.cloudpickle

from harness import ledger
from harness.engines.sim.errors import WindowLost
from harness.workers import InProcess, Subprocess

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the payloads travel to the workers by value

TAIL = ledger.Violation(
    "swa-tail-short", "fill 300: tail 44 < min(W_eff 100, fill) = 100", 3, "d0", "r0-300", "prealloc"
)


class Broken:
    def ledger(self):
        raise ledger.LedgerBroken([TAIL], "after prealloc of r0-300")

    def window(self):
        raise WindowLost("request r3: position 250 inside the window [200, 300) has no SWA slot")

    def sglang(self):
        code = compile("def alloc_extend_swa_tail():\\n    assert False, 'swa_tail_len <= extend_num_tokens'\\n",
                       "/x/sglang/srt/mem_cache/allocator/swa.py", "exec")
        scope = {}
        exec(code, scope)
        scope["alloc_extend_swa_tail"]()

    def hang(self):
        time.sleep(30)


pytestmark = pytest.mark.topology("cpu")


@pytest.mark.parametrize("method", ["ledger", "window", "sglang"])
def test_raised_in_a_worker(pd_workers, method):
    pd_workers("decode", InProcess(Broken)).call(method)


def test_worker_dies(pd_workers):
    w = pd_workers("decode", Subprocess((sys.executable, "-c", "import time; time.sleep(1); raise SystemExit(3)")))
    time.sleep(8)
    w.check()


def test_call_times_out(pd_workers):
    pd_workers("decode", InProcess(Broken)).call("hang", timeout=2)
"""


def test_through_ray_every_class_leads_the_summary_line_and_the_junit_message(pytester, tmp_path):
    pytester.makepyfile(test_ray=RAY_TESTS)
    junit = tmp_path / "junit.xml"
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "-rf",
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit1",
        "--run-dir",
        str(tmp_path / "run"),
        timeout=600,
    )
    result.assert_outcomes(failed=5)
    messages = {c.get("name"): (c.find("failure").get("message") or "") for c in ET.parse(junit).iter("testcase")}
    expect = {
        "test_raised_in_a_worker[ledger]": "ledger [swa-tail-short] d0 prealloc of r0-300: fill 300: tail 44",
        "test_raised_in_a_worker[window]": "kv WindowLost: request r3: position 250",
        "test_raised_in_a_worker[sglang]": "sglang-assert AssertionError: swa_tail_len <= extend_num_tokens | at "
        "sglang/srt/mem_cache/allocator/swa.py:2 in alloc_extend_swa_tail",
        "test_worker_dies": "worker-death decode-0-0",  # then the worker's unique suffix and its cause
        "test_call_times_out": "timeout TimeoutError: worker decode-0-0",
    }
    assert "subprocess pid" in messages["test_worker_dies"] and "exit code 3" in messages["test_worker_dies"]
    assert "hang() did not return within 2 s" in messages["test_call_times_out"]
    for name, start in expect.items():
        assert messages[name].startswith(start), (name, messages[name])
        assert "ray::" not in messages[name] and "repr=<" not in messages[name] and "\x1b[" not in messages[name]
    summary = [line for line in result.outlines if line.startswith("FAILED ")]
    assert any("test_raised_in_a_worker[ledger] - ledger [swa-tail-short]" in line for line in summary), summary


FROM_THE_WORKERS_LEDGERS = """
import pytest
from harness import ledger
from harness.engines.sim.errors import PreallocError


def _keep_a_page(run_dir, rid, page, refused=False):
    # What a decode rank's probe writes when sglang's prealloc takes a page and never gives it back:
    # refused (its prealloc raised), or its release leaving the page behind.
    with ledger.LedgerWriter(run_dir.ledger / "d0.jsonl", "d0", "decode") as w:
        if refused:
            w.record("alloc_fail", rid, 64, pages={"swa": (page,)})
            return
        w.record("prealloc", rid, 64, pages={"swa": (page, page + 1)})
        w.record("release", rid, 64, pages={"swa": (page + 1,)})


def test_refused(run_dir):
    _keep_a_page(run_dir, "v255", 7, refused=True)
    raise PreallocError("decode prealloc of v255 (fill 255, swa tail -1) failed")


def test_saw_other(run_dir):
    _keep_a_page(run_dir, "v300", 8)
    assert 1 + 1 == 3, "the reply differs from the plain server's"
"""


def test_the_workers_ledgers_join_the_line_a_refused_prealloc_still_leads(pytester, tmp_path):
    # The leak is not carried by the exception (as the PD engine's PreallocError carries it): it is
    # in the ledger file a worker wrote during the test, as with a real server's probe. For a refused
    # prealloc the refusal leads and the ledger's end-of-run finding follows; for anything else the
    # rule the workers broke is the root cause and leads, and what the test saw follows.
    pytester.makepyfile(test_ledgers=FROM_THE_WORKERS_LEDGERS)
    junit = tmp_path / "junit.xml"
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit1",
        "--run-dir",
        str(tmp_path / "run"),
        timeout=300,
    )
    result.assert_outcomes(failed=2)
    messages = {c.get("name"): (c.find("failure").get("message") or "") for c in ET.parse(junit).iter("testcase")}
    refused = messages["test_refused"]
    assert refused.startswith(
        "prealloc PreallocError: decode prealloc of v255 (fill 255, swa tail -1) failed | suspect: "
        "sglang/srt/disaggregation/decode.py DecodePreallocQueue._pre_alloc"
    ), refused
    assert "; the ledger then found [page-leak] d0 v255: pool 'swa': 1 page(s) never freed" in refused, refused
    other = messages["test_saw_other"]
    assert other.startswith("ledger [page-leak] d0 v300: pool 'swa': 1 page(s) never freed"), other
    assert "; the test saw: assertion" in other and "the reply differs" in other, other


# ------------------------------------------------------------------ a request in flight at the failure


def _ev(seq, kind, rid, ts, component="decode", worker="decode-0", **kw) -> ledger.Event:
    return ledger.Event(seq=seq, ts=ts, kind=kind, rid=rid, component=component, worker=worker, page_size=64, **kw)


#: The fresh clone's failure (issue 47): decode preallocated 0.03 s into the test, prefill never
#: scheduled the request, the client gave up at +120 s, and decode released it on the abort.
T0 = 1_000.0
STALLED = [
    _ev(0, "prealloc", "r9", T0 + 0.03, pages={"full": (1, 2, 3, 4)}),
    _ev(1, "release", "r9", T0 + 120.4, pages={"full": (1, 2, 3, 4)}, note="abort: client gave up"),
]
PREFILL_BUSY = [_ev(0, "prealloc", "other", T0 + 1, component="prefill", worker="prefill-0")]


def test_a_stall_says_where_each_side_was_from_the_ledgers():
    flying = ledger.check(STALLED[:1])
    assert [v.rule for v in flying] == [ledger.IN_FLIGHT]
    # prefill writes requests' events (it holds another): it never scheduled this one
    line = stall_line(flying, STALLED + PREFILL_BUSY, start=T0, failed_at=T0 + 120.1, read_at=T0 + 121)
    assert line == (
        "stall: request r9: decode prealloc at +0.03 s, nothing after it for 120 s; prefill never "
        "scheduled it | decode released it 0.3 s after the failure (abort: client gave up)"
    ), line
    # prefill reached a phase of its own; the release never came
    prefill = [_ev(3, "transfer", "r9", T0 + 0.5, component="prefill", worker="prefill-0")]
    line = stall_line(flying, STALLED[:1] + prefill, start=T0, failed_at=T0 + 120.1, read_at=T0 + 130.1)
    assert line.endswith(
        "; prefill transfer at +0.50 s, nothing after it for 120 s | still in flight 10 s after the failure"
    ), line
    # a prefill ledger with no request's events (the real server's probe records none there) says so
    line = stall_line(flying, STALLED[:1], start=T0, failed_at=T0 + 120.1, read_at=T0 + 121)
    assert "; prefill recorded nothing of it (no request's events in its ledger) |" in line, line
    # the request that stalled longest leads, the others are counted
    later = [_ev(5, "prealloc", "r10", T0 + 100, pages={"full": (9,)})]
    line = stall_line(
        ledger.check(STALLED[:1] + later), STALLED[:1] + later, start=T0, failed_at=T0 + 120.1, read_at=T0 + 121
    )
    assert line.startswith("stall: request r9:") and line.endswith(" (+1 more in flight)"), line


def test_a_carrier_of_requests_in_flight_only_is_a_stall_not_a_leak():
    flying = ledger.check(STALLED[:1])
    kind, line = headline(ledger.LedgerBroken(flying, "of decode-0: the release never came"))
    assert kind == "stall", line
    assert line.startswith("stall: request r9 (decode-0, last phase prealloc) still in flight"), line
    assert "[page-leak]" not in line and "never freed" not in line
    # beside a broken rule the rule leads, as before
    kind, line = headline(ledger.LedgerBroken([*flying, TAIL]))
    assert kind == "ledger" and line.startswith("ledger [swa-tail-short]"), line
    # a KV check that stopped the run with requests in flight stays a kv failure
    wrong = KVCorruption("r9", "swa", Mismatch(2, 130, 2, 2), "after transfer")
    wrong.violations = tuple(flying)  # type: ignore[attr-defined]
    assert headline(wrong)[0] == "kv"


def test_a_stall_is_a_timeout_to_the_gates_never_accounting():
    from harness.gates.classify import classify

    line = stall_line(ledger.check(STALLED[:1]), STALLED, start=T0, failed_at=T0 + 120.1, read_at=T0 + 121)
    assert classify("failure", f"{line}; the test saw: assertion ledger broken: [in-flight-at-end] ...") == "timeout"
    kind, said = headline(ledger.LedgerBroken(ledger.check(STALLED[:1])))
    assert classify("failure", said) == "timeout", said


def test_the_verdict_waits_a_bounded_time_for_the_release_and_ends_at_it():
    from harness.clock import FakeClock
    from harness.plugins.record import SETTLE_S, LedgerReading, settle

    clock = FakeClock()

    def fake_ledger() -> LedgerReading:  # the abort's release is written 0.6 s after the failure
        events = STALLED if clock.now() >= 0.6 else STALLED[:1]
        return LedgerReading(ledger.check(events), events)

    got = settle(fake_ledger, clock=clock)
    assert got.violations == [] and 0.6 <= clock.now() < 1.0  # returned as soon as nothing was in flight
    # judged at once, as before, the same ledger blamed what was only in flight
    assert [v.rule for v in ledger.check(STALLED[:1])] == [ledger.IN_FLIGHT]
    never = FakeClock()
    got = settle(lambda: LedgerReading(ledger.check(STALLED[:1]), STALLED[:1]), clock=never)
    assert [v.rule for v in got.violations] == [ledger.IN_FLIGHT] and never.now() == SETTLE_S == 10.0
    idle = FakeClock()
    assert settle(lambda: LedgerReading(), clock=idle) == LedgerReading() and idle.now() == 0  # nothing to wait for


IN_FLIGHT_TESTS = """
import threading
import time

import requests

from harness import ledger


def _gives_up(run_dir, rid, release_after_s):
    # decode preallocated; the client gives up; sglang aborts it and releases its pages a moment later
    w = ledger.LedgerWriter(run_dir.ledger / f"{rid}.jsonl", "decode-0", "decode")
    w.record("prealloc", rid, 64, pages={"full": (1, 2, 3, 4)})

    def abort():
        time.sleep(release_after_s)
        w.record("release", rid, 64, pages={"full": (1, 2, 3, 4)}, note="abort: client gave up")
        w.close()

    if release_after_s is not None:
        threading.Thread(target=abort).start()


def test_released_a_moment_later(run_dir):
    _gives_up(run_dir, "slow-1", 1.0)
    raise requests.exceptions.ReadTimeout("HTTPConnectionPool(host='127.0.0.1', port=1): Read timed out.")


def test_never_released(run_dir):
    _gives_up(run_dir, "stuck-1", None)
    raise requests.exceptions.ReadTimeout("HTTPConnectionPool(host='127.0.0.1', port=1): Read timed out.")


def test_assertion_while_in_flight(run_dir):
    _gives_up(run_dir, "slow-2", 0.5)
    assert 1 + 1 == 3, "the reply differs"
"""


def test_a_failure_with_a_request_in_flight_waits_for_its_release_and_never_blames_a_leak(pytester, tmp_path):
    # Before: judged as soon as the test body failed, the abort's release not written yet: "[page-leak]".
    pytester.makepyfile(test_in_flight=IN_FLIGHT_TESTS)
    pytester.makeconftest("import harness.plugins.record as record\nrecord.SETTLE_S = 3.0\n")
    junit = tmp_path / "junit.xml"
    started = time.monotonic()
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit1",
        "--run-dir",
        str(tmp_path / "run"),
        timeout=300,
    )
    result.assert_outcomes(failed=3)
    messages = {c.get("name"): (c.find("failure").get("message") or "") for c in ET.parse(junit).iter("testcase")}
    assert all("[page-leak]" not in m and "never freed" not in m for m in messages.values()), messages
    late = messages["test_released_a_moment_later"]
    assert late.startswith("stall: request slow-1: decode prealloc at +"), late
    assert "; prefill recorded nothing of it" in late and "| decode released it " in late, late
    assert "s after the failure (abort: client gave up); the test saw: timeout ReadTimeout" in late, late
    stuck = messages["test_never_released"]
    assert stuck.startswith("stall: request stuck-1: decode prealloc at +") and "| still in flight 3 s after" in stuck
    # not a timeout (nothing gave up on the request, no wait): the test's own line leads, the request follows
    assert messages["test_assertion_while_in_flight"] == (
        "assertion the reply differs | assert (1 + 1) == 3; still "
        "in flight: request slow-2 (decode-0, last phase prealloc)"
    )
    assert time.monotonic() - started < 120  # the wait is bounded (3 s here), and ends at the release
