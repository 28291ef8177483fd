"""Joining a cluster that requires Ray token auth, and clusters whose versions differ from the driver's.

The cluster (:mod:`raycli`, two ``ray start`` nodes) is started the way issue 17 met it: a token
file in the home directory and ``RAY_AUTH_MODE`` unset, so Ray turns token auth on by itself (the
worker node is told ``RAY_AUTH_MODE=token``, as Ray requires for a node joining by address). Every
home directory here is a temp dir: this machine's ``~/.ray`` is never read or written.

Each refusal is one line and exit 2, before any test runs; with ``RAY_AUTH_MODE=token`` the same
``rerun-test`` passes. A client whose Python differs from the cluster's (the system interpreter
against the venv's) and a node whose sglang differs (its ``PYTHONPATH`` leads with another
sglang's distribution metadata; no suite runs there) are named with both versions.
"""

from __future__ import annotations

import json
import os
import subprocess
import importlib.util
from pathlib import Path

import pytest

from harness.targets.sglang.version import read_version
from joined import REPO, TOPOLOGY, Done, clean_env, harness, rerun_test
from raycli import two_nodes

pytestmark = [pytest.mark.timeout(900), pytest.mark.est_time(40)]

# The driver's sglang (the installed target): the skew test gives a node another release.
SUPPORTED_VERSION = read_version(Path(importlib.util.find_spec("sglang").origin).parents[1])

CROSS_NODE = "suites/smoke/test_cross_node.py"
TOKEN = "0123456789abcdef" * 4
SYSTEM_PYTHON = Path("/usr/bin/python3.11")


@pytest.fixture(scope="module")
def token_cluster():
    # RAY_AUTH_MODE unset on the head + a token file: Ray turns token auth on; a node joining by
    # address must be told RAY_AUTH_MODE=token.
    with two_nodes("pa-", token=TOKEN, worker_env={"RAY_AUTH_MODE": "token"}) as cluster:
        yield cluster


@pytest.fixture
def home_with_token(tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(TOKEN)
    return home


def _one_line(done: Done, prog: str) -> str:
    assert done.rc == 2, done.out
    assert len(done.lines()) == 1, done.out
    line = done.lines()[0]
    assert line.startswith(f"{prog}: cannot join the Ray cluster at "), line
    return line


def test_token_file_with_mode_unset_stops_in_one_line_naming_the_variable(token_cluster, home_with_token, tmp_path):
    env = clean_env(home_with_token, tmp_path / "procs")
    done = rerun_test(token_cluster, env, tmp_path / "run", CROSS_NODE)
    line = _one_line(done, "rerun-test")
    assert ": auth: the cluster requires token authentication and RAY_AUTH_MODE is unset" in line
    assert line.endswith("set RAY_AUTH_MODE=token (with the cluster's token) and rerun"), line
    assert not (tmp_path / "run" / "groups").exists()


def test_with_mode_token_rerun_test_passes_on_the_token_cluster(token_cluster, home_with_token, tmp_path):
    env = clean_env(home_with_token, tmp_path / "procs", RAY_AUTH_MODE="token")
    done = rerun_test(token_cluster, env, tmp_path / "run", CROSS_NODE)
    assert done.rc == 0, done.out
    assert "(joined, logical GPUs)" in done.out


def test_a_wrong_token_is_refused_in_one_line(token_cluster, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(home, tmp_path / "procs", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="f" * 64)
    line = _one_line(harness(env, "doctor", TOPOLOGY, "--ray-address", token_cluster.address), "harness")
    assert ": auth: refused the token from RAY_AUTH_TOKEN" in line, line


def test_no_token_anywhere_is_one_line(token_cluster, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(home, tmp_path / "procs")
    line = _one_line(rerun_test(token_cluster, env, tmp_path / "run", CROSS_NODE), "rerun-test")
    assert "requires token authentication and this process has no token" in line, line
    # Token mode without a token would make Ray abort the process: it is caught before Ray sees it.
    env["RAY_AUTH_MODE"] = "token"
    line = _one_line(rerun_test(token_cluster, env, tmp_path / "run2", CROSS_NODE), "rerun-test")
    assert ": auth: RAY_AUTH_MODE=token but no token" in line, line


def _system_python_differs() -> str | None:
    if not SYSTEM_PYTHON.exists():
        return f"{SYSTEM_PYTHON} is not installed"
    version = subprocess.run(
        [str(SYSTEM_PYTHON), "-c", "import platform; print(platform.python_version())"], capture_output=True, text=True
    ).stdout.strip()
    import platform

    return None if version != platform.python_version() else f"{SYSTEM_PYTHON} is Python {version} too"


def test_a_client_python_other_than_the_clusters_is_one_line_with_both(token_cluster, home_with_token, tmp_path):
    reason = _system_python_differs()
    if reason:
        pytest.skip(f"needs an interpreter whose Python differs from the venv's: {reason}")
    import ray

    site = Path(ray.__file__).resolve().parent.parent  # the venv's packages, under the system interpreter
    env = clean_env(
        home_with_token, tmp_path / "procs", RAY_AUTH_MODE="token", PYTHONPATH=os.pathsep.join([str(REPO), str(site)])
    )
    done = subprocess.run(
        [
            str(SYSTEM_PYTHON),
            "-m",
            "harness.commands.rerun",
            "--ray-address",
            token_cluster.address,
            "--run-dir",
            str(tmp_path / "run"),
            CROSS_NODE,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = _one_line(Done(done.returncode, done.stdout + done.stderr), "rerun-test")
    import platform

    theirs = subprocess.run(
        [str(SYSTEM_PYTHON), "-c", "import platform; print(platform.python_version())"], capture_output=True, text=True
    ).stdout.strip()
    assert f": version: Python {theirs} here ({SYSTEM_PYTHON}), {platform.python_version()} on the cluster" in line, (
        line
    )


def test_a_node_with_another_sglang_is_named_by_doctor_and_stops_rerun_test(token_cluster, home_with_token, tmp_path):
    other = "0.5.22" if SUPPORTED_VERSION != "0.5.22" else "0.5.21"
    # The node's sglang is another tree: the installed package's files linked, its version file
    # saying another release (only the checks run there, no suite).
    stub = tmp_path / "other-sglang"
    real = Path(importlib.util.find_spec("sglang").origin).parent
    (stub / "sglang").mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name not in ("_version.py", "__pycache__"):
            (stub / "sglang" / entry.name).symlink_to(entry)
    (stub / "sglang" / "_version.py").write_text(f'__version__ = version = "{other}"\n')
    path = os.pathsep.join([str(stub)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    node = token_cluster.add_node(num_gpus=1, env={"RAY_AUTH_MODE": "token", "PYTHONPATH": path})
    try:
        env = clean_env(home_with_token, tmp_path / "procs", RAY_AUTH_MODE="token")
        done = harness(
            env,
            "doctor",
            TOPOLOGY,
            "--ray-address",
            token_cluster.address,
            "--json",
            "--run-dir",
            str(tmp_path / "doctor"),
        )
        rows = json.loads(done.out[done.out.index("{") :])["rows"]
        [driver] = [r for r in rows if r["check"] == "software.driver"]
        assert driver["status"] == "failed"
        assert (
            f"node{node.index}/" in driver["detail"]
            and f"sglang {other} there, {SUPPORTED_VERSION} here" in driver["detail"]
        )
        line = _one_line(rerun_test(token_cluster, env, tmp_path / "run", CROSS_NODE), "rerun-test")
        assert (
            f": version skew: node{node.index}/" in line and f"sglang {other} there, {SUPPORTED_VERSION} here" in line
        ), line
        assert not (tmp_path / "run" / "groups").exists(), "a group started on a skewed cluster"
    finally:
        token_cluster.remove_node(node)
