"""pytest plugin concern: the session's state (one :class:`HarnessState` per config) and the report header.

:class:`HarnessState` holds what the session shares (run directory, cluster, skip decisions, worker names,
the watchdog); other concerns reach it through :func:`state`. Configure reaps what a killed run left;
unconfigure stops everything. Detail: docs/modules.md.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from harness import rundir, runs
from harness import topology as topology_mod
from harness.plugins.options import Settings, settings
from harness.workers import procs

if TYPE_CHECKING:
    from harness.cluster import Cluster, Fit
    from harness.workers import Watchdog, Worker, WorkerDied

log = logging.getLogger(__name__)

#: The signal the watchdog thread interrupts the test's main thread with (handled in failfast).
FAILFAST_SIGNAL = signal.SIGUSR2

state_key = pytest.StashKey["HarnessState"]()


class HarnessState:
    """The session's cluster, run directory, watchdog and fail-fast arming (one per config)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.cluster: Cluster | None = None
        self.topologies: set[str] = set()
        self._run_dir: rundir.RunDir | None = None
        self._run_dir_path = settings.run_dir or rundir.default_path()
        self._watchdog: Watchdog | None = None
        self._lock = threading.Lock()
        self._armed = False
        self._pending: list[WorkerDied] = []
        self._raised: list[WorkerDied] = []
        #: Every death the watchdog reported this session, in order (a few at most: each is a test's failure).
        self.deaths: list[WorkerDied] = []
        self.workers: list[Worker] = []
        self._names: dict[str, int] = {}
        self._fits: dict[str, Fit | None] = {}
        self.ray_interrupt: WorkerDied | None = None  # a death delivered as KeyboardInterrupt through a ray.get
        self.joined: str | None = None  # the joined cluster's nodes and GPU kind, for the summary
        self._recording: runs.Recording | None = None  # a run of its own under runs/ (no --run-dir given)
        self.exitstatus: int | None = None

    @property
    def run_dir_path(self) -> Path:
        return self._run_dir_path

    def run_dir(self) -> rundir.RunDir:
        if self._run_dir is None:
            if self.settings.run_dir is None and not os.environ.get("PYTEST_XDIST_WORKER"):
                # a run of its own under runs/ (not an xdist worker's share of one): `harness runs` lists it
                self._recording = runs.begin(self._run_dir_path, ["pytest", *sys.argv[1:]])
            self._run_dir = rundir.create(self._run_dir_path)
        return self._run_dir

    # -- cluster

    def simulating(self) -> bool:
        """Whether a cluster started here gets logical GPUs (allowed and no real GPU present)."""
        from harness.cluster import local_gpus

        return self.settings.simulate and not self.settings.ray_address and local_gpus() == 0

    def get_cluster(self) -> Cluster:
        if self.cluster is None:
            from harness.cluster import Cluster

            if self.settings.ray_address:
                self.cluster = self._join(self.settings.ray_address)
            elif self.simulating():
                nodes, gpus = self._sim_shape()
                self.cluster = Cluster.start(simulate=True, nodes=nodes, gpus_per_node=gpus)
            else:
                self.cluster = Cluster.start()
        return self.cluster

    def _join(self, address: str) -> Cluster:
        """Join ``address``; a cluster this session cannot use ends the session with one line, exit 2.

        Cannot use: not joinable (unreachable, refused auth, Ray/Python mismatch) or a node whose
        versions differ from this process's. One error for the session, not one per test.
        """
        from harness.cluster import Cluster, join

        try:
            cluster = Cluster.join(address)
        except join.JoinError as e:
            pytest.exit(f"harness: {e}", returncode=2)
        error = join.skew_error(address, list(cluster.facts))
        if error is not None:
            cluster.shutdown()
            pytest.exit(f"harness: {error}", returncode=2)
        self.joined = f"joined {address}: GPUs {cluster.gpu_kind} ({join.describe(list(cluster.facts))})"
        log.info("%s", self.joined)
        return cluster

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
            checked = self.get_cluster().check(topo)
            self._fits[topo.name] = checked if (not checked.ok and checked.state == "INFEASIBLE") else None
        infeasible = self._fits[topo.name]
        # Reached only with a cluster that should hold it (joined, or simulated): say what Ray said.
        return f"{reason} ({infeasible})" if infeasible is not None else None

    # -- workers and fail-fast

    def unique_name(self, name: str) -> str:
        """``name``, or ``name-2``, ``name-3`` ... so every worker of the run has its own log file."""
        n = self._names.get(name, 0) + 1
        self._names[name] = n
        return name if n == 1 else f"{name}-{n}"

    def watch(self, worker: Worker) -> None:
        from harness.workers import Watchdog

        if self._watchdog is None:
            self._watchdog = Watchdog(self._on_death).start()
        self.workers.append(worker)
        self._watchdog.add(worker)

    def unwatch(self, worker: Worker) -> None:
        if self._watchdog is not None:
            self._watchdog.remove(worker)

    def _on_death(self, died: WorkerDied) -> None:
        # Watchdog thread: record, and interrupt the main thread if a test body is running.
        with self._lock:
            self._pending.append(died)
            self.deaths.append(died)
            if self._armed:
                signal.pthread_kill(threading.main_thread().ident or 0, FAILFAST_SIGNAL)  # the main thread runs

    def arm(self) -> list[WorkerDied]:
        """Start a test body: deaths from now on interrupt it. Returns deaths already recorded."""
        with self._lock:
            early, self._pending, self._raised = self._pending, [], []
            self._armed = True
        return early

    def disarm(self) -> list[WorkerDied]:
        """End a test body; return every death during it (raised into it or not)."""
        with self._lock:
            self._armed = False
            seen = self._raised + self._pending
            self._pending, self._raised = [], []
        return seen

    def take_for_signal(self) -> WorkerDied | None:
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
        if self._recording is not None:
            recording, self._recording = self._recording, None
            recording.end("passed" if self.exitstatus == 0 else "failed" if self.exitstatus in (1, 5) else "error")


def state(config: pytest.Config) -> HarnessState:
    """The session's :class:`HarnessState`.

    Args:
        config: the session's config.

    Returns:
        The state built at configure time.

    Raises:
        KeyError: outside a configured session (before ``pytest_configure`` or after
            ``pytest_unconfigure``); code that may run then reads ``config.stash.get(state_key)``.
    """
    return config.stash[state_key]


def pytest_configure(config: pytest.Config) -> None:
    config.stash[state_key] = HarnessState(settings(config))
    # A previous run killed with SIGKILL may have left processes: reap them (ours only), then own this run.
    try:
        procs.reap_stale()
    except procs.StateError as e:
        raise pytest.UsageError(str(e)) from None
    procs.claim()


def pytest_unconfigure(config: pytest.Config) -> None:
    st = config.stash.get(state_key, None)
    if st is not None:
        st.close()
        del config.stash[state_key]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    st = session.config.stash.get(state_key, None)
    if st is not None:
        st.exitstatus = int(exitstatus)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """On a joined cluster: the nodes and whether their GPUs were real devices or logical resources."""
    st = config.stash.get(state_key, None)
    if st is not None and st.joined:
        terminalreporter.write_line(f"harness: {st.joined}")


def pytest_report_header(config: pytest.Config) -> str:
    s = settings(config)
    ray = s.ray_address or "embedded (local, started by the harness)"
    return (
        f"harness: topology={s.topology or 'per test (marker)'}, ray={ray}, "
        f"simulate={'allowed' if s.simulate else 'off'}, "
        f"run dir={state(config).run_dir_path}"
    )
