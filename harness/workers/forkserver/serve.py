"""The fork server process: run the preload once, then fork one child per client request
(``python -m harness.workers.forkserver``, started by :meth:`~harness.workers.forkserver.ForkServer.start`).

It refuses a preload that left threads, writes what a client must share with it (:mod:`.envmatch`), and
exits with its owner or on SIGTERM. Detail: docs/modules.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import select
import signal
import socket
import sys
from typing import Callable, Sequence

from harness.workers.forkserver.child import (
    CHILD_SIGNALS,
    WATCH_THREAD,
    Preloaded,
    client_gone,
    recv_request,
    run_child,
)
from harness.workers import procs
from harness.workers.forkserver import envmatch
from harness.workers.forkserver.envmatch import SCANNED_PREFIXES, EnvReads, write_match

#: What the server prints once it serves (the handle waits for this line).
READY = "forkserver ready"
_POLL_S = 0.2


class ForkServerError(RuntimeError):
    """The fork server did not start (its log tail says why) or cannot serve safely."""


def _threads() -> int:
    """This process's threads, but a forked child's watch on its client (:data:`WATCH_THREAD`): a
    server that is itself a fork of another server (started by :meth:`ForkServer.start` with
    ``launch``) has that one, which blocks in a ``recv`` holding no lock, and which its own children
    do not get (a fork copies only the calling thread)."""
    import threading

    watching = sum(1 for t in threading.enumerate() if t.name == WATCH_THREAD and t.is_alive())
    return len(os.listdir("/proc/self/task")) - watching


def _owner_gone(owner: int | None) -> Callable[[], bool]:
    """A test of whether the server's owner is gone: ``owner`` (a pid) exited, or, without one, this
    process's parent changed. A server that is a fork of another has that server for its parent,
    which outlives the owner, so the owner is named (and watched through a pidfd: no pid reuse)."""
    if owner is None:
        parent = os.getppid()
        return lambda: os.getppid() != parent
    try:
        fd = os.pidfd_open(owner)
    except ProcessLookupError:  # already gone
        return lambda: True
    except OSError:  # no pidfds here (Linux before 5.3): its pid and start tick, looked at each poll
        start = procs.start_time(owner)
        return lambda: not procs.alive(owner, start)
    return lambda: bool(select.select([fd], [], [], 0)[0])


def serve(
    socket_path: str,
    preload: str,
    must_match: Sequence[str] = (),
    record_env: bool = False,
    reimport: Sequence[str] = (),
    free_path: bool = False,
    owner: int | None = None,
) -> int:
    """The server's main loop: run ``preload``, then fork one child per client request.

    Args:
        socket_path: where to listen (an AF_UNIX path).
        preload: ``"module:function"`` called once before serving (or ``"module"``, only imported).
        must_match: env vars a client must share with this process to be forked (written to
            :data:`MATCH_FILE` beside the socket before serving).
        record_env: also require every env var ``preload`` read, and every one of
            :data:`SCANNED_PREFIXES`: for a preload whose modules' import-time environment is not
            known in advance.
        reimport: packages each child imports afresh (they are dropped from its ``sys.modules``):
            a pytest plugin's own package, which pytest rewrites only when it imports it itself.
        free_path: a client whose ``PYTHONPATH`` differs (one of ``must_match``) is still forked when
            no directory that differs holds a module the preload imported; the child rebuilds
            ``sys.path`` from its own (:func:`~harness.workers.forkserver.envmatch.free_path`). The
            preload's modules must then not come from the server's own ``PYTHONPATH``, or this is off.

    Returns:
        The exit status (0 when the parent went away or SIGTERM arrived).

    Raises:
        ForkServerError: ``preload`` left more than one thread running.
    """
    mod, _, func = preload.partition(":")
    before = dict(os.environ)
    reads = EnvReads(skip=reimport)
    with reads if record_env else contextlib.nullcontext():
        module = importlib.import_module(mod)
        if func:
            getattr(module, func)()
    if _threads() != 1:
        raise ForkServerError(
            f"preload {preload!r} left {_threads()} threads; a fork would copy only one "
            "(set OMP_NUM_THREADS=1 and OPENBLAS_NUM_THREADS=1, or import less)"
        )
    # What the preload itself set (torch, Ray set a few variables when imported): a fresh interpreter
    # has them after its imports, so each child of a server that compares its clients' environments
    # (record_env) gets them on top of its client's; the clients are compared with the environment
    # the preload started from.
    preloaded = Preloaded(set={}, unset=(), reimport=tuple(reimport))
    if record_env:
        preloaded = Preloaded(
            set={k: v for k, v in os.environ.items() if before.get(k) != v},
            unset=tuple(k for k in before if k not in os.environ),
            reimport=tuple(reimport),
        )
    free = envmatch.free_path(before.get("PYTHONPATH", ""), sys.modules) if free_path else None
    if free_path and free is None:
        print(
            "forkserver: the preload imported from this server's PYTHONPATH: clients must share it",
            file=sys.stderr,
            flush=True,
        )
    if free is not None:
        preloaded = dataclasses.replace(preloaded, pythonpath=before.get("PYTHONPATH", ""))
    write_match(
        socket_path,
        [*must_match, *reads.names(before)],
        SCANNED_PREFIXES if record_env else (),
        before,
        preload,
        preloaded.set,
        free,
    )
    owner_gone = _owner_gone(owner)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(socket_path)
    srv.listen(64)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    children: dict[int, tuple[socket.socket, bool]] = {}  # pid -> (its client's connection, leads a session)
    gone: set[int] = set()  # children whose client went away (killed, being reaped)
    print(READY, flush=True)
    while not stopping and not owner_gone():
        conns = {c.fileno(): pid for pid, (c, _) in children.items() if pid not in gone}
        try:
            ready, _, _ = select.select([srv, *conns], [], [], _POLL_S)  # type: ignore[type-var]  # sockets and fds
        except InterruptedError:
            ready = []
        for fd in ready:
            if fd in conns:  # a client sends nothing after its request: readable means it is gone
                gone.add(conns[fd])
                client_gone(conns[fd], children[conns[fd]][1])
        if srv in ready:
            conn, _ = srv.accept()
            try:
                req, fds = recv_request(conn)
            except (OSError, ValueError) as e:
                print(f"forkserver: bad request: {e!r}", file=sys.stderr, flush=True)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            # Signals stay blocked across the fork: one meant for the child before it has set its own
            # handlers is delivered after (not to this server's SIGTERM handler).
            signal.pthread_sigmask(signal.SIG_BLOCK, CHILD_SIGNALS)
            try:
                pid = os.fork()
            except OSError as e:  # the client sees its connection close with no pid: it runs the command itself
                print(f"forkserver: fork failed: {e!r}", file=sys.stderr, flush=True)
                pid = -1
            if pid == 0:
                run_child(conn, fds, req, [srv, *(c for c, _ in children.values())], preloaded)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, CHILD_SIGNALS)
            for fd in fds:
                os.close(fd)
            if pid < 0:
                conn.close()
                continue
            children[pid] = (conn, bool(req.get("session")))
            try:
                conn.sendall(f"pid {pid}\n".encode())
            except OSError:
                gone.add(pid)
                client_gone(pid, children[pid][1])
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn, _ = children.pop(pid, (None, False))  # type: ignore[assignment]  # None: already gone
            gone.discard(pid)
            if conn is not None:
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()
    srv.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.workers.forkserver", description=__doc__.splitlines()[0])
    p.add_argument("--socket", required=True, help="AF_UNIX path to listen on")
    p.add_argument("--preload", required=True, help="module:function to run once before serving")
    p.add_argument(
        "--must-match",
        action="append",
        default=[],
        metavar="NAME",
        help="an env var a client must share to be forked (repeatable)",
    )
    p.add_argument(
        "--record-env",
        action="store_true",
        help="also require every env var the preload read, and the scanned families",
    )
    p.add_argument(
        "--reimport",
        action="append",
        default=[],
        metavar="PACKAGE",
        help="a package each child imports afresh (repeatable)",
    )
    p.add_argument(
        "--free-path",
        action="store_true",
        help="fork clients with another PYTHONPATH that shadows nothing the preload imported",
    )
    p.add_argument(
        "--owner",
        type=int,
        default=None,
        metavar="PID",
        help="exit when this process is gone (default: when the parent is)",
    )
    args = p.parse_args(argv)
    try:
        return serve(
            args.socket, args.preload, args.must_match, args.record_env, args.reimport, args.free_path, args.owner
        )
    except ForkServerError as e:
        print(f"forkserver: {e}", file=sys.stderr, flush=True)
        return 3
