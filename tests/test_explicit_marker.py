"""``pytest.mark.explicit``: a test that runs only when its file is named, never from a directory (``./dev test``),
and a file carrying it left out of ``rerun-test``'s default run but runnable by name."""

from __future__ import annotations

import pytest

from harness.rerun import collector, spec_resolve
from harness.rerun.spec_grammar import parse_spec

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.est_time(3)

SLOW = """
import pytest
pytestmark = [pytest.mark.explicit("a stack a test"), pytest.mark.topology("cpu")]
def test_slow(): pass
"""


def _run(pytester, *args):
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:randomly", *args)


def test_collected_from_a_directory_it_is_deselected(pytester):
    pytester.makepyfile(test_slow=SLOW, test_fast="def test_fast(): pass")
    result = _run(pytester, str(pytester.path))
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(["*1 passed, 1 deselected*"])


def test_named_it_runs(pytester):
    # Named by node id (the file part of FILE::test counts; rerun-test passes node ids too).
    pytester.makepyfile(test_slow=SLOW, test_fast="def test_fast(): pass")
    result = _run(pytester, "test_slow.py::test_slow")
    result.assert_outcomes(passed=1)


def test_rerun_default_run_leaves_it_out_and_runs_it_by_name(tmp_path):
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "test_slow.py").write_text(SLOW)
    (tmp_path / "suites" / "test_fast.py").write_text("def test_fast(): pass\n")
    reg = collector.collect(tmp_path)
    slow = reg.by_rel("suites/test_slow.py")
    assert slow is not None and slow.disabled == "runs only when named (a stack a test)"
    assert [s.suite.rel for s in spec_resolve.everything(reg)] == ["suites/test_fast.py"]
    named = spec_resolve.resolve([parse_spec("suites/test_slow.py")], reg)
    assert [(s.suite.rel, len(s.tests)) for s in named] == [("suites/test_slow.py", 1)]
