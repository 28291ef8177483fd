"""Resolution: bare names, paths, ::selectors; no-match (close matches) and ambiguity errors."""

from __future__ import annotations

import pytest

from harness.rerun import collector
from harness.rerun.spec_resolve import ResolveError, everything, resolve
from harness.rerun.spec_grammar import parse_spec
from rerun_tree import make_repo, make_upstream


@pytest.fixture
def reg(tmp_path):
    return collector.collect(make_repo(tmp_path / "repo"), [make_upstream(tmp_path / "sglang")])


def _one(reg, token):
    [sel] = resolve([parse_spec(token)], reg)
    return sel


@pytest.mark.parametrize(
    "token",
    [
        "test_disaggregation_basic.py",
        "suites/pd/test_disaggregation_basic.py",
        "pd/test_disaggregation_basic.py",
    ],
)
def test_file_forms(reg, token):
    sel = _one(reg, token)
    assert sel.suite.rel == "suites/pd/test_disaggregation_basic.py" and sel.whole and len(sel.tests) == 2


def test_absolute_path_inside_repo(reg):
    sel = _one(reg, str(reg.repo_root / "suites" / "test_hisparse_allocator.py"))
    assert sel.suite.rel == "suites/test_hisparse_allocator.py"


@pytest.mark.parametrize(
    "token, suffixes",
    [
        (
            "test_disaggregation_basic.py::TestDisaggregationBasic::test_transfer",
            ["::TestDisaggregationBasic::test_transfer"],
        ),
        (
            "test_disaggregation_basic.py::TestDisaggregationBasic.test_transfer",
            ["::TestDisaggregationBasic::test_transfer"],
        ),
        (
            "test_disaggregation_basic.py::TestDisaggregationBasic",
            ["::TestDisaggregationBasic::test_prealloc", "::TestDisaggregationBasic::test_transfer"],
        ),
        ("test_hisparse_allocator.py::test_alloc_extend", ["::test_alloc_extend"]),
        ("test_cpu_utils.py::TestUtils.test_two", ["::TestUtils::test_two"]),
    ],
)
def test_selector_forms(reg, token, suffixes):
    sel = _one(reg, token)
    assert [t.suffix for t in sel.tests] == suffixes and not sel.whole


def test_parametrize_id_kept(reg):
    sel = _one(reg, "test_hisparse_allocator.py::TestRelease::test_release_returns_pages[2]")
    assert sel.param == "[2]"


def test_no_match_lists_close_matches(reg):
    with pytest.raises(ResolveError) as e:
        _one(reg, "test_disagregation_basic.py")
    assert "close matches: test_disaggregation_basic.py" in str(e.value)


def test_no_test_in_file_lists_close_matches(reg):
    with pytest.raises(ResolveError) as e:
        _one(reg, "test_disaggregation_basic.py::TestDisaggregationBasic::test_transfr")
    assert "has no test" in str(e.value) and "test_transfer" in str(e.value)


def test_ambiguous_bare_name_lists_candidates(reg):
    with pytest.raises(ResolveError) as e:
        _one(reg, "test_dup.py")
    msg = str(e.value)
    assert "matches 2 files" in msg and "suites/a/test_dup.py" in msg and "suites/b/test_dup.py" in msg


def test_path_disambiguates(reg):
    assert _one(reg, "suites/b/test_dup.py").suite.rel == "suites/b/test_dup.py"


def test_absolute_path_outside_is_refused(reg, tmp_path):
    outside = tmp_path / "elsewhere" / "test_x.py"
    outside.parent.mkdir()
    outside.write_text("def test_x(): pass\n")
    with pytest.raises(ResolveError, match="outside the repository"):
        _one(reg, str(outside))


def test_existing_but_unregistered_file_is_refused(reg):
    (reg.repo_root / "harness_like.py").write_text("x = 1\n")
    with pytest.raises(ResolveError):
        _one(reg, str(reg.repo_root / "harness_like.py"))


def test_unmapped_upstream_file_fails_when_selected(tmp_path):
    up = make_upstream(
        tmp_path / "sglang", {"registered/test_weird.py": 'register_cuda_ci(est_time=1, suite="nightly-4-gpu-b200")\n'}
    )
    reg = collector.collect(make_repo(tmp_path / "repo"), [up])
    with pytest.raises(ResolveError, match="unmapped upstream cuda suite 'nightly-4-gpu-b200'"):
        _one(reg, "test_weird.py")
    _one(reg, "test_cpu_utils.py")  # the rest of the tree still resolves


def test_everything_is_every_registered_file(reg):
    rels = {s.suite.rel for s in everything(reg)}
    assert "suites/test_hisparse_allocator.py" in rels and "registered/pd/test_deepep.py" in rels
    assert len(rels) == len(reg.files)


@pytest.fixture(scope="module")
def repo_reg():
    from harness.rundir import REPO_ROOT

    return collector.collect(REPO_ROOT)


def _rels(sels):
    return [s.suite.rel for s in sels]


def test_a_whole_simulated_file_brings_its_real_server_suites(repo_reg):
    from harness.rerun.spec_resolve import only_engine, with_counterparts

    sels, added = with_counterparts(resolve([parse_spec("test_disaggregation_basic.py")], repo_reg), repo_reg)
    basic, server, swa = (
        "suites/disaggregation/test_disaggregation_basic.py",
        "suites/disaggregation/test_disaggregation_basic_server.py",
        "suites/disaggregation/test_disaggregation_swa_server.py",
    )
    assert _rels(sels) == [basic, server, swa] and added == [(server, basic), (swa, basic)]
    assert _rels(only_engine(sels, "sim")) == [basic]
    assert _rels(only_engine(sels, "sglang-server")) == [server, swa]
    assert only_engine(sels, "all") == sels
    # The other direction, and a named test pairs with nothing.
    assert _rels(
        with_counterparts(resolve([parse_spec("test_disaggregation_swa_server.py")], repo_reg), repo_reg)[0]
    ) == [swa, basic]
    one = resolve([parse_spec("test_disaggregation_basic.py::test_concurrent_requests_decode_together")], repo_reg)
    assert with_counterparts(one, repo_reg) == (one, [])
