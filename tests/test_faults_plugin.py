"""``--inject-fault`` (``harness/plugins/faults.py``), driven through pytester."""

from __future__ import annotations

import os

import pytest

from harness.faults import ENV_VAR

pytestmark = pytest.mark.est_time(12)

pytest_plugins = ["pytester"]

CHECK_INJECTED = """
import os

def test_fault_reaches_env_and_adapter():
    assert os.environ["HARNESS_FAULTS"] == "swa-tail-unaligned"
    from pathlib import Path

    from harness import faults
    from harness.faults import source
    from sglang.srt.disaggregation import decode
    assert faults.active() == []  # runtime wrappers only: this one is a source patch
    # the patch fault's sglang is the scratch copy carrying it, not the installed tree
    package = Path(decode.__file__).parents[2]
    assert source.applied_in(package) == ["swa-tail-unaligned"], package
    assert 'write("swa-tail-unaligned' in Path(decode.__file__).read_text()  # the patched module runs
"""


def test_unknown_fault_is_a_usage_error(pytester):
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--run-dir", "rd", "--inject-fault", "nope")
    assert result.ret == 4
    result.stderr.fnmatch_lines(["*--inject-fault: unknown fault 'nope'; known faults: swa-tail-unaligned*"])
    assert os.environ.get(ENV_VAR) is None


def test_injected_fault_is_in_env_adapter_and_header(pytester, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    pytester.makepyfile(CHECK_INJECTED)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--run-dir", "rd", "--inject-fault", "swa-tail-unaligned", timeout=600
    )
    result.stdout.fnmatch_lines(["faults: swa-tail-unaligned (sglang#35286 / sglang#35396)", "*1 passed*"])
    assert result.ret == 0


def test_header_says_none_without_injection(pytester, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--run-dir", "rd")
    result.stdout.fnmatch_lines(["faults: none"])
    assert result.ret == 0


CAUGHT_THEN_MORE = """
def test_fails_first():
    assert 0

def test_a_catch():
    raise AssertionError("KVCorruption: page 3 of request r differs")

def test_after():
    pass
"""


def test_stop_at_catch_ends_the_session_at_the_first_test_showing_the_evidence(pytester, monkeypatch):
    # corrupt-kv-page's evidence is "KVCorruption": a failure without it (the first test) does not stop the
    # session, the catch does, so the passing test after it never runs.
    monkeypatch.delenv(ENV_VAR, raising=False)
    pytester.makepyfile(CAUGHT_THEN_MORE)
    args = ("-p", "no:cacheprovider", "--run-dir", "rd", "--inject-fault", "corrupt-kv-page")
    stopped = pytester.runpytest_subprocess(*args, "--stop-at-catch", timeout=600)
    stopped.assert_outcomes(failed=2, passed=0)
    stopped.stdout.fnmatch_lines(["*--stop-at-catch: corrupt-kv-page caught by *test_a_catch*"])
