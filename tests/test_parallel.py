"""Tests in several processes (``./dev test``: pytest-xdist, groups from harness/plugins/parallel.py).

A session's real servers and PD pairs live in one process: every test using them must run there,
whatever module it is in, and a module's tests run together. The runs below spread many small
modules over two workers; without the groups, tests land wherever a worker is free.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET

import pytest

from harness.plugins import parallel

pytestmark = pytest.mark.est_time(8)

pytest_plugins = ["pytester"]

MODULES = 6

# Stand-ins named like the plugin's shared fixtures: what matters is that tests take them.
CONFTEST = """
import json, os, pytest

@pytest.fixture
def sglang_servers(): return "servers"

@pytest.fixture
def pd_pair(): return "pair"

@pytest.fixture(autouse=True)
def _where(request):
    yield
    with open(os.environ["WHERE"], "a") as f:
        f.write(json.dumps([request.node.nodeid, os.getpid()]) + "\\n")
"""

MODULE = """
import pytest
def test_servers_a(sglang_servers): pass
def test_plain_a(): pass
def test_pair(pd_pair): pass
@pytest.mark.parametrize("n", [1, 2])
def test_plain_b(n): pass
def test_servers_b(sglang_servers): pass
"""


def _where(path) -> dict[str, int]:
    return dict(json.loads(line) for line in path.read_text().splitlines())


def test_shared_session_fixtures_and_modules_each_run_in_one_worker(pytester, monkeypatch):
    pytester.makeconftest(CONFTEST)
    for i in range(MODULES):
        pytester.makepyfile(**{f"test_m{i}": MODULE})
    where = pytester.path / "where.jsonl"
    monkeypatch.setenv("WHERE", str(where))
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", f"--junitxml={junit}"
    )
    result.assert_outcomes(passed=6 * MODULES)
    pid = _where(where)
    assert len(pid) == 6 * MODULES
    servers = {p for n, p in pid.items() if "test_servers" in n}
    pairs = {p for n, p in pid.items() if "test_pair" in n}
    assert len(servers) == 1 and len(pairs) == 1, pid
    for i in range(MODULES):
        assert len({p for n, p in pid.items() if n.startswith(f"test_m{i}.py::test_plain")}) == 1, pid
    assert len(set(pid.values())) == 2, "both workers got groups"
    # Node ids everywhere are the tests' own: no group written into them.
    names = {f"{c.get('classname')}::{c.get('name')}" for c in ET.parse(junit).iter("testcase")}
    assert "test_m0::test_plain_b[1]" in names and not any("@" in n for n in names)
    assert not any("@" in n for n in pid)


def test_one_process_and_other_dist_modes_are_left_alone(pytester, monkeypatch):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_m0=MODULE)
    where = pytester.path / "where.jsonl"
    monkeypatch.setenv("WHERE", str(where))
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "0").assert_outcomes(passed=6)
    assert len(set(_where(where).values())) == 1
    where.unlink()
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--dist", "load").assert_outcomes(passed=6)
    assert len(_where(where)) == 6


@pytest.mark.parametrize(("cpus", "workers"), [(1, 1), (2, 2), (16, parallel.MAX_AUTO_WORKERS)])
def test_auto_is_one_worker_per_usable_cpu_up_to_the_cap(monkeypatch, pytestconfig, cpus, workers):
    from harness import cluster

    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(cluster, "local_gpus", lambda: 0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert parallel.pytest_xdist_auto_num_workers(pytestconfig) == workers
    # Real GPUs: every worker's own Ray cluster would hand out the same devices.
    monkeypatch.setattr(cluster, "local_gpus", lambda: 8)
    assert parallel.pytest_xdist_auto_num_workers(pytestconfig) == 1
    # xdist's own variable decides first (its implementation reads it).
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert parallel.pytest_xdist_auto_num_workers(pytestconfig) is None


def test_auto_on_a_joined_cluster_is_one_worker(pytester):
    # Placement group names are unique per Ray cluster: two workers joining one would clash.
    pytester.makeconftest("""
        from harness.plugins import parallel
        def pytest_configure(config):
            print("AUTO", parallel.pytest_xdist_auto_num_workers(config))
    """)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-s", "--ray-address", "127.0.0.1:1", "--collect-only", "-q", "-p", "no:xdist"
    )
    result.stdout.fnmatch_lines(["AUTO 1"])


ESTIMATED = """
import pytest
pytestmark = pytest.mark.est_time(10)

def test_a(): pass

@pytest.mark.parametrize("n", [1, 2])
def test_b(n): pass

@pytest.mark.est_time(3)
def test_c(): pass

class TestD:
    pytestmark = pytest.mark.est_time(4)
    def test_e(self): pass
    def test_f(self): pass
"""


def test_estimates_share_a_marker_as_the_rerun_registry_does(pytester):
    items = pytester.getitems(ESTIMATED)
    est = {item.nodeid.split("::", 1)[1]: v for item, v in zip(items, parallel.estimates(items).values())}
    # The module's 10 s: half to test_a, half to test_b's two cases; test_c and the class have their own.
    assert est == {
        "test_a": 5.0,
        "test_b[1]": 2.5,
        "test_b[2]": 2.5,
        "test_c": 3.0,
        "TestD::test_e": 2.0,
        "TestD::test_f": 2.0,
    }
    plain = pytester.makepyfile(test_plain="def test_x(): pass")
    assert list(parallel.estimates(pytester.getitems(plain)).values()) == [parallel.UNMARKED_EST_S]


SLOW = """
import pytest
@pytest.mark.est_time(60)
def test_slow(): pass
"""


def test_the_longest_group_goes_first_even_with_the_fewest_tests(pytester, monkeypatch):
    """xdist's own order (most tests first) would start the one-test module last."""
    pytester.makeconftest(CONFTEST)
    for i in range(MODULES):
        pytester.makepyfile(**{f"test_m{i}": MODULE})
    pytester.makepyfile(test_z_slow=SLOW)
    where = pytester.path / "where.jsonl"
    monkeypatch.setenv("WHERE", str(where))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup")
    result.assert_outcomes(passed=6 * MODULES + 1)
    ran = [json.loads(line) for line in where.read_text().splitlines()]
    slow_pid = dict(ran)["test_z_slow.py::test_slow"]
    assert [n for n, p in ran if p == slow_pid][0] == "test_z_slow.py::test_slow", ran
