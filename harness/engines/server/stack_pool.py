"""A pool of real sglang PD stacks on one topology (:class:`StackPool`), shared by whoever asks for the same
model and flags: started on first use (the next model's ahead, on CPU), reset through sglang's own
``/flush_cache`` with the probe's ledger checked, restarted when a worker died, stopped by model or at the end.

It knows nothing of pytest: the caller hands it callbacks (watch, unwatch, unique_name, fail). The pytest
plugin builds one from its session (:mod:`harness.plugins.stacks`) and ``bench/soak.py`` one of its own.
Over 400 lines: one lifecycle (start ahead, share, reset, stop) over one shared state.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import signal
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, NoReturn, Sequence

from harness import topology as topology_mod
from harness.clock import wait_for
from harness.engines.server.stack import missing_stack_modules
from harness.rundir import RunDir

if TYPE_CHECKING:
    from harness.cluster import Cluster, Placement
    from harness.engines.server.pd_stack import PdStack
    from harness.workers import PlacementBundles, Worker

log = logging.getLogger(__name__)

#: Seconds a reset may wait for a server to go idle (a request still finishing) and flush.
RESET_TIMEOUT_S = 30.0


#: Placement group names are unique in a Ray cluster: one number per placement started ahead, per process.
_AHEAD_LABELS = itertools.count(1)


class StackPoolError(RuntimeError):
    """What the default ``fail`` callback raises: a model that cannot be resolved, the stack's packages missing."""


#: A PD stack start may take this many times the session's normal start before it is replaced ...
START_FACTOR = 4.0
#: ... but never less than this (seconds): a loaded 2-core runner starts a stack in 30 to 90 s.
START_FLOOR_S = 180.0


def _raise(message: str) -> NoReturn:
    raise StackPoolError(message)


def _ignore(worker: Worker) -> None:
    pass


def counted_names(prefix: str = "") -> Callable[[str], str]:
    """A ``unique_name`` callback: ``<prefix><name>``, then ``<prefix><name>-2``, ``-3`` ... (one log file each).

    >>> name = counted_names("soak-"); name("decode"), name("decode"), name("router")
    ('soak-decode', 'soak-decode-2', 'soak-router')
    """
    counts: dict[str, int] = {}

    def name(role: str) -> str:
        n = counts[role] = counts.get(role, 0) + 1
        return f"{prefix}{role}" if n == 1 else f"{prefix}{role}-{n}"

    return name


class StackPool:
    """Real sglang servers on one topology with one set of module flags, started on first use and
    kept until :meth:`stop_model` or :meth:`close`.

    Args:
        cluster: where the servers are placed (None: only resolve models and flags).
        topology: the servers' topology.
        run_dir: the run directory (worker logs, ledgers).
        models: logical model name -> directory (others: :func:`harness.engines.server.modelmap.resolve`).
        server_args: flags every server gets.
        watch: called with each worker handed out (a watchdog's add: its death fails the caller).
        unwatch: called with each worker before it is stopped or killed on purpose (the watchdog's remove).
        unique_name: role -> a worker name unique in the run (each worker has its own log file); default
            :func:`counted_names`.
        fail: raises the error for a model that cannot be resolved or a missing package (never returns);
            by default :class:`StackPoolError`.
    """

    def __init__(
        self,
        cluster: Cluster | None,
        topology: topology_mod.Topology,
        run_dir: RunDir | None,
        *,
        models: Mapping[str, Path] | None = None,
        server_args: Sequence[str] = (),
        watch: Callable[[Worker], None] = _ignore,
        unwatch: Callable[[Worker], None] = _ignore,
        unique_name: Callable[[str], str] | None = None,
        fail: Callable[[str], NoReturn] = _raise,
    ) -> None:
        from harness.engines.server.layout import server_layout
        from harness.engines.server.stack import DEFAULT_READY_TIMEOUT_S, GPU_READY_TIMEOUT_S

        self._watch_worker = watch
        self._unwatch = unwatch
        self._unique_name = unique_name or counted_names()
        self._fail = fail
        self.cluster = cluster
        self.topology = topology
        self.run_dir = run_dir
        self.models = dict(models or {})
        self.server_args = tuple(server_args)
        self.layout = server_layout(topology)
        self.ready_timeout = GPU_READY_TIMEOUT_S if topology.needs_gpus else DEFAULT_READY_TIMEOUT_S
        #: Servers start as forks of a process that imported their third-party modules once.
        self.forkserver = cluster is not None and cluster.starts_forked("server", topology)
        self._placement: Placement | None = None
        self._pd: dict[tuple[str, tuple[tuple[str, tuple[str, ...]], ...]], PdStack] = {}
        self._plain: dict[tuple[str, tuple[str, ...] | None], Worker] = {}
        #: Keys of the stacks and plain servers handed out since :meth:`reset_used` last ran.
        self._used: set[tuple[str, Any]] = set()
        #: Every worker started and not stopped (shared with each test's stash, so tests own them all).
        self.workers: list[Worker] = []
        self._pids: list[int] = []
        #: The models later tests serve here, in test order (:meth:`prestart_next` starts the next one).
        self.order: list[str] = []
        #: PD stacks (and their plain baselines) starting ahead of their first test: key -> (future, started).
        self._ahead: dict[tuple, tuple[concurrent.futures.Future, list[Worker]]] = {}
        self._ahead_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._more_placements: list[Placement] = []
        #: Models whose stack a test took from a start ahead (a record for the report and tests).
        self.taken_ahead: list[str] = []
        #: Seconds each PD stack start of this session took (the normal start bounds the next ones).
        self._starts: list[float] = []

    def pd_stacks(self) -> list[PdStack]:
        """The PD stacks started and not stopped, for watchers beside a test (a snapshot)."""
        return list(self._pd.values())

    def _own(self, worker: Worker) -> None:
        self.workers.append(worker)
        self._launched(worker)

    def _launched(self, worker: Worker) -> None:
        """Count a worker's payload in close()'s leftover check from its launch on (a stack whose start
        then fails stops it itself, and never hands it over)."""
        if worker.info and worker.info.payload_pid and worker.info.payload_pid not in self._pids:
            self._pids.append(worker.info.payload_pid)

    def _watch(self, worker: Worker) -> None:
        self._own(worker)
        self._watch_worker(worker)

    def model(self, name: str) -> Path:
        """The directory of logical model ``name`` here (given, or a tiny one built on cpu).

        Raises:
            What ``fail`` raises: it cannot be resolved (the message names the option and env var).
        """
        from harness.engines.server import modelmap

        try:
            return modelmap.resolve(name, self.models, self.topology)
        except modelmap.ModelError as e:
            self._fail(str(e))

    def _require_stack(self) -> None:
        missing = missing_stack_modules()
        if missing:
            self._fail(f"the real CPU PD stack needs {', '.join(missing)}: run ./dev install")

    def _placed(self) -> Placement:
        if self._placement is None:
            self._placement = self.cluster.place(self.layout.placement)
        return self._placement

    def role_args(self, role: str) -> tuple[str, ...]:
        """Flags every server of ``role`` (``prefill``, ``decode``, ``plain``) gets here: the module's
        ``server_args``, then the layout's (a shared GPU's memory fraction)."""
        return (*self.server_args, *self.layout.args_of(role))

    @staticmethod
    def _pd_key(
        model_name: str,
        extra_args: Mapping[str, Sequence[str]] | None,
        extra_env: Mapping[str, Mapping[str, str]] | None = None,
    ) -> tuple:
        key = (model_name, tuple(sorted((k, tuple(v)) for k, v in (extra_args or {}).items() if v)))
        env = tuple(sorted((k, tuple(sorted(v.items()))) for k, v in (extra_env or {}).items() if v))
        return (*key, env) if env else key

    @staticmethod
    def _plain_key(model_name: str, compat_patches: Sequence[str] | None) -> tuple:
        return (model_name, None if compat_patches is None else tuple(compat_patches))

    def pd(
        self,
        model_name: str,
        *,
        mini_lb: bool = False,
        extra_args: Mapping[str, Sequence[str]] | None = None,
        extra_env: Mapping[str, Mapping[str, str]] | None = None,
        with_plain: bool = False,
    ) -> PdStack:
        """A ready PD stack serving model ``model_name`` (restarted if a worker of it died).

        ``extra_args`` (role kind → flags, e.g. ``{"decode": HISPARSE_DECODE_ARGS}``) makes a stack of its own,
        and so does ``extra_env`` (role kind → env: sglang knobs no flag sets). ``with_plain``: where the
        plain baseline runs beside the stack, start it (when it is not running yet) at the same time as the
        stack's servers, not after them. The placement holds one PD stack (on ``cpu`` too: a second one's actors
        would wait for room until their start timed out): other PD stacks are stopped first, and so are the
        plain servers where none fits beside a PD stack.
        """
        self._require_stack()
        key = self._pd_key(model_name, extra_args, extra_env)
        if not mini_lb:
            self._take_ahead(key)
        stack = self._pd.get(key)
        if stack is not None and any(w.poll() for w in stack.workers):
            self._stop(self._pd.pop(key).workers)
            stack = None
        if stack is None:
            model = self.model(model_name)
            for other in list(self._pd):
                self._stop(self._pd.pop(other).workers)
            if not self.layout.plain_beside_pd:
                for other in list(self._plain):
                    self._stop([self._plain.pop(other)])
            placement = self._placed()
            baseline = None
            if (
                with_plain
                and self.layout.plain_beside_pd
                and self._live_plain(self._plain_key(model_name, None)) is None
            ):
                # Prefill, decode and the baseline start together: each spends tens of seconds in
                # sglang's import and model load, and they overlap well even on two cores.
                pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plain-start")
                baseline = pool.submit(self.plain, model_name)
                pool.shutdown(wait=False)
            names = tuple(self._unique_name(r) for r in ("prefill", "decode", "router"))
            try:
                stack = self._start_pd(
                    model, placement, names, self._watch, mini_lb=mini_lb, extra_args=extra_args, extra_env=extra_env
                )
            finally:
                if baseline is not None:
                    concurrent.futures.wait([baseline])
            self._pd[key] = stack
            if baseline is not None:
                baseline.result()  # its failure, after the stack is registered (so it is stopped later)
        self._used.add(("pd", key))
        self.prestart_next(model_name)
        return stack

    # ------------------------------------------------------------------ starting ahead

    def prestart_next(self, model_name: str) -> None:
        """Start, in the background, the PD stack and plain baseline of the model the tests after
        ``model_name``'s serve next here (:attr:`order`), so its start overlaps this model's tests.

        Only on topologies without GPUs (a GPU placement holds one stack at a time). Its workers are
        owned and watched from the moment a test takes the stack (:meth:`pd`); a start that failed
        fails that test with the start's error, as a start in the test itself would.
        """
        if self.topology.needs_gpus or model_name not in self.order:
            return
        later = [m for m in self.order[self.order.index(model_name) + 1 :] if m != model_name]
        if not later:
            return
        nxt = later[0]
        key = self._pd_key(nxt, None)
        if key in self._pd or key in self._ahead or missing_stack_modules():
            return
        # Its own placement: a CPU topology's bundles hold one stack's workers, and the running
        # model may still need a fresh stack of its own (a test that spent one on purpose).
        placement = self.cluster.place(self.layout.placement, label=f"ahead-{next(_AHEAD_LABELS)}")
        self._more_placements.append(placement)
        names = tuple(self._unique_name(r) for r in ("prefill", "decode", "router"))
        plain_key = self._plain_key(nxt, None)
        plain_name = self._unique_name("plain") if self._live_plain(plain_key) is None else None
        started: list[Worker] = []

        def start() -> tuple[PdStack, Worker | None]:
            model = self.model(nxt)
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plain-ahead") as pool:
                baseline = (
                    pool.submit(self._start_plain, model, plain_name, None, started.append) if plain_name else None
                )
                stack = self._start_pd(model, placement, names, started.append)
            return stack, (baseline.result() if baseline else None)

        if self._ahead_pool is None:
            self._ahead_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stack-ahead")
        log.info("starting the %s stack ahead of its tests", nxt)
        self._ahead[key] = (self._ahead_pool.submit(start), started)

    def _take_ahead(self, key: tuple) -> None:
        """Wait for the stack started ahead under ``key`` (if any) and hand it to the tests: owned,
        watched, and registered (its plain baseline too).

        Raises:
            Exception: what its start raised (everything it had started is stopped).
        """
        ahead = self._ahead.pop(key, None)
        if ahead is None:
            return
        future, started = ahead
        try:
            stack, baseline = future.result()
        except BaseException:
            self._stop_unowned(started)
            raise
        for w in started:
            self._watch(w)
        self._pd[key] = stack
        if baseline is not None:
            self._plain[self._plain_key(key[0], None)] = baseline
        self.taken_ahead.append(key[0])
        log.info("the %s stack started ahead was taken (ready %.1f s after its start)", key[0], stack.started_s)

    def _drop_ahead(self, model_name: str | None = None) -> None:
        """Stop what was started ahead for ``model_name`` (every model: None) and no test took."""
        for key in [k for k in self._ahead if model_name is None or k[0] == model_name]:
            future, started = self._ahead.pop(key)
            try:
                future.result()
            except BaseException as e:  # noqa: BLE001 - no test asked for it: log, stop what started
                log.warning("the %s stack started ahead failed and no test took it: %s", key[0], e)
            self._stop_unowned(started)

    def _stop_unowned(self, workers: Sequence[Worker]) -> None:
        for w in workers:
            self._own(w)  # for close()'s leftover check
        self._stop(workers)

    def _start_bound(self) -> float:
        """Seconds a PD stack's start may take: :data:`START_FACTOR` times this session's normal start
        (the median of the starts so far, at least :data:`START_FLOOR_S`), and at most the stack's own
        deadline; the whole deadline before any start has finished."""
        if not self._starts:
            return self.ready_timeout
        return min(self.ready_timeout, max(START_FLOOR_S, START_FACTOR * statistics.median(self._starts)))

    def _start_pd(
        self,
        model: Path,
        placement: Placement | None,
        names: tuple[str, str, str],
        on_start: Callable[[Worker], None],
        *,
        mini_lb: bool = False,
        extra_args: Mapping[str, Sequence[str]] | None = None,
        extra_env: Mapping[str, Mapping[str, str]] | None = None,
    ) -> PdStack:
        """Start a PD stack; one that stalls past :meth:`_start_bound` is stopped and replaced once,
        and a replacement that stalls too fails the start, saying where its requests were."""
        from harness.engines.server.stack import start_pd_stack

        more = dict(extra_args or {})
        bound = self._start_bound()
        for attempt in (1, 2):
            t0 = time.time()
            try:
                stack = start_pd_stack(
                    self.topology,
                    model,
                    self.run_dir.root,
                    placement=placement,
                    names=names,
                    mini_lb=mini_lb,
                    on_start=on_start,
                    on_launch=self._launched,
                    ready_timeout=bound,
                    forkserver=self.forkserver,
                    extra_args={k: (*self.role_args(k), *more.get(k, ())) for k in ("prefill", "decode")},
                    extra_env=extra_env,
                )
            except TimeoutError as e:
                normal = f"normal start {statistics.median(self._starts):.0f} s" if self._starts else "first start"
                why = (
                    f"PD stack of {model.name} not ready within {bound:.0f} s ({normal}): "
                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}{self._start_story(t0)}"
                )
                if attempt == 2:
                    raise TimeoutError(f"{why}; it was a replacement, the first start stalled too") from e
                log.warning("%s; replacing it once", why)
                names = (self._unique_name("prefill"), self._unique_name("decode"), self._unique_name("router"))
                continue
            self._starts.append(stack.started_s)
            return stack
        raise AssertionError("unreachable")

    def _start_story(self, since: float) -> str:
        """Where the last request the stack's start made was, from the phase trace (empty: none)."""
        from harness.engines import phases

        if self.run_dir is None:
            return ""
        marks = [m for m in phases.read_trace(self.run_dir.ledger) if m.t >= since]
        rids = [m.rid for m in marks if m.rid]
        story = phases.stall_story(marks, rids[-1], since) if rids else ""
        return f" | its last request {rids[-1]}: {story}" if story else ""

    def _start_plain(
        self, model: Path, name: str, compat_patches: Sequence[str] | None, on_start: Callable[[Worker], None]
    ) -> Worker:
        from harness.engines.server.layout import PLAIN_ROLE
        from harness.engines.server.stack import start_plain_server

        return start_plain_server(
            self.topology,
            model,
            self.run_dir.root,
            name=name,
            group=self._plain_group(),
            ready_timeout=self.ready_timeout,
            probe=True,
            forkserver=self.forkserver,
            compat_patches=compat_patches,
            extra_args=self.role_args(PLAIN_ROLE),
            on_start=on_start,
        )

    def forget(
        self,
        model_name: str,
        extra_args: Mapping[str, Sequence[str]] | None = None,
        extra_env: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        """Stop the PD stack :meth:`pd` gave for these arguments now; a test that broke it on purpose calls this.

        Its workers stop being owned by the test: the harness does not fail it for the death it provoked
        and caught (the plugin fails a test that swallows a worker's death)."""
        stack = self._pd.pop(self._pd_key(model_name, extra_args, extra_env), None)
        if stack is not None:
            self._stop(stack.workers)

    def kill(self, model_name: str, role: str, extra_args: Mapping[str, Sequence[str]] | None = None) -> Worker:
        """SIGKILL the ``role`` server (``prefill``/``decode``) of ``model_name``'s stack on purpose: out of
        the watchdog first (its death is not raised into the test; the survivors stay watched), the
        stack registered until :meth:`forget`. Returns the worker, dead (TimeoutError if not in 30 s)."""
        victim = getattr(self._pd[self._pd_key(model_name, extra_args)], role)
        self._unwatch(victim)
        os.kill(victim.info.payload_pid, signal.SIGKILL)
        wait_for(victim.poll, 30, f"{victim.name} dying of SIGKILL", interval=0.05)
        return victim

    def replace(
        self,
        model_name: str,
        role: str,
        *,
        while_starting: Callable[[PdStack, Worker], None] | None = None,
        extra_args: Mapping[str, Sequence[str]] | None = None,
    ) -> PdStack:
        """Restart the ``role`` server (``prefill``/``decode``) of ``model_name``'s stack while the other
        server and the router keep running, as an operator restarts one server: the old one is stopped
        (a dead one, killed by :meth:`kill`, too), a new one starts at new ports in its place, and the
        router swaps them. Decode meets the new prefill at a bootstrap address it has never asked.

        ``while_starting(stack, worker)`` runs once the new server is launched, before it is ready (``stack``:
        the one before the swap, its other servers running): a test acts while it starts (a hold at its
        registration). The new server is watched from its readiness on.
        A replacement that fails to start or join stops the whole stack (the next :meth:`pd` starts a fresh
        one) and raises."""
        from harness.engines.server.stack import launch_role, rejoin

        key = self._pd_key(model_name, extra_args)
        stack = self._pd.get(key) or self.pd(model_name, extra_args=extra_args)
        self._stop([getattr(stack, role)])
        bound = self._start_bound()
        worker = launch_role(
            self.topology,
            self.model(model_name),
            self.run_dir.root,
            role,
            self._unique_name(role),
            placement=self._placed(),
            extra_args=(*self.role_args(role), *dict(extra_args or {}).get(role, ())),
            ready_timeout=bound,
            forkserver=self.forkserver,
        )
        self._launched(worker)
        try:
            if while_starting is not None:
                while_starting(stack, worker)
            stack = rejoin(stack, role, worker, time.monotonic() + bound)
        except BaseException:
            self._stop_unowned([worker])
            self._stop(self._pd.pop(key).workers)
            raise
        self._watch(worker)
        self._pd[key] = stack
        self._used.add(("pd", key))
        return stack

    def _plain_group(self) -> PlacementBundles | None:
        """Where the plain server runs: unplaced (cpu), its own layout role, or, where it cannot run
        beside a PD stack, the prefill group after every PD stack was stopped."""
        if not self.topology.needs_gpus:
            return None
        if self.layout.plain_role is not None:
            return self._placed().of(self.layout.plain_role)[0]
        for key in list(self._pd):
            self._stop(self._pd.pop(key).workers)
        return self._placed().of("prefill")[0]

    def _live_plain(self, key: tuple) -> Any:
        w = self._plain.get(key)
        if w is not None and w.poll():
            self._stop([self._plain.pop(key)])
            w = None
        return w

    def plain(self, model_name: str, compat_patches: Sequence[str] | None = None, *, watch: bool = True) -> Any:
        """A ready plain (non-PD) server of ``model_name``; ``compat_patches=()`` runs it unpatched.

        ``watch=False`` keeps it out of the fail-fast watchdog: for a test that expects it may crash.
        """
        key = self._plain_key(model_name, compat_patches)
        if compat_patches is None:
            self._take_ahead(self._pd_key(model_name, None))
        w = self._live_plain(key)
        if w is None:
            model = self.model(model_name)
            name = self._unique_name("plain")
            w = self._start_plain(model, name, compat_patches, self._watch if watch else self._own)
            self._plain[key] = w
        self._used.add(("plain", key))
        self.prestart_next(model_name)
        return w

    def forget_plain(self, model_name: str, compat_patches: Sequence[str] | None = None) -> None:
        """Stop the plain server started with these arguments now (frees its memory for the next ones)."""
        w = self._plain.pop(self._plain_key(model_name, compat_patches), None)
        if w is not None:
            self._stop([w])

    def reset_used(self) -> list[str]:
        """Reset every server handed out since the last call (sglang's ``/flush_cache``, checked by its probe's
        ledger); return one line per server that failed it. Such a server is stopped with its stack, unless it is
        back at baseline and broke only rules judging sglang's decisions (``ResetError.reusable``)."""
        from harness.engines.server.reset import ResetError, reset_server

        used, self._used = self._used, set()
        problems: list[str] = []
        for kind, key in sorted(used, key=repr):
            table = self._pd if kind == "pd" else self._plain
            held = table.get(key)
            if held is None:
                continue  # forgotten by the test (it broke it on purpose)
            errors: list[Exception] = []
            for w in (held.prefill, held.decode) if kind == "pd" else (held,):
                try:
                    reset_server(w, self.run_dir.ledger / f"{w.name}.jsonl", timeout_s=RESET_TIMEOUT_S)
                except (ResetError, TimeoutError) as e:
                    errors.append(e)
            kept = all(getattr(e, "reusable", False) for e in errors)
            problems += [f"{e} ({'kept: its pools are at baseline' if kept else 'stopped'})" for e in errors]
            if not kept:
                self._stop(table.pop(key).workers if kind == "pd" else [table.pop(key)])
        return problems

    def stop_model(self, model_name: str) -> None:
        """Stop every stack and plain server of ``model_name`` (no later test needs them)."""
        self._drop_ahead(model_name)
        for key in [k for k in self._pd if k[0] == model_name]:
            self._stop(self._pd.pop(key).workers)
        for key in [k for k in self._plain if k[0] == model_name]:
            self._stop([self._plain.pop(key)])
        if not (self._pd or self._plain or self._ahead):
            self._release_placements()

    def _release_placements(self) -> None:
        """Give back every placement this holds (nothing runs in them): a later test of the session
        may place the same topology, and Ray's group names are unique."""
        for placement in [self._placement, *self._more_placements]:
            if placement is not None:
                self.cluster.release(placement)
        self._placement, self._more_placements = None, []

    def _stop(self, workers: Sequence[Any]) -> None:
        from harness.engines.server.pd_stack import stop_all

        workers = list(workers)
        for w in workers:
            self._unwatch(w)
        # Side by side: each server drains and exits on its own (seconds each on a CPU).
        stop_all(workers)
        for w in workers:
            # No longer owned by the tests: a death they expected (a fault test) is not "swallowed".
            if w in self.workers:
                self.workers.remove(w)

    def close(self) -> list[int]:
        """Stop everything; return the server process ids that are still alive afterwards."""
        from harness.engines.server.stack import leftover_processes

        self._drop_ahead()
        if self._ahead_pool is not None:
            self._ahead_pool.shutdown(wait=True)
        self._pd.clear()
        self._plain.clear()
        self._stop(list(reversed(self.workers)))
        self._release_placements()
        return leftover_processes(self._pids)
