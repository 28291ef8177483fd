"""harness.cluster.join and .nodes without a cluster: Ray's auth rules, the join errors' classes, skew and GPU kinds.

The same paths run for real against ``ray start`` clusters in ``test_joined_cluster.py`` and
``test_joined_auth.py``; here every branch is driven with hand-built inputs.
"""

from __future__ import annotations

import json
import socket

import pytest

from harness.cluster import join
from harness.cluster import nodes as node_facts
from harness.cluster.join import Auth, ClusterMeta, JoinError
from harness.cluster.nodes import NodeFacts
from harness.workers.node_ref import node_index

pytest_plugins = ["pytester"]


def test_auth_reads_the_token_as_ray_does_env_then_path_then_home(tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    assert join.auth_settings({}, home) == Auth("unset", None)
    (home / ".ray" / "auth_token").write_text("t" * 64)
    assert join.auth_settings({}, home).token_source == str(home / ".ray" / "auth_token")
    path = tmp_path / "token"
    path.write_text("p" * 64)
    assert join.auth_settings({"RAY_AUTH_TOKEN_PATH": str(path)}, home).token_source == f"RAY_AUTH_TOKEN_PATH={path}"
    both = {"RAY_AUTH_TOKEN": "e" * 64, "RAY_AUTH_TOKEN_PATH": str(path), "RAY_AUTH_MODE": "TOKEN"}
    assert join.auth_settings(both, home) == Auth("token", "RAY_AUTH_TOKEN")


def test_auth_settings_that_cannot_work_say_why(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no token" in join.auth_settings({"RAY_AUTH_MODE": "token"}, empty).problem
    # Ray refuses a path variable naming nothing instead of falling back to the home file.
    assert "names no readable" in join.auth_settings({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "nope")}, empty).problem
    assert "neither token nor disabled" in join.auth_settings({"RAY_AUTH_MODE": "on"}, empty).problem


@pytest.mark.parametrize("address", ["nohost", "host:", ":6379", "host:port", "host:70000"])
def test_a_bad_address_is_an_address_error(address):
    with pytest.raises(JoinError) as e:
        join.probe(address, environ={})
    assert e.value.kind == "address" and "\n" not in str(e.value)


def test_nothing_listening_is_unreachable_before_any_ray_call(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(JoinError) as e:
            join.probe(f"127.0.0.1:{port}", environ={"HOME": str(tmp_path)})
    assert e.value.kind == "unreachable"
    assert str(e.value).startswith(f"cannot join the Ray cluster at 127.0.0.1:{port}: unreachable: ")


def test_token_mode_without_a_token_is_refused_here_before_ray_would_abort(tmp_path):
    with pytest.raises(JoinError) as e:
        join.probe("127.0.0.1:1", environ={"HOME": str(tmp_path), "RAY_AUTH_MODE": "token"})
    assert e.value.kind == "auth" and "RAY_AUTH_MODE=token but no token" in e.value.detail


REFUSED = {
    "error": "AuthenticationError",
    "message": "RPC error: InvalidAuthToken: Authentication token is missing or incorrect",
}


@pytest.mark.parametrize(
    "auth, says, fix",
    [
        (
            Auth("unset", "/h/.ray/auth_token"),
            "requires token authentication and RAY_AUTH_MODE is unset",
            "set RAY_AUTH_MODE=token",
        ),
        (Auth("disabled", None), "this process has no token", "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN"),
        (Auth("token", "RAY_AUTH_TOKEN"), "refused the token from RAY_AUTH_TOKEN", "`ray get-auth-token` on the head"),
    ],
)
def test_a_refusal_is_classified_by_what_this_process_sent(auth, says, fix):
    e = join._classify("h:1", REFUSED, auth, 15.0)
    assert e.kind == "auth" and says in e.detail and fix in e.fix


def test_silence_and_other_errors_are_not_ray():
    assert (
        join._classify(
            "h:1", {"error": "timeout", "message": "no Ray GCS answered within 15 s"}, Auth("unset", None), 15
        ).kind
        == "not-ray"
    )
    assert (
        join._classify("h:1", {"error": "crashed", "message": "the probe exited -6"}, Auth("unset", None), 15).kind
        == "not-ray"
    )


def test_version_mismatch_names_both_sides(monkeypatch):
    monkeypatch.setattr(join, "our_versions", lambda: ("2.60.0", "3.11.7"))
    join.check_versions(ClusterMeta("h:1", "2.60.0", "3.11.7"))
    with pytest.raises(JoinError) as e:
        join.check_versions(ClusterMeta("h:1", "2.59.1", "3.11.2"))
    assert e.value.kind == "version"
    assert "Ray 2.60.0 here, 2.59.1 on the cluster" in e.value.detail and "Python 3.11.7 here" in e.value.detail
    join.check_versions(ClusterMeta("h:1", "2.60.0", "3.11.2"), "minor")  # Ray's minor level forgives the patch


OURS = {"python": "3.11.7", "ray": "2.60.0", "sglang": "0.5.23", "torch": "2.14.1", "mooncake": "0.3"}


def _node(i, gpus=1.0, devices=0, error=None, **versions):
    return NodeFacts(
        f"{i:02d}" * 20, "10.0.0.1", i, gpus, devices if error is None else None, {**OURS, **versions}, error
    )


def test_skew_names_the_node_and_both_versions_and_skips_silent_nodes():
    nodes = [_node(0), _node(1, sglang="0.5.22", torch="2.13.0"), _node(2, error="did not answer")]
    assert node_facts.skew(nodes, OURS) == [
        "node1/10.0.0.1: sglang 0.5.22 there, 0.5.23 here, torch 2.13.0 there, 2.14.1 here"
    ]
    assert node_facts.skew([_node(0, mooncake="0.4")], OURS) == []  # only what must match everywhere
    assert "did not answer" in node_facts.describe(nodes)


@pytest.mark.parametrize(
    "nodes, kind",
    [
        ([_node(0, gpus=0.0)], "none"),
        ([_node(0, gpus=8.0, devices=8), _node(1, gpus=8.0, devices=8)], "real"),
        ([_node(0, gpus=8.0, devices=8), _node(1, gpus=8.0, devices=0)], "logical"),
        ([_node(0, gpus=2.0, devices=1)], "logical"),
        ([_node(0, gpus=1.0, error="gone")], "unknown"),
    ],
)
def test_gpu_kind_asks_every_gpu_node(nodes, kind):
    assert node_facts.gpu_kind(nodes) == kind


def test_node_index_from_resource_or_label():
    assert node_index({"harness_node_3": 1000.0}, {}) == 3
    assert node_index({"CPU": 2.0}, {"pd-harness/node": "1"}) == 1
    assert node_index({"CPU": 2.0}, {"pd-harness/node": "x"}) is None


def test_pytest_on_a_cluster_it_cannot_join_is_one_error_for_the_session(pytester, tmp_path):
    """Two tests that need the cluster: the session ends at the first with one line and exit 2."""
    pytester.makepyfile(
        test_two="""
        import pytest
        from harness.workers import InProcess

        pytestmark = pytest.mark.topology("2-gpu-h100")

        def test_one(pd_workers):
            pd_workers("prefill", InProcess(dict))

        def test_two(pd_workers):
            pd_workers("decode", InProcess(dict))
        """
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
        result = pytester.runpytest_subprocess("--ray-address", address, "-p", "no:cacheprovider")
    assert result.ret == 2
    out = result.stdout.str() + result.stderr.str()
    assert out.count(f"cannot join the Ray cluster at {address}: unreachable: ") == 1, out
    assert "passed" not in out and " failed" not in out and " error" not in out, out


def test_the_probe_deadline_comes_from_harness_join_timeout(tmp_path):
    assert join.probe_timeout("h:1", {}) == join.PROBE_TIMEOUT_S
    assert join.probe_timeout("h:1", {join.TIMEOUT_ENV: " 2.5 "}) == 2.5
    for bad in ("0", "-3", "soon", "inf", "nan"):
        with pytest.raises(JoinError) as e:  # before anything is asked: port 1 is never tried
            join.probe("127.0.0.1:1", environ={"HOME": str(tmp_path), join.TIMEOUT_ENV: bad})
        assert e.value.kind == "setting" and f"{join.TIMEOUT_ENV}={bad} is not a number" in str(e.value)
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------ what travels to a joined cluster


def _tree(root, version="0.5.23"):
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    (root / "sglang" / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    return root


def test_a_tree_or_wheel_travels_with_the_harness_and_a_release_or_installed_does_not(tmp_path):
    from harness.cluster import carry
    from harness.rundir import REPO_ROOT
    from harness.targets.sglang import travel
    from harness.targets.sglang.resolve import Target

    tree = Target(
        spec="../src/python", origin="tree", version="0.5.23", root=str(tmp_path), commit="c" * 40, dirty=True
    )
    env = carry.runtime_env(tree)
    assert env["py_modules"] == [str(REPO_ROOT / "harness"), str(tmp_path / "sglang")]
    assert "__pycache__/" in env["excludes"]
    assert env["env_vars"]["HARNESS_SGLANG"] == "../src/python"
    assert Target.from_dict(json.loads(env["env_vars"][travel.CARRIED_ENV])) == tree
    for origin in ("installed", "release"):
        other = carry.runtime_env(Target(spec="0.5.21", origin=origin, version="0.5.21", root=str(tmp_path)))
        assert other["py_modules"] == [str(REPO_ROOT / "harness")] and travel.CARRIED_ENV not in other["env_vars"]


def test_a_node_resolves_the_travelling_target_to_the_copy_on_its_path(tmp_path, monkeypatch):
    from harness.targets.sglang import travel
    from harness.targets.sglang.resolve import Target, TargetError

    sent = Target(
        spec="/driver/only/python",
        origin="tree",
        version="0.5.23",
        root="/driver/only/python",
        commit="a" * 40,
        dirty=False,
    )
    copy = _tree(tmp_path / "_ray_pkg_1", version="0.5.99")  # what the copy's files say does not matter
    monkeypatch.setenv(travel.CARRIED_ENV, json.dumps(sent.to_dict()))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'elsewhere'}:{copy}:{_tree(tmp_path / 'later')}")
    got = travel.arrived(sent.spec)
    assert (got.root, got.spec, got.origin, got.version, got.commit) == (
        str(copy),
        str(copy),
        "tree",
        "0.5.23",
        "a" * 40,
    )
    assert travel.arrived("0.5.21") is None  # another TARGET resolves as it always did
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "elsewhere"))
    with pytest.raises(TargetError, match="was shipped with this job but no copy of it is on this node's PYTHONPATH"):
        travel.arrived(sent.spec)
    monkeypatch.delenv(travel.CARRIED_ENV)
    assert travel.arrived(sent.spec) is None  # nothing travels with a cluster the harness started
