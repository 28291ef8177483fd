"""The engine concern plugin (``harness/plugins/engine.py``), driven through pytester: selection and errors."""

from __future__ import annotations

pytest_plugins = ["pytester"]

TESTS = """
    import pytest

    def test_sim_unmarked():
        pass

    @pytest.mark.engine("sim")
    def test_sim_marked():
        pass

    @pytest.mark.engine("sglang-server")
    def test_real():
        pass
"""


def _inline(pytester, *args):
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "--run-dir", "rd", *args)


def test_default_runs_every_engine(pytester):
    pytester.makepyfile(TESTS)
    result = _inline(pytester, "-v")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["harness engine: all"])


def test_sim_deselects_real_server_tests(pytester):
    pytester.makepyfile(TESTS)
    result = _inline(pytester, "-v", "--engine", "sim")
    result.assert_outcomes(passed=2, deselected=1)
    result.stdout.no_fnmatch_line("*test_real*PASSED*")


def test_sglang_server_keeps_only_real_server_tests(pytester):
    pytester.makepyfile(TESTS)
    result = _inline(pytester, "-v", "--engine", "sglang-server")
    result.assert_outcomes(passed=1, deselected=2)
    result.stdout.fnmatch_lines(["*test_real PASSED*"])


def test_ini_default_and_bad_values_are_one_clear_error(pytester):
    pytester.makepyfile(TESTS)
    pytester.makeini("[pytest]\nharness_engine = sim\n")
    _inline(pytester).assert_outcomes(passed=2, deselected=1)
    pytester.makeini("[pytest]\nharness_engine = gpu\n")
    result = _inline(pytester)
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*engine 'gpu' from ini harness_engine is not one of all, sim, sglang-server*"])


def test_unknown_engine_marker_is_a_usage_error(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.engine("tpu")
        def test_t():
            pass
    """)
    result = _inline(pytester)
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*@pytest.mark.engine needs one of sim, sglang-server*"])
