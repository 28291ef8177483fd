"""Failures that explain themselves: each evidence class gives a first line that names it, and what
the evidence names (rule, request, suspect function, sglang frame), through Ray and into the
summary line and the JUnit message (:mod:`harness.plugins.explain`)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness import ledger
from harness.engines.sim.errors import KVCorruption, PDError, PreallocError, WindowLost
from harness.engines.sim.kvfill import Mismatch
from harness.plugins.explain import CLASSES, clean, headline, sglang_frames
from harness.targets.sglang import selection
from harness.workers import WorkerDied

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.est_time(25)

ROOT = Path(selection.current().root)
TAIL = ledger.Violation("swa-tail-short", "fill 300: tail 44 < min(W_eff 100, fill) = 100: the window loses KV", 3,
                        "decode-0", "r0-300", "prealloc")
LEAK = ledger.Violation("page-leak", "pool 'swa': 1 page(s) never freed", None, "decode-0", "r0-300")


def _raised_in_sglang(message: str) -> AssertionError:
    """An AssertionError whose innermost frame is a function of a file under ``sglang/``."""
    code = compile(f"def alloc_extend_swa_tail():\n    assert False, {message!r}\n", "/x/sglang/srt/mem_cache/allocator/swa.py", "exec")
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
    assert line.startswith("prealloc PreallocError: decode prealloc of v255 (fill 255, swa tail -1) failed | suspect: "
                           "sglang/srt/disaggregation/decode.py DecodePreallocQueue._pre_alloc")
    assert "DecodePreallocQueue._swa_tail_len" in line
    assert line.endswith("; the ledger then found [page-leak] decode-0 r0-300: pool 'swa': 1 page(s) never freed")
    # A rule broken at an event (before the refusal) is still the root cause, and leads.
    refused.violations = (LEAK, TAIL)  # type: ignore[attr-defined]
    kind, line = headline(refused, root=ROOT)
    assert kind == "ledger" and line.startswith("ledger [swa-tail-short] ") and "it stopped the run as PreallocError" in line


def test_a_kv_mismatch_names_the_request_and_position():
    kind, line = headline(KVCorruption("r7", "swa", Mismatch(2, 130, 2, 2), "after transfer"), root=ROOT)
    assert kind == "kv" and line.startswith("kv KVCorruption: KV corruption in request r7: swa") and "position 130" in line
    kind, line = headline(WindowLost("request r3: position 250 inside the window [200, 300) has no SWA slot"))
    assert kind == "kv" and "position 250" in line and "| suspect: sglang/srt/managers/schedule_batch.py" in line


def test_a_worker_death_names_the_worker_its_cause_and_the_last_sglang_frame():
    tail = ('Traceback (most recent call last):\n  File "/v/site-packages/sglang/srt/managers/scheduler.py", line 3000, '
            'in event_loop_normal\nRuntimeError: boom')
    kind, line = headline(WorkerDied("decode-0", "subprocess pid 12 (python) exit code 1", tail))
    assert kind == "worker-death"
    assert line == ("worker-death decode-0: subprocess pid 12 (python) exit code 1 | last sglang frame: "
                    "sglang/srt/managers/scheduler.py:3000 in event_loop_normal")


def test_sglangs_own_assert_names_the_frame_that_raised_it():
    kind, line = headline(_raised_in_sglang("swa_tail_len <= extend_num_tokens"))
    assert kind == "sglang-assert"
    assert line == ("sglang-assert AssertionError: swa_tail_len <= extend_num_tokens | at "
                    "sglang/srt/mem_cache/allocator/swa.py:2 in alloc_extend_swa_tail")


def test_a_timeout_names_the_last_sglang_frame_of_the_workers_logs():
    log = '  File "/v/sglang/srt/disaggregation/decode.py", line 2300, in pop_preallocated\n'
    kind, line = headline(TimeoutError("worker decode-0: step() did not return within 60 s"), logs=[log])
    assert kind == "timeout"
    assert line.endswith("| last sglang frame: sglang/srt/disaggregation/decode.py:2300 in pop_preallocated")


def test_the_others_and_the_helpers():
    assert headline(AssertionError("swa_tail_len 44 != 108")) == ("assertion", "assertion swa_tail_len 44 != 108")
    assert headline(AssertionError("free pages 3 != 4\nassert 3 == 4"))[1] == "assertion free pages 3 != 4 | assert 3 == 4"
    assert headline(AssertionError())[1] == "assertion AssertionError"
    assert headline(KeyError("x"))[0] == "error"
    assert clean("\x1b[36mray::a\x1b[39m\n b") == "ray::a b"
    assert sglang_frames("nothing here") == []
    # the harness's own adapter package is not sglang, though its path says sglang/
    assert sglang_frames('  File "/repo/harness/targets/sglang/server/stack.py", line 162, in _forked') == []
    assert headline(ValueError("y" * 1000))[1].endswith("…") and len(headline(ValueError("y" * 1000))[1]) == 400
    assert set(CLASSES) >= {"ledger", "kv", "worker-death", "timeout", "sglang-assert", "assertion", "error"}


RAY_TESTS = '''
import sys
import time

import pytest
import ray.cloudpickle

from harness import ledger
from harness.engines.sim.errors import WindowLost
from harness.workers import InProcess, Subprocess

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the payloads travel to the workers by value

TAIL = ledger.Violation("swa-tail-short", "fill 300: tail 44 < min(W_eff 100, fill) = 100", 3, "d0", "r0-300", "prealloc")


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
'''


def test_through_ray_every_class_leads_the_summary_line_and_the_junit_message(pytester, tmp_path):
    pytester.makepyfile(test_ray=RAY_TESTS)
    junit = tmp_path / "junit.xml"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rf", f"--junitxml={junit}",
                                           "-o", "junit_family=xunit1", "--run-dir", str(tmp_path / "run"), timeout=600)
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


FROM_THE_WORKERS_LEDGERS = '''
import pytest
from harness import ledger
from harness.engines.sim.errors import PreallocError


def _keep_a_page(run_dir, rid, page):
    # What a decode rank's probe writes when sglang's prealloc takes a page and never gives it back.
    with ledger.LedgerWriter(run_dir.ledger / "d0.jsonl", "d0", "decode") as w:
        w.record("prealloc", rid, 64, pages={"swa": (page,)})


def test_refused(run_dir):
    _keep_a_page(run_dir, "v255", 7)
    raise PreallocError("decode prealloc of v255 (fill 255, swa tail -1) failed")


def test_saw_other(run_dir):
    _keep_a_page(run_dir, "v300", 8)
    assert 1 + 1 == 3, "the reply differs from the plain server's"
'''


def test_the_workers_ledgers_join_the_line_a_refused_prealloc_still_leads(pytester, tmp_path):
    # The leak is not carried by the exception (as the PD engine's PreallocError carries it): it is
    # in the ledger file a worker wrote during the test, as with a real server's probe. For a refused
    # prealloc the refusal leads and the ledger's end-of-run finding follows; for anything else the
    # rule the workers broke is the root cause and leads, and what the test saw follows.
    pytester.makepyfile(test_ledgers=FROM_THE_WORKERS_LEDGERS)
    junit = tmp_path / "junit.xml"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--junitxml={junit}", "-o", "junit_family=xunit1",
                                           "--run-dir", str(tmp_path / "run"), timeout=300)
    result.assert_outcomes(failed=2)
    messages = {c.get("name"): (c.find("failure").get("message") or "") for c in ET.parse(junit).iter("testcase")}
    refused = messages["test_refused"]
    assert refused.startswith("prealloc PreallocError: decode prealloc of v255 (fill 255, swa tail -1) failed | suspect: "
                              "sglang/srt/disaggregation/decode.py DecodePreallocQueue._pre_alloc"), refused
    assert "; the ledger then found [page-leak] d0 v255: pool 'swa': 1 page(s) never freed" in refused, refused
    other = messages["test_saw_other"]
    assert other.startswith("ledger [page-leak] d0 v300: pool 'swa': 1 page(s) never freed"), other
    assert "; the test saw: assertion" in other and "the reply differs" in other, other
