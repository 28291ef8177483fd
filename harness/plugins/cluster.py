"""pytest plugin concern: the session's Ray cluster and run directory, and workers placed on the cluster.

Fixtures ``run_dir``, ``ray_cluster`` (started on first use, stopped at the end) and ``pd_workers`` (workers
in the topology's placement groups, stopped after the test). A topology that cannot be placed skips the
test saying what it needs. Teardown runs on failure, timeout and Ctrl-C. Each fixture in detail:
docs/modules.md.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator

import pytest

from harness import rundir
from harness import topology as topology_mod
from harness.plugins.failfast import own_workers
from harness.plugins.state import HarnessState, state
from harness.plugins.target import target
from harness.targets.sglang import selection
from harness.targets.sglang.selection import Target

if TYPE_CHECKING:
    from harness.cluster import Cluster, Placement
    from harness.workers import InProcess, Subprocess, Worker

    Payload = InProcess | Subprocess

log = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def run_dir(pytestconfig: pytest.Config) -> rundir.RunDir:
    """The session's run directory (``--run-dir``, default ``runs/<timestamp>-<pid>``)."""
    return state(pytestconfig).run_dir()


@pytest.fixture(scope="session")
def ray_cluster(pytestconfig: pytest.Config) -> Iterator[Cluster]:
    """The session's Ray cluster: joined (``--ray-address``) or started here (and stopped at the end)."""
    st = state(pytestconfig)
    cluster = st.get_cluster()
    yield cluster
    if st.cluster is cluster:
        st.cluster = None
        cluster.shutdown()


class PdWorkers:
    """Start workers of a topology's roles in its placement groups; everything is stopped after the test.

    ``pd_workers(role, payload, group=0, rank=0, name=None, **spec)`` starts one worker running the
    session's sglang target (``spec``:
    the other :class:`harness.workers.WorkerSpec` fields: ports, ready, ready_timeout, env, ...);
    ``pd_workers.role(role, payload, **spec)`` starts one per rank of every group of the role
    (``payload`` may be a function ``(group, rank) -> payload``).
    """

    def __init__(
        self,
        state: HarnessState,
        cluster: Cluster,
        topology: topology_mod.Topology,
        run_dir: rundir.RunDir,
        sglang: Target,
    ):
        self._state = state
        self.sglang = sglang
        self.cluster = cluster
        self.topology = topology
        self.run_dir = run_dir
        self._placement: Placement | None = None
        self.workers: list[Worker] = []

    @property
    def placement(self) -> Placement:
        """The topology's placement (placed on first use)."""
        if self._placement is None:
            self._placement = self.cluster.place(self.topology)
        return self._placement

    def __call__(
        self, role: str, payload: Payload, *, group: int = 0, rank: int = 0, name: str | None = None, **spec: Any
    ) -> Worker:
        from harness.workers import WorkerSpec, start_worker

        groups = self.placement.of(role)
        if not 0 <= group < len(groups):
            raise IndexError(f"role {role} has {len(groups)} group(s); group={group} does not exist")
        g = groups[group]
        if not 0 <= rank < len(g.bundles):
            raise IndexError(f"group {g.name} has {len(g.bundles)} rank(s); rank={rank} does not exist")
        wname = self._state.unique_name(name or f"{role}-{group}-{rank}")
        ws = selection.worker_spec(
            WorkerSpec(name=wname, payload=payload, run_dir=self.run_dir.root, **spec), self.sglang
        )
        w = start_worker(ws, g, rank)
        self.workers.append(w)
        self._state.watch(w)
        return w

    def role(self, role: str, payload: Payload | Callable[[int, int], Payload], **spec: Any) -> list[Worker]:
        out = []
        for gi, g in enumerate(self.placement.of(role)):
            for rank in range(len(g.bundles)):
                p = payload(gi, rank) if callable(payload) else payload
                out.append(self(role, p, group=gi, rank=rank, **spec))
        return out

    def close(self) -> None:
        for w in reversed(self.workers):
            self._state.unwatch(w)
            try:
                w.stop()
            except Exception as e:  # keep stopping the others; the session close retries
                log.warning("stopping %s: %r", w.name, e)
        if self._placement is not None:
            self.cluster.release(self._placement)
            self._placement = None


@pytest.fixture
def pd_workers(
    request: pytest.FixtureRequest, topology: topology_mod.Topology, run_dir: rundir.RunDir
) -> Iterator[PdWorkers]:
    """A :class:`PdWorkers` factory on the test's topology (skips when it cannot be placed here)."""
    st = state(request.config)
    reason = st.skip_reason(topology)
    if reason:
        pytest.skip(reason)
    cluster = request.getfixturevalue("ray_cluster")
    factory = PdWorkers(st, cluster, topology, run_dir, target(request.config))
    own_workers(request.node, factory.workers)
    try:
        yield factory
    finally:
        factory.close()
