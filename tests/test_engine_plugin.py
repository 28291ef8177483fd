"""The engine and servers concern plugins (``harness/plugins/{engine,servers}.py``), driven through pytester:
selection and errors."""

from __future__ import annotations

import pytest

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


# ------------------------------------------------------------------ real models and GPU topologies

SERVER_TESTS = """
    import pytest

    pytestmark = [pytest.mark.engine("sglang-server", models=("tiny-llama",), gpu_topologies=("2-gpu-h100",)),
                  pytest.mark.topology("cpu")]

    def test_on(topology):
        print("RUNS-ON", topology.name)

    @pytest.mark.engine("sglang-server", models=("tiny-llama",))
    def test_cpu_only(topology):
        print("RUNS-ON", topology.name)
"""


def test_model_option_errors_are_one_usage_line(pytester, tmp_path):
    pytester.makepyfile(TESTS)
    result = _inline(pytester, "--model", "dsv4")
    assert result.ret == 4  # pytest's usage error
    result.stderr.fnmatch_lines(["ERROR: --model 'dsv4': write NAME=PATH, e.g. --model dsv4=/models/DeepSeek-V4"])
    result = _inline(pytester, "--model", f"dsv4={tmp_path / 'nope'}")
    result.stderr.fnmatch_lines(
        [f"ERROR: --model dsv4={tmp_path / 'nope'}: * does not exist; give a local model directory (no hub download)"]
    )


def test_env_models_are_validated_and_shown_in_the_header(pytester, tmp_path, monkeypatch):
    pytester.makepyfile(TESTS)
    (tmp_path / "m").mkdir()
    monkeypatch.setenv("HARNESS_MODEL_DSV4", str(tmp_path / "m"))
    result = _inline(pytester)
    result.stderr.fnmatch_lines(
        ["ERROR: env HARNESS_MODEL_DSV4: * has no config.json; give a Hugging Face model directory"]
    )
    (tmp_path / "m" / "config.json").write_text("{}")
    result = _inline(pytester)
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([f"harness models: dsv4={(tmp_path / 'm').resolve()}"])


def test_gpu_topologies_kwarg_runs_on_the_asked_topology_without_extra_variants(pytester):
    pytester.makepyfile(SERVER_TESTS)
    result = _inline(pytester, "-v", "-s")
    result.assert_outcomes(passed=2)  # a plain run: cpu only, no 2-gpu-h100 variant collected
    result.stdout.fnmatch_lines(["*RUNS-ON cpu*", "*RUNS-ON cpu*"])
    result = _inline(pytester, "-v", "-s", "-rs", "--topology", "2-gpu-h100")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*RUNS-ON 2-gpu-h100*", "*runs on cpu; --topology is 2-gpu-h100*"])


def test_real_servers_on_a_simulated_gpu_topology_skip_saying_what_they_need(pytester):
    pytester.makepyfile("""
        import pytest

        pytestmark = [pytest.mark.engine("sglang-server", models=("dsv4",)), pytest.mark.topology("8-gpu-h200")]

        def test_dsv4(sglang_servers):
            raise AssertionError("must not run on simulated GPUs")
    """)
    result = _inline(pytester, "-rs", "--simulate")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        [
            "*real sglang servers need real GPUs: run with --topology 8-gpu-h200 on a GPU machine "
            "without --simulate, and --model dsv4=PATH"
        ]
    )


def test_server_skip_reason_defers_to_the_session_on_a_joined_cluster():
    from types import SimpleNamespace

    from harness import topology
    from harness.plugins.servers import server_skip_reason

    h200 = topology.get("8-gpu-h200")
    real = SimpleNamespace(gpu_kind="real")
    joined = SimpleNamespace(
        cluster=None,
        settings=SimpleNamespace(ray_address="10.0.0.1:6379"),
        get_cluster=lambda: real,
        joined="node0 (8 GPU)",
        skip_reason=lambda t: f"session says no to {t.name}",
    )
    assert server_skip_reason(joined, h200, ("dsv4",)) == "session says no to 8-gpu-h200"
    assert server_skip_reason(joined, topology.get("cpu"), ()) is None
    # A joined cluster whose GPUs are Ray resources on nodes without the devices: refused, saying so.
    real.gpu_kind = "logical"
    reason = server_skip_reason(joined, h200, ("dsv4",))
    assert reason.startswith("real sglang servers need real GPUs: the Ray cluster at 10.0.0.1:6379 has logical ones")
    assert server_skip_reason(joined, topology.get("cpu"), ()) is None  # the CPU stack needs no GPU
    simulated = SimpleNamespace(
        cluster=SimpleNamespace(simulate=True), settings=SimpleNamespace(ray_address=None), skip_reason=lambda t: None
    )
    assert server_skip_reason(simulated, h200, ()).endswith("and --model NAME=PATH for each model")


def test_server_stacks_resolve_models_and_flags_per_topology(pytestconfig, tmp_path):
    from harness import topology
    from harness.plugins.stacks import session_stacks

    h100 = session_stacks(pytestconfig, None, topology.get("2-gpu-h100"), None, server_args=("--page-size", "64"))
    with pytest.raises(
        pytest.fail.Exception,
        match="topology 2-gpu-h100 runs real models: give model 'tiny-llama' "
        "with --model tiny-llama=PATH or HARNESS_MODEL_TINY_LLAMA=PATH",
    ):
        h100.model("tiny-llama")
    assert h100.role_args("prefill") == ("--page-size", "64")
    assert h100.role_args("decode") == h100.role_args("plain") == ("--page-size", "64", "--mem-fraction-static", "0.4")
    (tmp_path / "config.json").write_text("{}")
    h200 = session_stacks(pytestconfig, None, topology.get("8-gpu-h200"), None, models={"dsv4": tmp_path})
    assert h200.model("dsv4") == tmp_path and h200.role_args("decode") == ()
    from harness.engines.server.stack import DEFAULT_READY_TIMEOUT_S, GPU_READY_TIMEOUT_S

    assert (h200.ready_timeout, h100.ready_timeout) == (GPU_READY_TIMEOUT_S, GPU_READY_TIMEOUT_S)
    assert session_stacks(pytestconfig, None, topology.get("cpu"), None).ready_timeout == DEFAULT_READY_TIMEOUT_S


def test_session_servers_share_stacks_per_topology_and_flags_and_stop_a_model_after_its_last_test(pytester):
    """Stacks are session-wide: one stack pool per (topology, module server_args); the last test
    taking the servers and naming a model is remembered at collection (its servers are stopped
    after it); a test that names the model but takes no servers does not count."""
    pytester.makepyfile(
        test_a="""
        import pytest
        pytestmark = pytest.mark.engine("sglang-server", models=("tiny-llama",))
        def test_one(sglang_servers): pass
        @pytest.mark.engine("sglang-server", models=("tiny-llama", "tiny-mellum-swa"))
        def test_two(sglang_servers): pass
        def test_three(sglang_servers): pass
        def test_names_it_without_servers(): pass
    """,
        test_b="""
        import pytest
        pytestmark = pytest.mark.engine("sglang-server", models=("tiny-mellum-swa",))
        def test_four(sglang_servers): pass
        def test_plain_sim(sglang_servers): pass
        def test_after_the_last_server_test(): pass
    """,
        conftest="""
        import pytest
        from harness.plugins import servers

        def pytest_collection_finish(session):
            key = servers._last_use_key
            last = [(sorted(i.stash[key]), i.nodeid) for i in session.items if key in i.stash]
            print("LAST", last)
            from harness import topology
            s = servers.SessionServers(session.config, None, None)
            cpu, h100 = topology.get("cpu"), topology.get("2-gpu-h100")
            a, b = s.on(cpu, ("--page-size", "64")), s.on(cpu, ("--page-size", "64"))
            print("SAME", a is b, a is not s.on(cpu, ()), a is not s.on(h100, ("--page-size", "64")))
    """,
    )
    result = pytester.runpytest("--collect-only", "-q", "-s")
    result.stdout.fnmatch_lines(
        [
            "LAST [(['tiny-llama'], 'test_a.py::test_three'), (['tiny-mellum-swa'], 'test_b.py::test_plain_sim')]",
            "SAME True True True",
        ]
    )


SPENDERS = {
    "test_a": """
        import pytest

        pytestmark = pytest.mark.engine("sglang-server", models=("tiny-llama",))

        def test_a1(sglang_servers):
            pass

        @pytest.mark.spends_stack
        def test_a_kill(sglang_servers):
            pass

        def test_a2(sglang_servers):
            pass

        @pytest.mark.spends_stack
        @pytest.mark.engine("sglang-server", models=("tiny-mellum-swa",))
        def test_alone_kill(sglang_servers):
            pass

        def test_no_servers():
            pass
    """,
    "test_b": """
        import pytest

        @pytest.mark.engine("sglang-server", models=("tiny-llama",))
        def test_b1(sglang_servers):
            pass

        @pytest.mark.engine("sglang-server", models=("tiny-llama",))
        @pytest.mark.spends_stack
        def test_b_kill(sglang_servers):
            pass

        def test_b_plain():
            pass
    """,
}


def test_a_test_that_spends_its_models_stack_runs_after_the_models_other_tests(pytester):
    # A kill in the middle of a model's tests would make the stack start again for the tests after it.
    # The spenders keep their own order; a spender no other test shares a model with, and tests that
    # take no servers, stay where they were. Without the reordering the kill stays between a1 and a2.
    pytester.makepyfile(**SPENDERS)
    result = _inline(pytester, "--collect-only", "-q")
    ids = [line.split("::")[-1] for line in result.stdout.lines if "::" in line]
    assert ids == [
        "test_a1",
        "test_a2",
        "test_alone_kill",
        "test_no_servers",
        "test_b1",
        "test_a_kill",
        "test_b_kill",
        "test_b_plain",
    ], ids
