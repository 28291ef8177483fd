"""pytest plugin concern: real sglang server stacks for the real-server suites, shared by the session.

Fixtures ``sglang_servers`` (the session's :class:`~harness.engines.server.stack_pool.StackPool`: ready PD
stacks and plain servers per model, kept for the session, reset and checked after each test) and
``tiny_model``. Real servers never run on simulated GPUs. The fixture's life (sharing, reset, one model at
a time, prestart) and its skips: docs/modules.md.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import pytest

from harness import topology as topology_mod
from harness.plugins.engine import MODEL_OPTION, models_key, server_kwargs
from harness.plugins.stackwatch import StackWatcher
from harness.plugins.stacks import session_stacks
from harness.rundir import RunDir

if TYPE_CHECKING:
    from harness.cluster import Cluster
    from harness.engines.server.stack_pool import StackPool

log = logging.getLogger(__name__)

REAL_GPU_REASON = (
    "real sglang servers need real GPUs: run with --topology {topology} on a GPU machine "
    "without --simulate, and {models}"
)

#: On the last test that names a model (per model): the models whose servers stop after it.
_last_use_key = pytest.StashKey[set]()
_order_key = pytest.StashKey[list]()


JOINED_LOGICAL_REASON = (
    "real sglang servers need real GPUs: the Ray cluster at {address} has logical ones "
    "(Ray GPU resources on nodes without the devices: {nodes}); join a cluster whose nodes have them"
)


@pytest.fixture(scope="session")
def tiny_model() -> Callable[[str], Path]:
    """``tiny_model(name) -> Path``: build (once, cached in the repo-ignored ``models/``) a tiny model."""
    from harness.engines.server.models import ensure_model

    return lambda name: ensure_model(name)


class SessionServers:
    """The session's stack pools (:class:`~harness.engines.server.stack_pool.StackPool`), one per (topology,
    module ``server_args``)."""

    def __init__(self, config: pytest.Config, cluster: Cluster, run_dir: RunDir) -> None:
        self._config = config
        self._cluster = cluster
        self._run_dir = run_dir
        self._stacks: dict[tuple[str, tuple[str, ...]], StackPool] = {}

    def on(self, topology: topology_mod.Topology, server_args: Sequence[str] = ()) -> StackPool:
        """The stacks on ``topology`` whose servers get ``server_args`` (created on first use)."""
        key = (topology.name, tuple(server_args))
        if key not in self._stacks:
            stacks = self._stacks[key] = session_stacks(
                self._config,
                self._cluster,
                topology,
                self._run_dir,
                models=self._config.stash[models_key],
                server_args=server_args,
            )
            stacks.order = [
                m
                for m, args, names in self._config.stash.get(_order_key, [])
                if args == tuple(server_args) and (not names or topology.name in names)
            ]
        return self._stacks[key]

    def stop_model(self, model_name: str) -> None:
        """Stop ``model_name``'s servers everywhere."""
        for stacks in self._stacks.values():
            stacks.stop_model(model_name)

    def close(self) -> list[int]:
        """Stop every server; return the server process ids still alive."""
        return [pid for stacks in self._stacks.values() for pid in stacks.close()]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "spends_stack: the test kills a server of its model's shared stack (the one "
        "sglang_servers.pd(model) gives) on purpose; it runs after every other test "
        "that takes the servers and names that model, so the stack starts once",
    )


def spenders_last(items: list[pytest.Item]) -> None:
    """Move each ``spends_stack`` test (in place, keeping their order) to right after the last other test that
    takes the servers and names one of its models. A stack spent in the middle of its model's tests is
    started again for the tests after it (tens of seconds each time, on the one worker that runs every
    real-server test)."""

    def models(item: pytest.Item) -> set[str]:
        if "sglang_servers" not in getattr(item, "fixturenames", ()):
            return set()
        return set(server_kwargs(item).get("models", ()))

    served = {item: models(item) for item in items}
    spenders = [item for item in items if served[item] and item.get_closest_marker("spends_stack") is not None]
    for n, spender in enumerate(spenders):
        # The tests it must follow: the others of its models, and the spenders already moved (keeping their order).
        before = [
            item for item in items if served[item] & served[spender] and (item not in spenders or item in spenders[:n])
        ]
        if before and items.index(before[-1]) > items.index(spender):
            items.remove(spender)
            items.insert(items.index(before[-1]) + 1, spender)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run each ``spends_stack`` test after its model's other tests (:func:`spenders_last`); then remember,
    per model, the last test that takes the servers and names it (its servers are stopped after that
    test), and the order the models are served in (the next one's stack starts ahead of its tests)."""
    spenders_last(items)
    last: dict[str, pytest.Item] = {}
    order: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = []
    for item in items:
        if "sglang_servers" not in getattr(item, "fixturenames", ()):
            continue
        kwargs = server_kwargs(item)
        marker = item.get_closest_marker("topology")
        topologies = tuple(marker.args) if marker else ()
        for name in kwargs.get("models", ()):
            last[name] = item
            entry = (name, tuple(kwargs.get("server_args", ())), topologies)
            if not order or order[-1] != entry:
                order.append(entry)
    for name, item in last.items():
        item.stash.setdefault(_last_use_key, set()).add(name)
    config.stash[_order_key] = order
    if order and not hasattr(config, "workerinput"):
        preload_fork_server(config, [t for _, _, topologies in order for t in topologies])


def fork_server_topology(
    topologies: Sequence[str], session_topology: str | None, ray_address: str | None
) -> topology_mod.Topology | None:
    """The topology whose CPU servers this session will start here (see :func:`preload_fork_server`),
    or None: on a joined cluster (``ray_address``), when every topology named needs GPUs, or when the
    session runs another topology only (``--topology``: tests marked for others are skipped).

    >>> fork_server_topology(["cpu"], None, None).name, fork_server_topology(["cpu"], "2-gpu-h100", None)
    ('cpu', None)
    >>> fork_server_topology(["8-gpu-h200"], None, None), fork_server_topology(["cpu"], None, "10.0.0.1:6379")
    (None, None)
    """
    if ray_address:
        return None
    names = list(dict.fromkeys(topologies)) or ([session_topology] if session_topology else [])
    if session_topology:
        names = [n for n in names if n == session_topology]
    try:
        return next((t for t in (topology_mod.get(n) for n in names) if not t.needs_gpus), None)
    except topology_mod.TopologyError:
        return None


def preload_fork_server(config: pytest.Config, topologies: Sequence[str]) -> threading.Thread | None:
    """Start the server fork server now, in the background, when this session will start real CPU
    servers on a cluster it starts itself: its preload (the server graph's imports, about 8 CPU-s)
    then overlaps the session's collection, Ray's start and the tests before the first stack, instead
    of starting with that first stack. Not in a pytest-xdist worker: every worker collects every test,
    and only the one given the server tests starts servers.

    Args:
        config: the session's config.
        topologies: the topologies the server tests are marked for (none: the session's ``--topology``).

    Returns:
        The thread starting it, or None (a joined cluster, servers with GPUs, fork starts off).
    """
    from harness.plugins.options import settings
    from harness.engines.server import stack

    opts = settings(config)
    cpu = fork_server_topology(topologies, opts.topology, opts.ray_address)
    if cpu is None:
        return None
    thread = threading.Thread(
        target=stack.share_fork_server,
        args=(cpu,),
        kwargs={"advertise": False},
        name="server-fork-server-preload",
        daemon=True,
    )
    thread.start()
    return thread


def server_skip_reason(st: Any, topology: topology_mod.Topology, models: Sequence[str]) -> str | None:
    """Why real servers of ``topology`` cannot run here, or None.

    Real servers need real GPUs: logical (simulated) ones, or too few local ones without a joined
    cluster, give :data:`REAL_GPU_REASON`; a joined cluster whose nodes report no devices for their
    GPU resources gives :data:`JOINED_LOGICAL_REASON`. Otherwise the session's own decision for the topology
    applies (:meth:`harness.plugins.state.HarnessState.skip_reason`: fit on the joined cluster).

    Args:
        st: the session's ``HarnessState``.
        topology: the test's topology.
        models: the logical models the test serves (for the reason's ``--model`` hint).

    Returns:
        The skip reason, or None when the servers may run.
    """
    from harness.cluster import local_gpus

    if not topology.needs_gpus:
        return None
    simulated = st.cluster is not None and st.cluster.simulate
    if simulated or (not st.settings.ray_address and (topology.nodes > 1 or local_gpus() < topology.gpus_per_node)):
        hint = " ".join(f"{MODEL_OPTION} {m}=PATH" for m in models) or f"{MODEL_OPTION} NAME=PATH for each model"
        return REAL_GPU_REASON.format(topology=topology.name, models=hint)
    if st.settings.ray_address and st.get_cluster().gpu_kind == "logical":
        return JOINED_LOGICAL_REASON.format(address=st.settings.ray_address, nodes=st.joined or "")
    return st.skip_reason(topology)


@pytest.fixture(scope="session")
def _sglang_servers_session(request: pytest.FixtureRequest, run_dir: Any) -> Iterator[SessionServers]:
    # ray_cluster is asked for here, not as a parameter, so a skipped test never starts Ray; asked
    # for during this fixture's set-up, it is torn down after the servers are stopped.
    cluster = request.getfixturevalue("ray_cluster")
    servers = SessionServers(request.config, cluster, run_dir)
    yield servers
    left = servers.close()
    assert not left, f"server processes left after teardown: {left}"


def _record_releases(item: pytest.Item, stacks: StackPool, since: float) -> None:
    """How the deferred releases during the test ended, from the servers' phase trace, as the JUnit
    property ``deferred_releases`` (``drained=N timeout=M``): a release by timeout while prefill's
    bytes may still land is a finding the in-flight suites look for."""
    from harness.engines import phases

    if stacks.run_dir is None:
        return
    ended = phases.release_outcomes(m for m in phases.read_trace(stacks.run_dir.ledger) if m.t >= since)
    if ended:
        item.user_properties.append(("deferred_releases", " ".join(f"{k}={v}" for k, v in sorted(ended.items()))))


def _record_resurrected(item: pytest.Item, ledger_dir: Path, since: float) -> None:
    """sglang's resurrected-room race hit by chance during the test (a room its sender cleared, put back:
    the reset counted it apart and named it, ``engines/server/races.py``): a JUnit ``known_race`` property
    and a warning, not a failure. The strict xfail that forces it: :data:`harness.plugins.explain.KNOWN_RACES`."""
    import warnings

    from harness.engines.server.races import kept_since
    from harness.plugins.explain import KNOWN_RACES, KnownRaceWarning

    new = kept_since(ledger_dir, since)
    if new:
        line = f"{KNOWN_RACES['a resurrected room']}: {', '.join(new[:5])}"
        item.user_properties.append(("known_race", line))
        warnings.warn(KnownRaceWarning(f"{item.nodeid}: {line}"), stacklevel=1)


@pytest.fixture
def sglang_servers(request: pytest.FixtureRequest, topology: topology_mod.Topology) -> Iterator[StackPool]:
    """The session's :class:`~harness.engines.server.stack_pool.StackPool` on the test's topology with its
    module's ``server_args``; the test owns their workers, and the servers it used are reset (and checked)
    after it.

    Through ``topology`` a test marked for other topologies than ``--topology`` is skipped; a GPU
    topology without real GPUs here is skipped with what it needs (before Ray starts). On a GPU
    topology every model the marker names must be given, else the test fails before anything starts.
    """
    from harness.plugins.failfast import own_workers
    from harness.plugins.state import state

    kwargs = server_kwargs(request.node)
    models = kwargs.get("models", ())
    reason = server_skip_reason(state(request.config), topology, models)
    if reason:
        pytest.skip(reason)
    session: SessionServers = request.getfixturevalue("_sglang_servers_session")
    stacks = session.on(topology, kwargs.get("server_args", ()))
    if topology.needs_gpus:
        for name in models:
            stacks.model(name)
    own_workers(request.node, stacks.workers)
    began = time.time()
    watcher = StackWatcher(stacks, state(request.config).deaths, request.node)
    try:
        yield stacks
    finally:
        watcher.stop()
    problems = stacks.reset_used()
    _record_releases(request.node, stacks, began)
    if stacks.run_dir is not None:
        _record_resurrected(request.node, stacks.run_dir.ledger, began)
    for name in request.node.stash.get(_last_use_key, set()) & set(models):
        session.stop_model(name)
    from harness.plugins.explain import known_race_key

    if problems and request.node.stash.get(known_race_key, None):
        # The test stalled on a known upstream race (reported xfailed with its proof): what its servers
        # then hold is that race's aftermath (e.g. the stuck room's state in prefill's KV manager). The
        # servers that failed their reset were stopped (reset_used); the findings go into JUnit.
        request.node.user_properties.append(("reset_after_known_race", " | ".join(problems)[:2000]))
        log.warning("reset after a known race in %s: %s", request.node.nodeid, problems)
        problems = []
    assert not problems, "server reset after the test failed:\n" + "\n".join(problems)
