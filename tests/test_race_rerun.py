"""A test a known upstream race hit by chance runs once more (``harness/plugins/race_rerun.py``), driven
through pytester: the race is planted as the probe writes it (a ``transfer.lost-update`` mark in the run's
phase trace during the test), so the explain plugin proves it as it would on a real stack."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

pytest_plugins = ["pytester"]

#: A test that meets the race on its first attempt only (its counter file says which attempt it is), and
#: a strict xfail that forces it every time. ``ATTEMPT_FAILS`` set: the second attempt fails by its own check.
TESTS = """
    import json, os, time
    from pathlib import Path
    import pytest

    def _race(run_dir):
        trace = Path(run_dir.ledger) / "trace"
        trace.mkdir(parents=True, exist_ok=True)
        mark = {"t": time.time(), "worker": "prefill", "phase": "transfer.lost-update", "room": 7}
        with open(trace / "prefill-1.jsonl", "a") as f:
            f.write(json.dumps(mark) + "\\n")
        raise TimeoutError("prefill holding the request before its KV send: not ready")

    def test_hit_once(run_dir, tmp_path_factory):
        seen = Path(str(tmp_path_factory.getbasetemp())) / "attempts"
        n = int(seen.read_text()) + 1 if seen.exists() else 1
        seen.write_text(str(n))
        if n == 1:
            _race(run_dir)
        assert not os.environ.get("ATTEMPT_FAILS"), "the test's own check"

    @pytest.mark.xfail(strict=True, raises=TimeoutError, reason="forces the race")
    def test_forces_it(run_dir):
        _race(run_dir)
"""


def _run(pytester, monkeypatch, fails: bool):
    if fails:
        monkeypatch.setenv("ATTEMPT_FAILS", "1")
    pytester.makepyfile(TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--run-dir", "rd", "--junitxml=j.xml", "-rxX")
    cases = {c.get("name"): c for c in ET.parse(pytester.path / "j.xml").getroot().iter("testcase")}
    props = {n: {p.get("name"): p.get("value") for p in c.iter("property")} for n, c in cases.items()}
    return result, cases, props


def test_a_test_the_race_hit_runs_again_and_its_own_check_decides(pytester, monkeypatch):
    result, cases, props = _run(pytester, monkeypatch, fails=False)
    result.assert_outcomes(passed=1, xfailed=1)
    assert "lost its status update" in props["test_hit_once"]["rerun_after_known_race"]
    assert "rerun_after_known_race" not in props["test_forces_it"], "a forced race is never rerun"
    outcomes = {
        json.loads(ln)["suffix"]: json.loads(ln)["outcome"] for ln in (pytester.path / "rd" / "tests.jsonl").open()
    }
    assert outcomes == {"::test_hit_once": "passed", "::test_forces_it": "skipped"}, outcomes


def test_the_second_attempt_fails_by_its_own_check(pytester, monkeypatch):
    # Without the rerun the test would read xfailed (the race) and its own check would never run.
    result, cases, props = _run(pytester, monkeypatch, fails=True)
    result.assert_outcomes(failed=1, xfailed=1)
    assert [f.get("message") for f in cases["test_hit_once"] if f.tag == "failure"][0].count("own check") == 1
    assert "lost its status update" in props["test_hit_once"]["rerun_after_known_race"]
