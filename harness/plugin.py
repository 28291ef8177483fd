"""pytest plugin of the harness (installed through the ``pytest11`` entry point ``pd_harness``).

Options (group ``pd-harness``; each has an ini key, the command line wins):
    --topology NAME     (ini ``harness_topology``)    run tests on this topology only
    --simulate          (ini ``harness_simulate``)    allow Ray logical GPUs when the machine has none
    --no-simulate                                     never simulate (overrides the ini key)
    --ray-address ADDR  (ini ``harness_ray_address``) join this Ray cluster instead of starting one
    --run-dir DIR       (ini ``harness_run_dir``)     default ``runs/<timestamp>-<pid>`` in the repo

Markers:
    topology(*names): the topologies a test runs on (``topologies/NAME.toml``); with several names
        and no ``--topology`` the test is parametrized over them.
    est_time(seconds): estimated wall time, used by rerun-test to plan and shard.

Fixtures:
    topology     the test's :class:`harness.topology.Topology` (marker, ``--topology``, else ``cpu``)
    ray_cluster  the session's :class:`harness.cluster.Cluster` (started on first use, stopped at the end;
                 simulated: as many Ray nodes as the largest topology the session's markers name, 8
                 logical GPUs each; a one-node topology is kept on node 0)
    run_dir      the session's :class:`harness.rundir.RunDir` (created on first use)
    pd_workers   a :class:`PdWorkers` factory: ``pd_workers("decode", payload, group=0, rank=0, **spec)``
                 starts a worker in the topology's placement group (placed on first call) and stops
                 it, and releases the placement, after the test

A topology that cannot be placed (real GPUs missing and simulation not allowed) skips the test with
``needs 2×H100 (runner 2-gpu-h100); run with --simulate or on that runner``.

Fail-fast: a watchdog thread polls every started worker; if one (or its subprocess) dies while a
test runs, the test fails within about a second with :class:`harness.worker.WorkerDied` (name, cause,
last 50 log lines), raised in the test's main thread through SIGUSR2 — never ``os._exit``. On any
failure each worker's log tail is attached to the report. Teardown (workers stopped: SIGTERM, wait,
SIGKILL of their process groups; placement groups removed; the Ray we started stopped) runs on
failure, timeout and Ctrl-C; what a SIGKILLed run leaves behind is reaped at the next run's start.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from harness import procs, rundir
from harness import topology as topology_mod

log = logging.getLogger(__name__)

#: Concern plugins (``harness/plugins/<concern>.py``) loaded with this one: add one line each.
pytest_plugins: list[str] = ["harness.plugins.engine", "harness.plugins.pd", "harness.plugins.seeds", "harness.plugins.faults"]

_FAILFAST_SIGNAL = signal.SIGUSR2


@dataclass(frozen=True)
class Settings:
    """The plugin's settings after precedence (command line, then ini)."""

    topology: str | None
    simulate: bool
    ray_address: str | None
    run_dir: Path | None


settings_key = pytest.StashKey[Settings]()
state_key = pytest.StashKey["HarnessState"]()
item_workers_key = pytest.StashKey[list]()


# ------------------------------------------------------------------ options


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pd-harness", "PD-disaggregation harness")
    group.addoption("--topology", default=None, metavar="NAME",
                    help="run tests on this topology only (a name from `harness topology list` or a .toml path)")
    group.addoption("--simulate", action="store_true", default=None,
                    help="allow Ray logical GPUs (simulated topologies) when this machine has no GPUs")
    group.addoption("--no-simulate", dest="simulate", action="store_false",
                    help="never simulate GPUs: topologies that need missing GPUs are skipped")
    group.addoption("--ray-address", default=None, metavar="ADDR",
                    help="join the Ray cluster at ADDR (host:port) instead of starting a local one")
    group.addoption("--run-dir", default=None, metavar="DIR",
                    help="run directory for worker logs, ledgers and reports (default runs/<timestamp>-<pid>)")
    parser.addini("harness_topology", "default for --topology", default="")
    parser.addini("harness_simulate", "default for --simulate", type="bool", default=False)
    parser.addini("harness_ray_address", "default for --ray-address", default="")
    parser.addini("harness_run_dir", "default for --run-dir", default="")


def get_settings(config: pytest.Config) -> Settings:
    """Apply the precedence: command-line option, then ini key."""
    def pick(opt: str, ini: str) -> Any:
        value = config.getoption(opt)
        return value if value not in (None, "") else (config.getini(ini) or None)

    simulate = config.getoption("simulate")
    run_dir = pick("run_dir", "harness_run_dir")
    return Settings(
        topology=pick("topology", "harness_topology"),
        simulate=bool(config.getini("harness_simulate")) if simulate is None else simulate,
        ray_address=pick("ray_address", "harness_ray_address"),
        run_dir=Path(run_dir) if run_dir else None,
    )


# ------------------------------------------------------------------ session state


class HarnessState:
    """The session's cluster, run directory, watchdog and fail-fast arming (one per config)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.cluster: Any = None
        self.topologies: set[str] = set()
        self._run_dir: rundir.RunDir | None = None
        self._run_dir_path = settings.run_dir or rundir.default_path()
        self._watchdog: Any = None
        self._lock = threading.Lock()
        self._armed = False
        self._pending: list[Any] = []
        self._raised: list[Any] = []
        self.workers: list[Any] = []
        self._names: dict[str, int] = {}
        self._fits: dict[str, Any] = {}
        self.ray_interrupt: Any = None  # a death delivered as KeyboardInterrupt through a ray.get

    @property
    def run_dir_path(self) -> Path:
        return self._run_dir_path

    def run_dir(self) -> rundir.RunDir:
        if self._run_dir is None:
            self._run_dir = rundir.create(self._run_dir_path)
        return self._run_dir

    # -- cluster

    def simulating(self) -> bool:
        """Whether a cluster started here gets logical GPUs (allowed and no real GPU present)."""
        from harness.cluster import local_gpus

        return self.settings.simulate and not self.settings.ray_address and local_gpus() == 0

    def get_cluster(self) -> Any:
        if self.cluster is None:
            from harness.cluster import Cluster

            if self.settings.ray_address:
                self.cluster = Cluster.join(self.settings.ray_address)
            elif self.simulating():
                nodes, gpus = self._sim_shape()
                self.cluster = Cluster.start(simulate=True, nodes=nodes, gpus_per_node=gpus)
            else:
                self.cluster = Cluster.start()
        return self.cluster

    def _sim_shape(self) -> tuple[int, int]:
        """Simulated shape: as many nodes as the largest topology this session names (extra Ray
        nodes cost seconds), as many logical GPUs per node as any topology has (they cost nothing)."""
        def load(names: set[str]) -> list[topology_mod.Topology]:
            out = []
            for name in names:
                try:
                    out.append(topology_mod.get(name))
                except topology_mod.TopologyError:
                    continue
            return out

        named = load(self.topologies)
        every = load(set(topology_mod.names())) + named
        return max([t.nodes for t in named] or [1]), max([t.gpus_per_node for t in every] or [0])

    def skip_reason(self, topo: topology_mod.Topology) -> str | None:
        """Why ``topo`` cannot run here, or None. Starts (or joins) the cluster only when it might fit."""
        from harness.cluster import local_gpus

        reason = f"needs {topo.requirement}; run with --simulate or on that runner"
        if not topo.needs_gpus:
            return None
        if not self.settings.ray_address:
            sim = self.simulating() and topo.allow_simulation
            if not sim and (topo.nodes > 1 or local_gpus() < topo.gpus_per_node):
                return reason
            if self.cluster is not None and self.cluster.simulate and not topo.allow_simulation:
                return reason
        if topo.name not in self._fits:  # INFEASIBLE does not change during a session
            fit = self.get_cluster().check(topo)
            self._fits[topo.name] = fit if (not fit.ok and fit.state == "INFEASIBLE") else None
        fit = self._fits[topo.name]
        # Reached only with a cluster that should hold it (joined, or simulated): say what Ray said.
        return f"{reason} ({fit})" if fit is not None else None

    # -- workers and fail-fast

    def unique_name(self, name: str) -> str:
        """``name``, or ``name-2``, ``name-3`` ... so every worker of the run has its own log file."""
        n = self._names.get(name, 0) + 1
        self._names[name] = n
        return name if n == 1 else f"{name}-{n}"

    def watch(self, worker: Any) -> None:
        from harness.worker import Watchdog

        if self._watchdog is None:
            self._watchdog = Watchdog(self._on_death).start()
        self.workers.append(worker)
        self._watchdog.add(worker)

    def unwatch(self, worker: Any) -> None:
        if self._watchdog is not None:
            self._watchdog.remove(worker)

    def _on_death(self, died: Any) -> None:
        # Watchdog thread: record, and interrupt the main thread if a test body is running.
        with self._lock:
            self._pending.append(died)
            if self._armed:
                signal.pthread_kill(threading.main_thread().ident, _FAILFAST_SIGNAL)

    def arm(self) -> list[Any]:
        """Start a test body: deaths from now on interrupt it. Returns deaths already recorded."""
        with self._lock:
            early, self._pending, self._raised = self._pending, [], []
            self._armed = True
        return early

    def disarm(self) -> list[Any]:
        """End a test body; return every death during it (raised into it or not)."""
        with self._lock:
            self._armed = False
            seen = self._raised + self._pending
            self._pending, self._raised = [], []
        return seen

    def take_for_signal(self) -> Any:
        """In the signal handler (main thread): the death to raise, or None. Disarms, so one
        interrupt at most reaches the test (a second one could land inside pytest itself)."""
        with self._lock:
            if not self._armed or not self._pending:
                return None
            self._armed = False
            died = self._pending.pop(0)
            self._raised.append(died)
            return died

    def close(self) -> None:
        for w in self.workers:
            try:
                w.stop(grace=2.0)
            except Exception as e:  # keep tearing down the rest
                log.warning("stopping %s: %r", w.name, e)
        if self._watchdog is not None:
            self._watchdog.close()
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            cluster.shutdown()


def _state(config: pytest.Config) -> HarnessState:
    return config.stash[state_key]


def _failfast_handler(config: pytest.Config) -> Callable[[int, Any], None]:
    def handler(signum: int, frame: Any) -> None:
        __tracebackhide__ = True
        state = config.stash.get(state_key, None)
        died = state.take_for_signal() if state is not None else None
        if died is None:
            return
        if _in_ray(frame):
            # Ray's blocking get only gives way to KeyboardInterrupt (any other exception stays
            # pending until the get returns); the call wrapper turns it back into the WorkerDied.
            state.ray_interrupt = died
            raise KeyboardInterrupt(f"harness: worker {died.name} died")
        raise died
    return handler


_RAY_DIR = f"{os.sep}ray{os.sep}"


def _in_ray(frame: Any) -> bool:
    return frame is not None and _RAY_DIR in frame.f_code.co_filename


# ------------------------------------------------------------------ configure / unconfigure / header


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "topology(*names): topologies this test runs on (topologies/NAME.toml)")
    config.addinivalue_line("markers", "est_time(seconds): estimated wall time for planning and sharding")
    settings = get_settings(config)
    config.stash[settings_key] = settings
    config.stash[state_key] = HarnessState(settings)
    # A previous run killed with SIGKILL may have left processes: reap them (ours only), then own this run.
    procs.reap_stale()
    procs.claim()
    if threading.current_thread() is threading.main_thread():
        config.stash[_prev_handler_key] = signal.signal(_FAILFAST_SIGNAL, _failfast_handler(config))


_prev_handler_key = pytest.StashKey[Any]()


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(state_key, None)
    if state is not None:
        state.close()
        del config.stash[state_key]
    prev = config.stash.get(_prev_handler_key, None)
    if prev is not None and threading.current_thread() is threading.main_thread():
        signal.signal(_FAILFAST_SIGNAL, prev)


def _sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def pytest_report_header(config: pytest.Config) -> str:
    s = config.stash[settings_key]
    ray = s.ray_address or "embedded (local, started by the harness)"
    return (f"harness: topology={s.topology or 'per test (marker)'}, ray={ray}, "
            f"simulate={'allowed' if s.simulate else 'off'}, sglang={_sglang_version()}, "
            f"run dir={config.stash[state_key].run_dir_path}")


# ------------------------------------------------------------------ topology selection


def _marker_names(item_or_def: Any) -> tuple[str, ...]:
    m = item_or_def.get_closest_marker("topology") if hasattr(item_or_def, "get_closest_marker") else None
    return tuple(str(a) for a in m.args) if m is not None else ()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "topology" not in metafunc.fixturenames:
        return
    m = metafunc.definition.get_closest_marker("topology")
    if m is None or len(m.args) < 2 or metafunc.config.stash[settings_key].topology:
        return
    metafunc.parametrize("topology", list(m.args), indirect=True, ids=[str(a) for a in m.args])


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    state = _state(config)
    for item in items:
        state.topologies.update(_marker_names(item))
    if state.settings.topology:
        state.topologies.add(state.settings.topology)


def _pick_topology(request: pytest.FixtureRequest) -> str:
    s = request.config.stash[settings_key]
    names = _marker_names(request.node)
    param = getattr(request, "param", None)
    if param is not None:
        return str(param)
    m = request.node.get_closest_marker("topology")
    if m is not None and not names:
        pytest.fail(f'{request.node.nodeid}: @pytest.mark.topology() needs a name, e.g. topology("cpu")', pytrace=False)
    if s.topology:
        if names and s.topology not in names and Path(s.topology).stem not in names:
            pytest.skip(f"runs on {', '.join(names)}; --topology is {s.topology}")
        return s.topology
    return names[0] if names else "cpu"


@pytest.fixture
def topology(request: pytest.FixtureRequest) -> topology_mod.Topology:
    """The test's topology: its marker (or the parametrized one), ``--topology``, else ``cpu``."""
    name = _pick_topology(request)
    try:
        return topology_mod.get(name)
    except topology_mod.TopologyError as e:
        pytest.fail(f"{request.node.nodeid}: {e}", pytrace=False)


# ------------------------------------------------------------------ cluster, run dir, workers


@pytest.fixture(scope="session")
def run_dir(pytestconfig: pytest.Config) -> rundir.RunDir:
    """The session's run directory (``--run-dir``, default ``runs/<timestamp>-<pid>``)."""
    return _state(pytestconfig).run_dir()


@pytest.fixture(scope="session")
def ray_cluster(pytestconfig: pytest.Config) -> Iterator[Any]:
    """The session's Ray cluster: joined (``--ray-address``) or started here (and stopped at the end)."""
    state = _state(pytestconfig)
    cluster = state.get_cluster()
    yield cluster
    if state.cluster is cluster:
        state.cluster = None
        cluster.shutdown()


class PdWorkers:
    """Start workers of a topology's roles in its placement groups; everything is stopped after the test.

    ``pd_workers(role, payload, group=0, rank=0, name=None, **spec)`` starts one worker (``spec``:
    the other :class:`harness.worker.WorkerSpec` fields: ports, ready, ready_timeout, env, ...);
    ``pd_workers.role(role, payload, **spec)`` starts one per rank of every group of the role
    (``payload`` may be a function ``(group, rank) -> payload``).
    """

    def __init__(self, state: HarnessState, cluster: Any, topology: topology_mod.Topology, run_dir: rundir.RunDir):
        self._state = state
        self.cluster = cluster
        self.topology = topology
        self.run_dir = run_dir
        self._placement: Any = None
        self.workers: list[Any] = []

    @property
    def placement(self) -> Any:
        """The topology's placement (placed on first use)."""
        if self._placement is None:
            self._placement = self.cluster.place(self.topology)
        return self._placement

    def __call__(self, role: str, payload: Any, *, group: int = 0, rank: int = 0, name: str | None = None,
                 **spec: Any) -> Any:
        from harness.worker import WorkerSpec, start_worker

        groups = self.placement.of(role)
        if not 0 <= group < len(groups):
            raise IndexError(f"role {role} has {len(groups)} group(s); group={group} does not exist")
        g = groups[group]
        if not 0 <= rank < len(g.bundles):
            raise IndexError(f"group {g.name} has {len(g.bundles)} rank(s); rank={rank} does not exist")
        wname = self._state.unique_name(name or f"{role}-{group}-{rank}")
        ws = WorkerSpec(name=wname, payload=payload, run_dir=self.run_dir.root, **spec)
        w = start_worker(ws, g, rank)
        self.workers.append(w)
        self._state.watch(w)
        return w

    def role(self, role: str, payload: Any, **spec: Any) -> list[Any]:
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
def pd_workers(request: pytest.FixtureRequest, topology: topology_mod.Topology, run_dir: rundir.RunDir) -> Iterator[PdWorkers]:
    """A :class:`PdWorkers` factory on the test's topology (skips when it cannot be placed here)."""
    state = _state(request.config)
    reason = state.skip_reason(topology)
    if reason:
        pytest.skip(reason)
    cluster = request.getfixturevalue("ray_cluster")
    factory = PdWorkers(state, cluster, topology, run_dir)
    request.node.stash[item_workers_key] = factory.workers
    try:
        yield factory
    finally:
        factory.close()


# ------------------------------------------------------------------ fail-fast and reports


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    state = item.config.stash.get(state_key, None)
    if state is None or threading.current_thread() is not threading.main_thread():
        return (yield)
    state.ray_interrupt = None
    early = [d for d in state.arm() if _owns(item, d)]
    if early:
        state.disarm()
        raise early[0]
    __tracebackhide__ = True
    try:
        result = yield
    except KeyboardInterrupt as e:
        state.disarm()
        died, state.ray_interrupt = state.ray_interrupt, None
        if died is not None and _owns(item, died):
            raise died.with_traceback(e.__traceback__) from None  # points at the test's blocked line
        raise
    except SystemError as e:
        state.disarm()
        # The interrupt landed in C code that swallowed it until it returned, then wrapped it.
        inner = e.__cause__ or e.__context__
        if _is_worker_died(inner) and _owns(item, inner):
            raise inner.with_traceback(e.__traceback__) from None
        raise
    except BaseException:
        state.disarm()
        raise
    late = [d for d in state.disarm() if _owns(item, d)]
    if late:  # a worker died, yet the test passed: it swallowed the interrupt or ended just before it
        raise late[0]
    return result


def _is_worker_died(e: Any) -> bool:
    from harness.worker import WorkerDied

    return isinstance(e, WorkerDied)


def _owns(item: pytest.Item, died: Any) -> bool:
    return any(w.name == died.name for w in item.stash.get(item_workers_key, []))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    report = yield
    if report.failed:
        from harness.worker import TAIL_LINES

        for w in item.stash.get(item_workers_key, []):
            tail = w.tail(TAIL_LINES)
            report.sections.append((f"worker {w.name} log (last {TAIL_LINES} lines, {w.log_path})", tail or "(empty)"))
    return report

