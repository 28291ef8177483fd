"""Registry: markers read statically (never importing), est_time sharing, measured durations, upstream files."""

from __future__ import annotations

import json
import textwrap

import pytest

from harness.rerun import collector, registry, upstream
from harness.rerun.registry import RegistryError
from rerun_tree import make_repo, make_upstream


def _file(reg, rel):
    f = reg.by_rel(rel)
    assert f is not None, rel
    return f


def test_module_class_function_markers(tmp_path):
    reg = collector.collect(make_repo(tmp_path))
    hs = _file(reg, "suites/test_hisparse_allocator.py")
    assert hs.topologies == ("cpu",)
    assert [t.suffix for t in hs.tests] == ["::test_alloc_extend", "::TestRelease::test_release_returns_pages"]
    assert hs.est_time == pytest.approx(30)  # module est shared by its two tests
    basic = _file(reg, "suites/pd/test_disaggregation_basic.py")
    assert basic.topologies == ("2-gpu-h100",)
    ests = {t.suffix: t.est_time for t in basic.tests}
    # the function's own est_time wins; the class's 120 goes to the one test without its own
    assert ests == {"::TestDisaggregationBasic::test_prealloc": 120, "::TestDisaggregationBasic::test_transfer": 20}
    assert _file(reg, "suites/pd/test_disaggregation_dsv4.py").topologies == ("8-gpu-h200",)


def test_closest_topology_marker_wins(tmp_path):
    make_repo(
        tmp_path,
        {
            "suites/test_mixed.py": """
        import pytest
        pytestmark = pytest.mark.topology("cpu")

        def test_default():
            pass

        @pytest.mark.topology("2-gpu-h100", "8-gpu-h200")
        def test_gpu():
            pass

        @pytest.mark.topology("8-gpu-h200")
        class TestBig:
            @pytest.mark.topology("2-gpu-h100")
            def test_override(self):
                pass

            def test_inherit(self):
                pass
        """
        },
    )
    f = _file(collector.collect(tmp_path), "suites/test_mixed.py")
    assert {t.suffix: t.topologies for t in f.tests} == {
        "::test_default": ("cpu",),
        "::test_gpu": ("2-gpu-h100", "8-gpu-h200"),
        "::TestBig::test_override": ("2-gpu-h100",),
        "::TestBig::test_inherit": ("8-gpu-h200",),
    }


def test_reading_never_imports_the_suite(tmp_path):
    make_repo(
        tmp_path,
        {
            "suites/test_explodes.py": """
        raise SystemExit("imported!")
        import pytest
        pytestmark = pytest.mark.topology("2-gpu-h100")

        def test_x():
            pass
        """
        },
    )
    f = _file(collector.collect(tmp_path), "suites/test_explodes.py")
    assert f.topologies == ("2-gpu-h100",)


def test_unmarked_file_defaults_to_cpu_and_default_estimate(tmp_path):
    f = _file(collector.collect(make_repo(tmp_path)), "suites/a/test_dup.py")
    assert f.topologies == (registry.DEFAULT_TOPOLOGY,)
    assert f.est_time == registry.DEFAULT_TEST_EST


@pytest.mark.parametrize(
    "mark", ["pytest.mark.topology(NAME)", 'pytest.mark.est_time("soon")', "pytest.mark.est_time()"]
)
def test_non_literal_marker_is_an_error_on_that_file_only(tmp_path, mark):
    make_repo(tmp_path, {"suites/test_bad.py": f"import pytest\npytestmark = {mark}\n\ndef test_x():\n    pass\n"})
    reg = collector.collect(tmp_path)
    assert "suites/test_bad.py" in _file(reg, "suites/test_bad.py").error
    assert _file(reg, "suites/test_hisparse_allocator.py").error is None


def test_measured_durations_replace_estimates(tmp_path):
    repo = make_repo(tmp_path)
    (repo / "suites" / "durations.json").write_text(
        json.dumps({"suites/pd/test_disaggregation_basic.py::TestDisaggregationBasic::test_prealloc": 7.5})
    )
    run = repo / "runs" / "r1" / "report"
    run.mkdir(parents=True)
    (run / "durations.json").write_text(
        json.dumps(
            {
                "suites/test_hisparse_allocator.py::TestRelease::test_release_returns_pages[1]": 1.0,
                "suites/test_hisparse_allocator.py::TestRelease::test_release_returns_pages[2]": 2.0,
            }
        )
    )
    reg = collector.collect(repo)
    basic = {t.suffix: (t.est_time, t.measured) for t in _file(reg, "suites/pd/test_disaggregation_basic.py").tests}
    assert basic["::TestDisaggregationBasic::test_prealloc"] == (7.5, True)
    assert basic["::TestDisaggregationBasic::test_transfer"] == (20, False)
    hs = {t.suffix: t.est_time for t in _file(reg, "suites/test_hisparse_allocator.py").tests}
    assert hs["::TestRelease::test_release_returns_pages"] == 3.0  # parametrized cases summed
    assert hs["::test_alloc_extend"] == 15.0


def test_bad_durations_file_is_one_clear_error(tmp_path):
    repo = make_repo(tmp_path)
    (repo / "suites" / "durations.json").write_text("[1, 2]")
    with pytest.raises(RegistryError, match="durations.json: must map test ids to seconds"):
        collector.collect(repo)


def test_a_truncated_durations_file_of_a_past_run_is_skipped_with_one_warning(tmp_path, capsys):
    # Before: one truncated runs/*/report/durations.json (a run killed mid-write) made every later
    # rerun-test and gate plan exit 2, without saying which run held it.
    repo = make_repo(tmp_path)
    bad = repo / "runs" / "r1" / "report" / "durations.json"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"suites/test_hisparse_allocator.py::test_alloc_extend": 1')
    good = repo / "runs" / "r2" / "report" / "durations.json"
    good.parent.mkdir(parents=True)
    good.write_text(json.dumps({"suites/test_hisparse_allocator.py::test_alloc_extend": 4.0}))
    reg = collector.collect(repo)
    assert {t.suffix: t.est_time for t in _file(reg, "suites/test_hisparse_allocator.py").tests}[
        "::test_alloc_extend"
    ] == 4.0
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith(f"warning: {bad}: not valid JSON")
        and err[0].endswith("skipped (delete it to silence this)")
    )


# ---------------------------------------------------------------- upstream (sglang test/registered)


def test_upstream_registrations_map_to_topologies(tmp_path):
    reg = collector.collect(make_repo(tmp_path / "repo"), [make_upstream(tmp_path / "sglang")])
    cpu = _file(reg, "registered/cpu/test_cpu_utils.py")
    assert cpu.kind == "upstream" and cpu.topologies == ("cpu",) and cpu.est_time == pytest.approx(12)
    assert [t.suffix for t in cpu.tests] == ["::TestUtils::test_one", "::TestUtils::test_two"]
    assert _file(reg, "registered/pd/test_pd_large.py").topologies == ("2-gpu-h100",)
    deepep = _file(reg, "registered/pd/test_deepep.py")
    assert deepep.topologies == ("8-gpu-h200",) and deepep.est_time == pytest.approx(900)
    assert reg.by_rel("registered/amd/test_amd_only.py") is None  # AMD-only: not ours


def test_unmapped_upstream_suite_names_it(tmp_path):
    up = make_upstream(
        tmp_path / "sglang",
        {
            "registered/pd/test_odd.py": """
        register_cuda_ci(est_time=10, stage="stage-z", runner_config="4-gpu-b300")
        def test_x():
            pass
        """
        },
    )
    f = _file(collector.collect(make_repo(tmp_path / "repo"), [up]), "registered/pd/test_odd.py")
    assert "unmapped upstream cuda suite 'stage-z-test-4-gpu-b300'" in f.error
    assert '[runner_config] "4-gpu-b300"' in f.error and "_upstream-map.toml" in f.error


def test_upstream_non_literal_registration_is_an_error(tmp_path):
    tree = tmp_path / "t.py"
    tree.write_text("EST = 3\nregister_cpu_ci(est_time=EST, suite='x')\n")
    import ast

    with pytest.raises(RegistryError, match="must be a literal"):
        upstream.read_registrations(ast.parse(tree.read_text()), "t.py")


def test_shipped_map_covers_the_issue_examples():
    m = upstream.load_map()
    reg = upstream.Registration
    assert m.topology_for(reg("cpu", 1, suite="stage-a-test-cpu")) == "cpu"
    assert m.topology_for(reg("cuda", 1, stage="s", runner_config="2-gpu-large")) == "2-gpu-h100"
    assert m.topology_for(reg("cuda", 1, stage="s", runner_config="8-gpu-h200")) == "8-gpu-h200"
    assert m.topology_for(reg("cuda", 1, stage="s", runner_config="deepep-8-gpu-h200")) == "8-gpu-h200"


def test_map_file_errors(tmp_path):
    bad = tmp_path / "_m.toml"
    bad.write_text("[runners]\nx = 'cpu'\n")
    with pytest.raises(RegistryError, match="unknown table 'runners'"):
        upstream.load_map(bad)
    bad.write_text(textwrap.dedent("[suite]\nx = 3\n"))
    with pytest.raises(RegistryError, match=r"\[suite\] must map"):
        upstream.load_map(bad)


def test_engine_marker_read_statically_closest_wins(tmp_path):
    make_repo(
        tmp_path,
        {
            "suites/test_engines.py": """
        import pytest
        pytestmark = [pytest.mark.engine("sglang-server", models=("tiny-llama",)), pytest.mark.topology("cpu")]

        def test_server():
            pass

        @pytest.mark.engine("sim")
        def test_sim():
            pass
        """
        },
    )
    f = _file(collector.collect(tmp_path), "suites/test_engines.py")
    assert {t.suffix: t.engine for t in f.tests} == {"::test_server": "sglang-server", "::test_sim": "sim"}
    assert {t.engine for t in _file(collector.collect(tmp_path), "suites/test_hisparse_allocator.py").tests} == {"sim"}


def test_engine_marker_must_name_an_engine(tmp_path):
    make_repo(
        tmp_path,
        {
            "suites/test_bad_engine.py": """
        import pytest
        pytestmark = pytest.mark.engine("vllm")

        def test_x():
            pass
        """
        },
    )
    f = _file(collector.collect(tmp_path), "suites/test_bad_engine.py")
    assert f.error and "pytest.mark.engine needs a literal engine first, one of sim, sglang-server" in f.error


def test_pairs_join_simulated_suites_to_real_server_suites_of_this_repository():
    """Every pair names registered files: the simulated side runs only sim tests, the other side only
    real-server tests, and each side finds the other through counterparts()."""
    from harness.rundir import REPO_ROOT

    reg = collector.collect(REPO_ROOT)
    for sim, reals in registry.PAIRS.items():
        assert {t.engine for t in _file(reg, sim).tests} == {"sim"}, sim
        assert registry.counterparts(sim) == reals
        for real in reals:
            assert {t.engine for t in _file(reg, real).tests} == {"sglang-server"}, real
            assert sim in registry.counterparts(real)
    assert registry.counterparts("suites/unit/mem_cache/test_hisparse_allocator.py") == ()
