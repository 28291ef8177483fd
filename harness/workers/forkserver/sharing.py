"""Fork servers shared by a process and its descendants: one per preload and environment (:func:`shared`),
and the harness's own Python subprocesses run as forks (:func:`python_command`); all stopped at exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from harness.workers.forkserver import client, policy
from harness.workers.forkserver.server_handle import SOCKET_ENV, BySocket, ForkServer, Launch, client_command, match_of
from harness.workers.forkserver.serve import ForkServerError

log = logging.getLogger(__name__)

_SHARED: dict[tuple, ForkServer] = {}
#: Env that changes while a process runs (pytest names the current test in it): never part of a
#: shared server's identity, so one server serves the whole session.
VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)
_SHARED_LOCK = threading.Lock()
#: One lock per :func:`shared` key, held while its server starts.
_STARTING: dict[tuple, threading.Lock] = {}


@dataclass(frozen=True)
class Inherited(BySocket):
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


def shared(
    preload: str,
    env: Mapping[str, str],
    *,
    base: Mapping[str, str] | None = None,
    must_match: Sequence[str] = (),
    free_path: bool = False,
    advertise: bool = False,
    launch: Launch | None = None,
) -> ForkServer | Inherited:
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


def python_command(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    preload: str,
    requires: Mapping[str, str] = {},
    refuses: Sequence[str] = (),
    must_match: Sequence[str] = (),
    reimport: Sequence[str] = ("harness",),
    start_server: bool = True,
    free_path: bool = False,
) -> tuple[list[str], dict[str, str]]:
    """``argv`` and ``env`` that run a Python subprocess as a fork of a server that ran ``preload``.

    The server is started on first use with ``env`` (``record_env``: a later ``env`` that differs in
    any variable the preload read, or in :data:`SCANNED_PREFIXES`, gets a server of its own), and
    stopped at interpreter exit; this process's environment names it (:data:`ADVERTISE_ENV`), so a
    descendant (a ``rerun-test`` a test runs) forks from it too when its environment fits. The child
    runs as a fresh interpreter would (see :func:`_run_child`), so this changes the start-up cost, not
    the result. A command is returned unchanged (a fresh interpreter) when:

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
        preload, must_match, reimport, free_path: as :meth:`ForkServer.start` (by default the harness's own
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
            server = ForkServer.start(
                preload, base, must_match=must_match, record_env=True, reimport=reimport, free_path=free_path
            )
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
        found = match_of(path)
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
