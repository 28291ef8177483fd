"""pytest concern plugin: PD pairs of sglang-backed prefill/decode rank workers on Ray.

Fixtures ``pd_pair`` (one pair per topology, kept for the session and reconfigured per call; after a
failure the next test gets a clean pair, so one fault gives one failure) and ``pd_report`` (the run's
summary and ledger verdict in the report). Each in detail: docs/modules.md.
"""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING, Any, Callable, Iterator

import pytest

from harness import atomic, ledger
from harness import topology as topology_mod
from harness.plugins.failfast import own_workers
from harness.plugins.options import settings
from harness.plugins.state import state
from harness.plugins.target import target
from harness.rundir import RunDir

if TYPE_CHECKING:
    from harness.cluster import Cluster
    from harness.engines.sim.deploy import Deployment
    from harness.engines.sim.driver import PDPair
    from harness.engines.sim.workload import KVSpec
    from harness.workers import Worker

log = logging.getLogger(__name__)

#: On the last test of each topology group using ``pd_pair``: that group's workers stop after it.
_last_of_group_key = pytest.StashKey[bool]()
_failed_key = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    if report.failed:
        item.stash[_failed_key] = True
    return report


def _topology_of(item: pytest.Item) -> str:
    forced = settings(item.config).topology
    if forced:  # --topology: every test runs on it (or skips)
        return str(forced)
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "topology" in callspec.params:
        return str(callspec.params["topology"])
    marker = item.get_closest_marker("topology")
    return str(marker.args[0]) if marker is not None and marker.args else ""


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group the tests using ``pd_pair`` by topology (stable, in the slots they already hold), so a
    session starts each topology's workers once instead of once per switch."""
    slots = [i for i, item in enumerate(items) if "pd_pair" in getattr(item, "fixturenames", ())]
    if len(slots) < 2:
        return
    chosen = [items[i] for i in slots]
    first_seen: dict[str, int] = {}
    for item in chosen:
        first_seen.setdefault(_topology_of(item), len(first_seen))
    chosen.sort(key=lambda item: first_seen[_topology_of(item)])
    for i, item in zip(slots, chosen):
        items[i] = item
    # The last test of each topology group stops that group's workers (they hold GPUs and memory).
    for item, nxt in zip(chosen, chosen[1:] + [None]):
        item.stash[_last_of_group_key] = nxt is None or _topology_of(nxt) != _topology_of(item)


class PdPairs:
    """The session's PD deployment (at most one live at a time)."""

    def __init__(self, config: pytest.Config, run_dir: RunDir) -> None:
        self._state = state(config)
        self.run_dir = run_dir
        self.sglang = target(config)  # what the ranks run
        self.deployment: Deployment | None = None
        self.workers: list[Worker] = []
        self.dirty = False  # the last test using the pair failed: reset before the next one

    def get(self, cluster: Cluster, topology: topology_mod.Topology, spec: KVSpec) -> PDPair:
        from harness.engines.sim import deploy

        if self.deployment is not None and (self.deployment.topology.name != topology.name or self.deployment.stopped):
            self.close()
        if self.deployment is not None:
            try:
                self.deployment.pair.configure(spec, reset=self.dirty)
            except Exception as e:  # noqa: BLE001 - any failure to reset: restart rather than inherit it
                if not self.dirty:
                    raise
                log.warning("PD pair could not be reset after a failed test (%s); restarting it", e)
                self.close()
        self.dirty = False
        if self.deployment is None:
            prefix = self._state.unique_name(f"pd-{topology.name}") + "-"
            self.deployment = deploy.start(
                cluster,
                topology,
                self.run_dir.root,
                spec,
                name_prefix=prefix,
                on_start=self._watch,
                on_stop=self._state.unwatch,
                target=self.sglang,
            )
        return self.deployment.pair

    def _watch(self, worker: Worker) -> None:
        self.workers.append(worker)
        self._state.watch(worker)

    def close(self) -> None:
        if self.deployment is not None:
            self.deployment.stop()
            self.deployment = None
        self.workers.clear()


@pytest.fixture(scope="session")
def _pd_pairs_session(request: pytest.FixtureRequest, run_dir: RunDir, ray_cluster: Cluster) -> Iterator[PdPairs]:
    # Depends on ray_cluster so the workers are stopped before the cluster is.
    pairs = PdPairs(request.config, run_dir)
    yield pairs
    pairs.close()


@pytest.fixture
def pd_pair(
    request: pytest.FixtureRequest, topology: topology_mod.Topology, _pd_pairs_session: PdPairs
) -> Iterator[Callable[[Any], Any]]:
    """``pd_pair(spec)``: the session's PD pair on the test's topology, configured for ``spec``."""
    reason = state(request.config).skip_reason(topology)
    if reason:
        pytest.skip(reason)
    cluster = request.getfixturevalue("ray_cluster")
    own_workers(request.node, _pd_pairs_session.workers)

    def get(spec: Any) -> Any:
        # Ask before starting ranks: a target that cannot build these pools on the ranks' device skips
        # the test (one line naming the capability) instead of failing inside a Ray worker.
        from harness.targets.sglang import compat

        device = "cpu" if (cluster.simulate or not topology.needs_gpus) else "cuda"
        compat.require_device(device, page_size=spec.page_size, hisparse=spec.hisparse)
        return _pd_pairs_session.get(cluster, topology, spec)

    yield get
    if request.node.stash.get(_failed_key, False):
        _pd_pairs_session.dirty = True
    if request.node.stash.get(_last_of_group_key, False):
        _pd_pairs_session.close()


@pytest.fixture
def pd_report(
    request: pytest.FixtureRequest, run_dir: Any, record_property: Callable[[str, Any], None]
) -> Callable[[Any], dict]:
    """``pd_report(result)``: write and attach the summary of a :class:`harness.engines.sim.driver.RunResult`."""

    def report(result: Any) -> dict:
        summary = result.summary()
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid)
        out = run_dir.report / "pd" / f"{name}.json"
        atomic.write_text(out, json.dumps(summary, indent=2, sort_keys=True))
        text = ledger.format_summary(summary["ledger"])
        record_property("pd_summary", json.dumps({k: v for k, v in summary.items() if k != "ledger"}, sort_keys=True))
        record_property("ledger", text)
        log.info("%s\n%s", request.node.nodeid, text)
        return summary

    return report
