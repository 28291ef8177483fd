"""``--inject-fault`` (``harness/plugins/faults.py``), driven through pytester."""

from __future__ import annotations

import os

from harness.faults import ENV_VAR

pytest_plugins = ["pytester"]

CHECK_INJECTED = """
import os

def test_fault_reaches_env_and_adapter():
    assert os.environ["HARNESS_FAULTS"] == "swa-tail-unaligned"
    import harness.targets.sglang as adapter
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    assert adapter.ACTIVE_FAULTS == ["swa-tail-unaligned"]
    assert DecodePreallocQueue._swa_tail_len.__module__ == "harness.faults.catalog"
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
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--run-dir", "rd",
                                           "--inject-fault", "swa-tail-unaligned", timeout=600)
    result.stdout.fnmatch_lines(["faults: swa-tail-unaligned (sglang#35286 / sglang#35396)", "*1 passed*"])
    assert result.ret == 0


def test_header_says_none_without_injection(pytester, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--run-dir", "rd")
    result.stdout.fnmatch_lines(["faults: none"])
    assert result.ret == 0
