"""pytest plugin concern: running one session's tests in several processes (pytest-xdist).

``./dev test`` runs ``pytest -n auto --dist loadgroup``: tests are handed to worker processes a
group at a time, and this module decides the groups. Tests that share something the session keeps
alive run in the one process that holds it, in collection order, so it starts once and the test
that last uses it (which the plugin that owns it marks at collection) runs there too:

    sglang-servers  tests taking ``sglang_servers`` (the session's real server stacks, and the
                    stack of the next model started ahead of its tests)
    pd-pairs        tests taking ``pd_pair`` (the session's simulated PD pair per topology)

A test with an ``xdist_group`` marker runs in that group; every other test in its module's group,
so module-scoped fixtures start once. Without ``--dist loadgroup`` (one process, ``-n 0``, or
another ``--dist``) the groups change nothing.

How the groups reach the scheduler: which fixtures a test takes is known only where tests are
collected (the workers), and the scheduler runs in the controller, which sees node ids. Each
worker writes ``{node id: group}`` to a file in a directory the controller hands it
(``workerinput``) before it reports its collection; the controller's scheduler
(:class:`GroupScheduling`, xdist's ``loadscope`` with these groups as scopes) reads it once every
worker has collected. (xdist's own ``loadgroup`` puts the group into the node id, which pytest 9.2's
nodes no longer allow: its groups never formed.)

``-n auto`` is one worker per usable CPU, at most :data:`MAX_AUTO_WORKERS` (each worker starts its
own Ray cluster, fork servers and, for its groups, server stacks), and one on a joined cluster or a
machine with GPUs (:func:`pytest_xdist_auto_num_workers`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

#: Workers ``-n auto`` starts at most.
MAX_AUTO_WORKERS = 4

#: Session fixtures whose tests must share one worker process, and the group each gives them.
SHARED_FIXTURES = (("sglang_servers", "sglang-servers"), ("pd_pair", "pd-pairs"))

#: ``workerinput`` key: the directory the workers write their ``{node id: group}`` maps to.
GROUPS_INPUT = "harness_groups_dir"

_groups_dir_key = pytest.StashKey[Path]()


def group_of(item: pytest.Item) -> str:
    """The worker group of ``item``: its ``xdist_group`` marker's, else the session resource it
    shares, else its module's path."""
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))
    names = getattr(item, "fixturenames", ())
    for fixture, group in SHARED_FIXTURES:
        if fixture in names:
            return group
    return module_of(item.nodeid)


def module_of(nodeid: str) -> str:
    """The module part of a node id (``tests/test_a.py`` of ``tests/test_a.py::test_b[x]``)."""
    return nodeid.split("::", 1)[0]


def _distributing(config: pytest.Config) -> bool:
    """In the controller of a ``--dist loadgroup`` run with workers."""
    return (not hasattr(config, "workerinput") and config.pluginmanager.hasplugin("xdist")
            and config.getoption("dist", "no") == "loadgroup" and bool(config.getoption("numprocesses", None)))


def pytest_configure(config: pytest.Config) -> None:
    if _distributing(config):
        config.stash[_groups_dir_key] = Path(tempfile.mkdtemp(prefix="pdh-groups-"))


def pytest_unconfigure(config: pytest.Config) -> None:
    groups_dir = config.stash.get(_groups_dir_key, None)
    if groups_dir is not None:
        shutil.rmtree(groups_dir, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    groups_dir = node.config.stash.get(_groups_dir_key, None)
    if groups_dir is not None:
        node.workerinput[GROUPS_INPUT] = str(groups_dir)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    # First: xdist's own implementation reports the collection to the controller.
    workerinput = getattr(session.config, "workerinput", None)
    if not workerinput or GROUPS_INPUT not in workerinput:
        return
    out = Path(workerinput[GROUPS_INPUT]) / f"{workerinput.get('workerid', os.getpid())}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({item.nodeid: group_of(item) for item in session.items}))
    tmp.replace(out)


def _scheduling_class() -> type:
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's ``loadscope`` whose scopes are the groups the workers wrote (:func:`group_of`)."""

        def __init__(self, config: pytest.Config, log: Any, groups_dir: Path) -> None:
            super().__init__(config, log)
            self._groups_dir = groups_dir
            self._groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:  # first called once every worker reported its collection
                written = sorted(self._groups_dir.glob("*.json"))
                if not written:  # tests sharing a session's servers would spread over workers
                    raise RuntimeError(f"no pytest-xdist worker wrote its test groups to {self._groups_dir}")
                self._groups = json.loads(written[0].read_text())
            return self._groups.get(nodeid) or module_of(nodeid)

    return GroupScheduling


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    groups_dir = config.stash.get(_groups_dir_key, None)
    if groups_dir is None:
        return None
    return _scheduling_class()(config, log, groups_dir)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: one worker per CPU this process may use, at most :data:`MAX_AUTO_WORKERS`; one
    where workers would share what only one session may hold: a joined cluster (``--ray-address``:
    placement group names are unique per cluster) or real GPUs (each worker's own Ray cluster
    would hand out the same devices). xdist's ``PYTEST_XDIST_AUTO_NUM_WORKERS`` still decides first."""
    from harness.cluster import local_gpus
    from harness.plugins.options import settings

    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own implementation reads it
    if settings(config).ray_address or local_gpus():
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_AUTO_WORKERS))
