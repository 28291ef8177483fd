"""pytest plugin concern: which engine the suites run against, and the real sglang server stack fixtures.

Option (group ``pd-harness``, ini ``harness_engine``; the command line wins):
    --engine {all,sim,sglang-server}   ``sim``: in-process / simulated suites only; ``sglang-server``:
                                       only tests that start real sglang servers; ``all`` (default,
                                       what CI runs): both.

Marker:
    engine(name): the test needs engine ``name`` (``sim`` or ``sglang-server``); it is deselected when
        ``--engine`` excludes it. Unmarked tests count as ``sim``.

Fixtures:
    sglang_servers  a :class:`ServerStacks` for the test's module: ``.pd(model_name)`` returns a ready
                    real prefill + decode + router stack (started on first use, restarted if one of its
                    workers died), ``.plain(model_name, compat_patches=None)`` a ready plain server.
                    Every worker is watched by the harness's fail-fast watchdog and owned by each test
                    that uses the fixture, so a server dying mid-test fails that test within about a
                    second with ``WorkerDied`` (name, cause, log tail). At module end everything is
                    stopped and teardown asserts that no server process is left.
    tiny_model      ``tiny_model(name) -> Path``: a tiny random-weight model built locally (no hub).

Servers on a machine without the CPU stack's packages (``sglang_router``, mooncake) fail with a
message saying to run ``./dev install``.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest

from harness import topology as topology_mod

log = logging.getLogger(__name__)

ENGINES = ("sim", "sglang-server")
CHOICES = ("all", *ENGINES)
DEFAULT_ENGINE = "all"
SERVER_ENGINE = "sglang-server"
#: Packages the real CPU stack needs besides sglang (module name -> pip requirement).
STACK_MODULES = {"sglang_router": "sglang-router", "mooncake": "mooncake-transfer-engine-non-cuda"}

engine_key = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pd-harness")
    group.addoption("--engine", default=None, choices=CHOICES,
                    help="engine the suites run against: sim, sglang-server (real servers) or all (default)")
    parser.addini("harness_engine", "default for --engine (all, sim, sglang-server)", default=DEFAULT_ENGINE)


def _validate(value: str, where: str) -> str:
    if value not in CHOICES:
        raise pytest.UsageError(f"engine {value!r} from {where} is not one of {', '.join(CHOICES)}")
    return value


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "engine(name): the engine a test needs (sim or sglang-server)")
    opt = config.getoption("--engine", None)
    config.stash[engine_key] = _validate(opt, "--engine") if opt else _validate(config.getini("harness_engine"), "ini harness_engine")


def _test_engine(item: pytest.Item) -> str:
    m = item.get_closest_marker("engine")
    if m is None:
        return "sim"
    if len(m.args) != 1 or m.args[0] not in ENGINES:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.engine needs one of {', '.join(ENGINES)}")
    return str(m.args[0])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen = config.stash[engine_key]
    if chosen == "all":
        for item in items:
            _test_engine(item)  # still validate the markers
        return
    keep, drop = [], []
    for item in items:
        (keep if _test_engine(item) == chosen else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config: pytest.Config) -> str:
    return f"harness engine: {config.stash[engine_key]}"


# ------------------------------------------------------------------ fixtures


def missing_stack_modules() -> list[str]:
    """pip names of the CPU stack's packages that are not importable here."""
    return [pip for mod, pip in STACK_MODULES.items() if importlib.util.find_spec(mod) is None]


@pytest.fixture(scope="session")
def tiny_model() -> Callable[[str], Path]:
    """``tiny_model(name) -> Path``: build (once, cached in the repo-ignored ``models/``) a tiny model."""
    from harness.targets.sglang.server.models import ensure_model

    return lambda name: ensure_model(name)


class ServerStacks:
    """Real sglang servers of one test module, started on first use and stopped at module end."""

    def __init__(self, config: pytest.Config, cluster: Any, topology: topology_mod.Topology, run_dir: Any) -> None:
        from harness.plugins.state import state

        self._state = state(config)
        self.cluster = cluster
        self.topology = topology
        self.run_dir = run_dir
        self._placement: Any = None
        self._pd: dict[str, Any] = {}
        self._plain: dict[tuple[str, tuple[str, ...] | None], Any] = {}
        #: Every worker this module started (shared with each test's stash, so tests own them all).
        self.workers: list[Any] = []
        self._pids: list[int] = []

    def _own(self, worker: Any) -> None:
        self.workers.append(worker)
        if worker.info and worker.info.payload_pid:
            self._pids.append(worker.info.payload_pid)

    def _watch(self, worker: Any) -> None:
        self._own(worker)
        self._state.watch(worker)

    def _model(self, name: str) -> Path:
        from harness.targets.sglang.server.models import ensure_model

        return ensure_model(name)

    def _require_stack(self) -> None:
        missing = missing_stack_modules()
        if missing:
            pytest.fail(f"the real CPU PD stack needs {', '.join(missing)}: run ./dev install", pytrace=False)

    def pd(self, model_name: str, *, mini_lb: bool = False) -> Any:
        """A ready PD stack serving tiny model ``model_name`` (restarted if a worker of it died)."""
        from harness.targets.sglang.server.stack import start_pd_stack

        self._require_stack()
        stack = self._pd.get(model_name)
        if stack is not None and any(w.poll() for w in stack.workers):
            self._stop(stack.workers)
            stack = None
        if stack is None:
            if self._placement is None:
                self._placement = self.cluster.place(self.topology)
            names = tuple(self._state.unique_name(r) for r in ("prefill", "decode", "router"))
            stack = start_pd_stack(self.topology, self._model(model_name), self.run_dir.root, placement=self._placement,
                                   names=names, mini_lb=mini_lb, on_start=self._watch)
            self._pd[model_name] = stack
        return stack

    def forget(self, model_name: str) -> None:
        """Stop the PD stack of ``model_name`` now; a test that broke it on purpose calls this.

        Its workers stop being owned by the test, so the harness does not fail the test for the
        death it provoked and caught (the plugin fails a test that swallows a worker's death).
        """
        stack = self._pd.pop(model_name, None)
        if stack is not None:
            self._stop(stack.workers)

    def plain(self, model_name: str, compat_patches: Sequence[str] | None = None, *, watch: bool = True) -> Any:
        """A ready plain (non-PD) server of ``model_name``; ``compat_patches=()`` runs it unpatched.

        ``watch=False`` keeps it out of the fail-fast watchdog: for a test that expects it may crash.
        """
        from harness.targets.sglang.server.stack import start_plain_server

        key = (model_name, None if compat_patches is None else tuple(compat_patches))
        w = self._plain.get(key)
        if w is not None and w.poll():
            self._stop([w])
            w = None
        if w is None:
            name = self._state.unique_name("plain")
            w = start_plain_server(self.topology, self._model(model_name), self.run_dir.root, name=name,
                                   compat_patches=compat_patches, on_start=self._watch if watch else self._own)
            self._plain[key] = w
        return w

    def forget_plain(self, model_name: str, compat_patches: Sequence[str] | None = None) -> None:
        """Stop the plain server started with these arguments now (frees its memory for the next ones)."""
        w = self._plain.pop((model_name, None if compat_patches is None else tuple(compat_patches)), None)
        if w is not None:
            self._stop([w])

    def _stop(self, workers: Sequence[Any]) -> None:
        for w in workers:
            self._state.unwatch(w)
            w.stop()
            # No longer owned by the tests: a death they expected (a fault test) is not "swallowed".
            if w in self.workers:
                self.workers.remove(w)

    def close(self) -> list[int]:
        """Stop everything; return the server process ids that are still alive afterwards."""
        from harness.targets.sglang.server.stack import leftover_processes

        self._stop(list(reversed(self.workers)))
        if self._placement is not None:
            self.cluster.release(self._placement)
            self._placement = None
        return leftover_processes(self._pids)


@pytest.fixture(scope="module")
def _sglang_servers_module(request: pytest.FixtureRequest, run_dir: Any) -> Iterator[ServerStacks]:
    cluster = request.getfixturevalue("ray_cluster")
    stacks = ServerStacks(request.config, cluster, topology_mod.get("cpu"), run_dir)
    yield stacks
    left = stacks.close()
    assert not left, f"server processes left after teardown: {left}"


@pytest.fixture
def sglang_servers(request: pytest.FixtureRequest, topology: topology_mod.Topology,
                   _sglang_servers_module: ServerStacks) -> ServerStacks:
    """The module's :class:`ServerStacks`; the test owns its workers for fail-fast and log tails.

    Through ``topology`` a test marked for other topologies than ``--topology`` is skipped. Real
    servers run on the ``cpu`` topology only for now (GPU topologies need real models: not built).
    """
    from harness.plugins.failfast import own_workers

    if topology.needs_gpus:
        raise pytest.UsageError(f"{request.node.nodeid}: real-server suites run on the cpu topology only, "
                                f"not {topology.name}")
    own_workers(request.node, _sglang_servers_module.workers)
    return _sglang_servers_module
