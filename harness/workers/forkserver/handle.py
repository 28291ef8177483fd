"""The driver's side of a fork server: start one (:meth:`ForkServer.start`), reuse one per preload and
environment (:func:`shared`), and run the harness's Python subprocesses as forks (:func:`python_command`).
Over 400 lines because starting, sharing and choosing fork-or-fresh all lean on one socket-and-match logic.
The whole story: the package's section in docs/modules.md (:mod:`harness.workers.forkserver`).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from harness.clock import Deadline
from harness.workers import procs
from harness.workers.forkserver import client, policy
from harness.workers.forkserver.serve import READY, ForkServerError

log = logging.getLogger(__name__)

CLIENT = Path(__file__).resolve().parent / "client.py"
#: The env var naming the server's socket to the client, and the file beside the socket naming the
#: env values a client must share to be forked: defined by the (stdlib-only) client.
SOCKET_ENV, MATCH_FILE = client.ENV, client.MATCH_FILE
DEFAULT_START_TIMEOUT_S = 300.0
#: How a fork server's own process is started: ``(argv, env) -> (argv, env)`` (:meth:`ForkServer.start`).
Launch = Callable[[list[str], dict[str, str]], tuple[list[str], dict[str, str]]]


def client_command(argv: Sequence[str]) -> list[str]:
    """The command that runs ``argv`` (``[python, *args]``, this interpreter) as a fork of the
    server whose socket :data:`SOCKET_ENV` names in its env: the client."""
    if not argv or argv[0] != sys.executable:
        raise ValueError(f"a fork server runs commands of its own interpreter ({sys.executable}), not {argv[:1]}")
    return [sys.executable, "-I", "-S", str(CLIENT), *argv[1:]]


class _BySocket:
    """What a fork server is used for, by its socket alone: the client command, a Ray actor's runtime
    environment, and whether it would fork a given environment."""

    socket_path: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """The command that runs ``argv`` (``[python, *args]``, this interpreter) as a fork of this
        server: the client, which needs :data:`SOCKET_ENV` set to :attr:`socket_path` in its env."""
        return client_command(argv)

    def runtime_env(self) -> dict[str, Any]:
        """Ray ``runtime_env`` that starts an actor's worker process as a fork of this server."""
        return {"py_executable": f"{sys.executable} -I -S {CLIENT}", "env_vars": {SOCKET_ENV: self.socket_path}}

    def serves(self, env: Mapping[str, str]) -> bool:
        """Whether a client with environment ``env`` would be forked (not run as a fresh interpreter)."""
        return not client.differing(self.socket_path, env)

    @property
    def serving_pid(self) -> int | None:
        """The pid of the process that forks the children (what it wrote beside its socket): the
        server's own, or, for one started as a fork of another (``launch``), that fork's, not its
        client's. None while it has not written it."""
        match = _match(self.socket_path)
        return match[0] if match else None


def _match(socket_path: str) -> tuple[int, dict] | None:
    """The serving pid and the whole :data:`MATCH_FILE` of the server at ``socket_path`` (None: no
    readable file, not a fork server's)."""
    try:
        with open(os.path.join(os.path.dirname(socket_path), MATCH_FILE)) as f:
            match = json.load(f)
        return int(match["pid"]), match
    except (OSError, ValueError, KeyError, TypeError):
        return None


class ForkServer(_BySocket):
    """A started fork server (see the module docstring); use :meth:`runtime_env` on Ray actors."""

    def __init__(self, proc: subprocess.Popen, socket_path: str, log_path: Path, tmpdir: str, preload: str = "") -> None:
        self.proc = proc
        self.preload = preload
        self.socket_path = socket_path
        self.log_path = log_path
        self._tmpdir = tmpdir

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(cls, preload: str, env: Mapping[str, str] | None = None,
              timeout: float = DEFAULT_START_TIMEOUT_S, must_match: Sequence[str] = (),
              record_env: bool = False, reimport: Sequence[str] = (), free_path: bool = False,
              launch: Launch | None = None) -> "ForkServer":
        """Start a server that runs ``preload`` and wait until it serves.

        Args:
            preload: ``"module:function"`` (or ``"module"``) run once in the server.
            env: the server's whole environment (default: this process's); its children get the
                client's environment, but modules read some of it at import, so give the ranks' one.
            timeout: seconds for ``preload`` (an import of torch and sglang: tens of seconds under load).
            must_match: env vars whose values decide what the preloaded modules are (the import
                path, thread counts read at import): a client whose values differ from ``env``'s is
                not forked; it runs its command as a fresh interpreter instead (and says so).
            record_env: the server also requires equal every env var the preload read and every
                one of :data:`SCANNED_PREFIXES` (see :func:`serve`).
            reimport: packages each child imports afresh (see :func:`serve`).
            free_path: a client whose ``PYTHONPATH`` differs is still forked when no directory that
                differs holds a module the preload imported (see :func:`serve`).
            launch: how to start the server's own process: ``(argv, env) -> (argv, env)``, e.g. as a
                fork of a server whose preload this one's extends (:func:`python_command` with
                ``start_server=False``), so that it pays only for what its preload adds. The server
                watches this process, not its parent, to know when to exit.

        Returns:
            The serving :class:`ForkServer`.

        Raises:
            ForkServerError: it exited or did not get ready in time (its log tail is in the message).
        """
        tmpdir = tempfile.mkdtemp(prefix="pdh-fork-")
        socket_path = os.path.join(tmpdir, "s")
        log_path = Path(tmpdir) / "server.log"
        full = dict(os.environ if env is None else env)
        cmd = [sys.executable, "-m", "harness.workers.forkserver", "--socket", socket_path, "--preload", preload]
        cmd += [f"--must-match={name}" for name in must_match] + (["--record-env"] if record_env else [])
        cmd += [f"--reimport={name}" for name in reimport] + (["--free-path"] if free_path else [])
        cmd += [f"--owner={os.getpid()}"]
        if launch is not None:
            cmd, full = launch(cmd, full)
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=logf, stdin=subprocess.DEVNULL, env=full)
        procs.register(proc.pid, label="fork server")
        server = cls(proc, socket_path, log_path, tmpdir, preload)
        deadline = Deadline(timeout)
        assert proc.stdout is not None
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], min(1.0, deadline.left()))
            line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
            if line == READY:
                break
            if ready and not line:  # its stdout closed: it is exiting
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is not None or deadline.expired():
                why = f"exited with {proc.poll()}" if proc.poll() is not None else f"not ready within {timeout:g} s"
                tail = server.tail()
                server.stop()
                raise ForkServerError(f"fork server (preload {preload}) {why}; log tail:\n{tail}")
        log.info("fork server %d ready (preload %s) at %s", proc.pid, preload, socket_path)
        return server

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, bounded wait, SIGKILL; then remove its socket directory. Idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=grace)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        procs.unregister(self.proc.pid)
        for name in ("s", "server.log", MATCH_FILE, f".{MATCH_FILE}.tmp"):
            try:
                os.unlink(os.path.join(self._tmpdir, name))
            except OSError:
                pass
        try:
            os.rmdir(self._tmpdir)
        except OSError:
            pass


_SHARED: dict[tuple, ForkServer] = {}
#: Env that changes while a process runs (pytest names the current test in it): never part of a
#: shared server's identity, so one server serves the whole session.
VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)
_SHARED_LOCK = threading.Lock()
#: One lock per :func:`shared` key, held while its server starts.
_STARTING: dict[tuple, threading.Lock] = {}


@dataclass(frozen=True)
class Inherited(_BySocket):
    """A fork server an ancestor process started and named in :data:`ADVERTISE_ENV` (it owns and
    stops it): used as a :class:`ForkServer` is, by its socket."""

    socket_path: str
    preload: str


def _start_once(key: tuple, serving: Callable[[], Any], start: Callable[[], Any]) -> Any:
    """What ``serving()`` finds (looked up under the shared lock), else ``start()``: one start per
    ``key`` at a time, outside the shared lock (a start takes seconds, and a fork server of another
    preload starting beside it must not wait for it), looking again once the lock is had."""
    with _SHARED_LOCK:
        found = serving()
        starting = _STARTING.setdefault(key, threading.Lock())
    if found is not None:
        return found
    with starting:
        with _SHARED_LOCK:
            found = serving()
        return found if found is not None else start()


def _inherited(preload: str, env: Mapping[str, str]) -> str | None:
    """The socket of an ancestor's server for ``preload`` (:data:`ADVERTISE_ENV`) that serves ``env``."""
    return next((path for path in _advertised(preload) if not client.differing(path, env)), None)


def _advertise(server: ForkServer) -> None:
    """Name ``server`` to the processes this one starts after (call with the shared lock held)."""
    os.environ[ADVERTISE_ENV] = os.pathsep.join([server.socket_path, *_advertised()])


def shared(preload: str, env: Mapping[str, str], *, base: Mapping[str, str] | None = None,
           must_match: Sequence[str] = (), free_path: bool = False,
           advertise: bool = False, launch: Launch | None = None) -> ForkServer | Inherited:
    """This process's fork server for ``preload`` with environment ``base | env`` (``base``: this
    process's by default; started on first use, restarted if it died, stopped at interpreter exit).

    Args:
        preload, must_match, free_path, launch: as :meth:`ForkServer.start`. With ``free_path``, a server this
            process or an ancestor (:data:`ADVERTISE_ENV`) already runs for ``preload`` is used when
            it serves this environment (its ``PYTHONPATH`` may differ), before one is started.
        env: what the children's environment adds to ``base`` (e.g. the ranks' worker env).
        base: the environment ``env`` extends (default ``os.environ``).
        advertise: name a server this call starts in this process's :data:`ADVERTISE_ENV`, so the
            processes it starts after (the fault check's pytest runs) fork from it too.

    Returns:
        The serving :class:`ForkServer`, or the ancestor's (:class:`Inherited`).

    Raises:
        ForkServerError: it cannot be started.
    """
    full = {k: v for k, v in {**(os.environ if base is None else base), **env}.items() if k not in VOLATILE_ENV}
    # With must_match, only those decide what the server imported (its children get their client's
    # environment); without, all of it may.
    decides = {k: full.get(k, "") for k in must_match} if must_match else full
    key = (preload, tuple(sorted(decides.items())), tuple(must_match), free_path)
    def serving() -> ForkServer | Inherited | None:
        server = _SHARED.get(key)
        if server is not None and server.alive():
            return server
        if free_path:
            for other in _SHARED.values():
                if other.preload == preload and other.alive() and other.serves(full):
                    return other
            inherited = _inherited(preload, full)
            if inherited is not None:
                return Inherited(inherited, preload)
        return None

    def start() -> ForkServer:
        server = ForkServer.start(preload, full, must_match=must_match, free_path=free_path, launch=launch)
        with _SHARED_LOCK:
            _stop_at_exit()
            _SHARED[key] = server
            if advertise:
                _advertise(server)
        return server

    return _start_once(key, serving, start)


_AT_EXIT: list[bool] = []


def _stop_at_exit() -> None:
    if not _AT_EXIT:
        atexit.register(stop_shared)
        _AT_EXIT.append(True)


def running_shared() -> list[ForkServer]:
    """The fork servers :func:`shared` and :func:`python_command` started that are still serving."""
    with _SHARED_LOCK:
        return [s for s in [*_SHARED.values(), *_PYTHON] if s.alive()]


def stop_shared() -> None:
    """Stop every fork server :func:`shared` and :func:`python_command` started."""
    with _SHARED_LOCK:
        for server in [*_SHARED.values(), *_PYTHON]:
            server.stop()
        _SHARED.clear()
        _PYTHON.clear()


#: ``0``: :func:`python_command` leaves every command a fresh interpreter.
#: Sockets of the Python fork servers a process started, for its descendants' :func:`python_command`.
ADVERTISE_ENV = "HARNESS_PYTHON_FORKSERVERS"
_PYTHON: list[ForkServer] = []
_PYTHON_FAILED: set[str] = set()


def python_command(argv: Sequence[str], env: Mapping[str, str], *, preload: str, requires: Mapping[str, str] = {},
                   refuses: Sequence[str] = (), must_match: Sequence[str] = (),
                   reimport: Sequence[str] = ("harness",), start_server: bool = True) -> tuple[list[str], dict[str, str]]:
    """``argv`` and ``env`` that run a Python subprocess as a fork of a server that ran ``preload``.

    The server is started on first use with ``env`` (``record_env``: a later ``env`` that differs in
    any variable the preload read, or in :data:`SCANNED_PREFIXES`, gets a server of its own), and
    stopped at interpreter exit; this process's environment names it (:data:`ADVERTISE_ENV`), so a
    descendant (a ``rerun-test`` a test runs) forks from it too when its environment fits. The child runs as a fresh interpreter would (see
    :func:`_run_child`), so this changes the start-up cost, not the result. A command is returned
    unchanged (a fresh interpreter) when:

    * ``argv`` is not ``[sys.executable, "-m", MODULE, ...]`` or ``[sys.executable, SCRIPT, ...]``
      (interpreter options need a fresh interpreter);
    * fork starts are switched off (``HARNESS_FORK_START=0`` in ``env`` or here: :mod:`.policy`);
    * ``env`` lacks a value of ``requires`` (what the preload needs to leave one thread, such as
      ``OMP_NUM_THREADS=1``) or sets one of ``refuses`` (what the preload must not run with);
    * the server cannot start (logged; not tried again for this ``preload``), or none serves and
      ``start_server`` is False (the caller forks from one only if this process or an ancestor runs it).

    The forks of one server share its hash seed (``PYTHONHASHSEED`` unset: one random draw per
    server, not per command); set ``PYTHONHASHSEED``, or ``HARNESS_FORK_START=0``, to vary or pin it.

    Args:
        argv: the command, starting with this interpreter.
        env: its whole environment.
        preload, must_match, reimport: as :meth:`ForkServer.start` (by default the harness's own
            modules are imported afresh in each child: pytest rewrites its plugin's asserts).
        requires: env values the child must have to be forked.
        refuses: env vars the child must not set to be forked.

    Returns:
        ``(argv, env)`` to start (e.g. with :class:`subprocess.Popen`).
    """
    argv, env = list(argv), dict(env)
    plain = (argv, env)
    if len(argv) < 2 or argv[0] != sys.executable or (argv[1].startswith("-") and argv[1] != "-m"):
        return plain
    if not policy.forks("python", env={**os.environ, **env}):
        return plain
    if any(env.get(k) != v for k, v in requires.items()) or any(env.get(k) for k in refuses):
        return plain
    base = {k: v for k, v in env.items() if k not in VOLATILE_ENV and k != ADVERTISE_ENV}
    def serving() -> str | None:
        server = next((s for s in _PYTHON if s.preload == preload and s.alive() and s.serves(env)), None)
        if server is not None:
            return server.socket_path
        return _inherited(preload, env)  # an ancestor's (the test run's, for a rerun-test it started)

    def start() -> str:
        if preload in _PYTHON_FAILED or not start_server:  # once: a preload that failed would fail again
            return ""
        try:
            server = ForkServer.start(preload, base, must_match=must_match, record_env=True, reimport=reimport)
        except ForkServerError as e:
            with _SHARED_LOCK:
                _PYTHON_FAILED.add(preload)
            log.warning("%s; Python subprocesses of this process run as fresh interpreters", e)
            return ""
        with _SHARED_LOCK:
            _stop_at_exit()
            _PYTHON.append(server)
            _advertise(server)  # this process's Python subprocesses (a rerun-test a test starts) fork from it too
        return server.socket_path

    found = _start_once(("python", preload), serving, start)
    if not found:
        return plain
    # The child is named the server it is a fork of, as a child of this process would be once it
    # started one (:data:`ADVERTISE_ENV`): its own subprocesses, and a fork server whose preload
    # extends this one (the ranks' of a rerun-test group), fork from it too.
    named = [found, *(p for p in env.get(ADVERTISE_ENV, "").split(os.pathsep) if p and p != found)]
    return client_command(argv), {**env, SOCKET_ENV: found, ADVERTISE_ENV: os.pathsep.join(named)}


def _advertised(preload: str | None = None) -> list[str]:
    """Sockets of the Python fork servers this process or an ancestor started (``$HARNESS_PYTHON_FORKSERVERS``)
    that still serve (their process alive) ``preload`` (any, when None)."""
    out = []
    for path in filter(None, os.environ.get(ADVERTISE_ENV, "").split(os.pathsep)):
        found = _match(path)
        if found is None:
            continue  # not a fork server
        pid, match = found
        try:
            os.kill(pid, 0)
        except OSError:
            continue  # stopped
        if preload is None or match.get("preload") == preload:
            out.append(path)
    return out
