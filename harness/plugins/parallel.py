"""pytest plugin concern: running one session's tests in several processes (pytest-xdist).

Tests that share something the session keeps alive (``sglang-servers``, ``pd-pairs``) run in one process;
every other test with its module. Groups are handed out longest first so the workers finish together, and
reach xdist's scheduler through a file, because xdist's own ``loadgroup`` puts the group in the node id,
which pytest 9.2 no longer allows: pytest-dev/pytest-xdist#1386 (fix proposed in #1388). Once an xdist release
groups under pytest 9.2, the file hand-over can go. The groups, the order, the hand-over and ``-n auto``:
docs/modules.md.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import pytest

#: Workers ``-n auto`` starts at most.
MAX_AUTO_WORKERS = 4

#: Session fixtures whose tests must share one worker process, and the group each gives them.
SHARED_FIXTURES = (("sglang_servers", "sglang-servers"), ("pd_pair", "pd-pairs"))

#: Seconds an unmarked test counts for when groups are ordered: small, so marked (slow) groups go first.
UNMARKED_EST_S = 0.2

#: ``workerinput`` key: the directory the workers write their ``{node id: [group, est]}`` maps to.
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


def estimates(items: Sequence[pytest.Item]) -> dict[str, float]:
    """Each test's estimated seconds, from the closest ``est_time`` marker covering it, read as the
    rerun registry reads it: a module's or class's estimate is shared equally by the test functions
    it covers that have none of their own, and a function's by its parametrized cases;
    :data:`UNMARKED_EST_S` for a test no marker covers."""
    covered: dict[str, tuple[str, str, float]] = {}  # node id -> (marked node, function, seconds)
    for item in items:
        for node, mark in item.iter_markers_with_node("est_time"):
            try:
                seconds = float(mark.args[0])
            except (IndexError, TypeError, ValueError):
                break  # the rerun registry names a malformed marker; here it only counts as unmarked
            function = item.nodeid.split("[", 1)[0]
            covered[item.nodeid] = (function if node is item else node.nodeid, function, seconds)
            break
    functions: dict[str, set[str]] = {}
    for marked, function, _ in covered.values():
        functions.setdefault(marked, set()).add(function)
    cases = Counter(function for _, function, _ in covered.values())
    out = {}
    for item in items:
        if item.nodeid in covered:
            marked, function, seconds = covered[item.nodeid]
            out[item.nodeid] = seconds / len(functions[marked]) / cases[function]
        else:
            out[item.nodeid] = UNMARKED_EST_S
    return out


def module_of(nodeid: str) -> str:
    """The module part of a node id (``tests/test_a.py`` of ``tests/test_a.py::test_b[x]``)."""
    return nodeid.split("::", 1)[0]


def _distributing(config: pytest.Config) -> bool:
    """In the controller of a ``--dist loadgroup`` run with workers."""
    return (
        not hasattr(config, "workerinput")
        and config.pluginmanager.hasplugin("xdist")
        and config.getoption("dist", "no") == "loadgroup"
        and bool(config.getoption("numprocesses", None))
    )


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
    est = estimates(session.items)
    tmp.write_text(json.dumps({item.nodeid: [group_of(item), est[item.nodeid]] for item in session.items}))
    tmp.replace(out)


def _scheduling_class() -> type:
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's ``loadscope`` whose scopes are the groups the workers wrote (:func:`group_of`),
        handed out longest first (:func:`estimates`)."""

        def __init__(self, config: pytest.Config, log: Any, groups_dir: Path) -> None:
            super().__init__(config, log)
            self._groups_dir = groups_dir
            self._groups: dict[str, list] | None = None
            self._scope_est: dict[str, float] = {}

        def _written(self, nodeid: str) -> tuple[str, float]:
            """The group and estimate a worker wrote for ``nodeid`` (its module's group, unmarked, if none)."""
            if self._groups is None:  # first needed once every worker reported its collection
                written = sorted(self._groups_dir.glob("*.json"))
                if not written:  # tests sharing a session's servers would spread over workers
                    raise RuntimeError(f"no pytest-xdist worker wrote its test groups to {self._groups_dir}")
                self._groups = json.loads(written[0].read_text())
            group, est = self._groups.get(nodeid) or (module_of(nodeid), UNMARKED_EST_S)
            return group, est

        def _split_scope(self, nodeid: str) -> str:
            return self._written(nodeid)[0]

        def _assign_work_unit(self, node: Any) -> None:
            # The longest group left goes next (ties: xdist's order, most tests first).
            if not self._scope_est:  # the work queue holds every group before the first is handed out
                self._scope_est = {
                    scope: sum(self._written(n)[1] for n in tests) for scope, tests in self.workqueue.items()
                }
            longest = max(self.workqueue, key=lambda scope: self._scope_est.get(scope, 0.0))
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

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
