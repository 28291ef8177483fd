"""In a forked child of the fork server: become the process the client asked for, as the fresh
interpreter it replaces would be.

It takes the client's argv, environment, working directory, stdio, priority, signals and session, reseeds,
reruns ``sitecustomize``, and on exit joins threads and runs ``atexit`` handlers. The full list:
docs/modules.md.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import threading
import traceback
from dataclasses import dataclass

from harness.workers.forkserver import client


@dataclass(frozen=True)
class Preloaded:
    """What the server's preload left that each child takes on: the environment values it set and
    unset (a fresh interpreter has them after the same imports), and the packages a child imports
    afresh (dropped from its ``sys.modules``: a pytest plugin's own, which pytest rewrites only when it
    imports it itself)."""

    set: dict[str, str]
    unset: tuple[str, ...]
    reimport: tuple[str, ...]
    #: The server's own ``PYTHONPATH`` when its children rebuild ``sys.path`` from theirs (a server
    #: started with ``free_path``); None: they keep the server's.
    pythonpath: str | None = None


def recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    if len(data) < 8:
        raise ConnectionError("short request")
    size = int.from_bytes(data[:8], "big")
    body = data[8:]
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise ConnectionError("request cut short")
        body += more
    return json.loads(body), list(fds)


def _title(argv: list[str]) -> None:
    """Name the child after the command it runs (``ps``, psutil and ``/proc/PID/cmdline`` show it),
    as a fresh interpreter started with that argv would be named."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(" ".join([sys.executable, *argv]))


def _rerun_site() -> None:
    """Run ``sitecustomize`` again with the child's environment: a fresh interpreter runs it at start
    with its own environment (and from its own path), and what it installs may depend on it (the
    sglang servers' does). One the child's path lacks is dropped, as a fresh interpreter would lack it."""
    site = sys.modules.get("sitecustomize")
    if site is not None and getattr(site, "__file__", None):
        try:
            importlib.reload(site)
        except ModuleNotFoundError:
            del sys.modules["sitecustomize"]


def repath(old: str, new: str) -> None:
    """Give ``sys.path`` the child's ``PYTHONPATH`` (``new``) in place of the server's (``old``), where a
    fresh interpreter puts it: the entries of ``old`` are removed, those of ``new`` inserted where
    they stood (after ``sys.path[0]`` when none did), made absolute and without repeats as ``site``
    makes them. The server checked that no module it imported came from, or would be shadowed by,
    an entry that differs (:func:`harness.workers.forkserver.envmatch.free_path`)."""
    if old == new:
        return
    olds = {os.path.abspath(p) for p in old.split(os.pathsep) if p}
    first = next((i for i, p in enumerate(sys.path) if i > 0 and p in olds), None)
    kept = [p for i, p in enumerate(sys.path) if i == 0 or p not in olds]
    at = 1 if first is None else sum(1 for i, p in enumerate(sys.path[:first]) if i == 0 or p not in olds)
    news = [p for p in dict.fromkeys(os.path.abspath(p) for p in new.split(os.pathsep) if p) if p not in kept[1:]]
    sys.path[:] = kept[:at] + news + kept[at:]
    importlib.invalidate_caches()


def run_child(
    conn: socket.socket, fds: list[int], req: dict, others: list[socket.socket], preloaded: Preloaded
) -> None:
    """In the forked child: become the requested process (never returns).

    ``argv`` is what follows the interpreter on its command line: a script path and its arguments,
    or ``-m MODULE`` and its arguments.
    """
    code, by_signal = 1, 0
    session = bool(req.get("session"))
    try:
        if session:  # the client leads a session of its own: so does the command (its tree is the session)
            os.setsid()
        elif req.get("group"):
            # The client leads a process group of its own (Ray starts each worker so): so does the
            # command, or it would be in this server's, which may be its caller's caller's (a rank fork
            # server forked from rerun-test's Python server), and Ray, which kills a dead worker's
            # group, would kill that one.
            os.setpgid(0, 0)
        for s in others:
            s.close()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        # SIGINT as a fresh interpreter has it: KeyboardInterrupt, or ignored when it was inherited ignored.
        signal.signal(signal.SIGINT, signal.SIG_IGN if req.get("sigint_ignored") else signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, CHILD_SIGNALS)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            if fd > 2:
                os.close(fd)
        os.chdir(req["cwd"])
        # The client's priority: Ray runs its workers niced, and a fork of this server would
        # otherwise outrank every worker Ray starts.
        nicer = int(req.get("nice", 0)) - os.nice(0)
        if nicer > 0:
            os.nice(nicer)
        if session:
            client.autogroup_nice()
        argv = list(req["argv"])
        _title(argv)  # before the environment changes: setproctitle needs the initial environ block
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ.update(preloaded.set)
        for name in preloaded.unset:
            os.environ.pop(name, None)
        for name in [m for m in sys.modules if m.split(".")[0] in preloaded.reimport]:
            del sys.modules[name]
        if preloaded.pythonpath is not None:
            repath(preloaded.pythonpath, os.environ.get("PYTHONPATH", ""))
        _as_fresh_interpreter()
        module = argv[1] if argv[:1] == ["-m"] else None
        if module is not None:
            sys.argv = argv[1:]  # run_module puts the module's file in argv[0], as ``python -m`` does
            sys.path[0] = os.getcwd()
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))

        def die_with_client() -> None:
            # The client (the process Ray started) holds the other end: when it is gone, so are we.
            while True:
                try:
                    if not conn.recv(1):
                        break
                except InterruptedError:
                    continue
                except OSError:
                    break
            if session and os.getpgid(0) == os.getpid():  # never the server's group
                os.killpg(0, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=die_with_client, name=WATCH_THREAD, daemon=True).start()
        _rerun_site()
        if module is not None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, by_signal = 1, signal.SIGINT
    except BaseException:  # noqa: BLE001 - the child's own failure: print it to its (Ray's) log
        traceback.print_exc()
    finally:
        _finalize(code, by_signal)


def _as_fresh_interpreter() -> None:
    """What a fresh interpreter would have that the fork did not give: its own seeds for torch's and
    numpy's global generators (``random`` reseeds itself after a fork), and stdout and stderr
    line-buffered when they are a terminal."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "seed"):
        torch.seed()
    np_random = sys.modules.get("numpy.random")
    if np_random is not None and hasattr(np_random, "seed"):
        np_random.seed()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream.isatty() and not stream.line_buffering:
                stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a TextIOWrapper here
        except (AttributeError, ValueError, OSError):
            pass


def _exit_code(e: SystemExit) -> int:
    """The exit status ``raise SystemExit(code)`` gives a fresh interpreter (a message is printed, status 1)."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def _finalize(code: int, by_signal: int = 0) -> None:
    """End the child as a fresh interpreter ends: wait for its non-daemon threads, run its ``atexit``
    handlers, flush, and exit with ``code`` (an int as ``sys.exit`` takes it: the status is its low
    byte), or die by ``by_signal`` (an uncaught KeyboardInterrupt: SIGINT). Never returns."""
    try:
        try:
            threading._shutdown()  # type: ignore[attr-defined]  # what interpreter shutdown calls
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        try:
            atexit._run_exitfuncs()
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if by_signal:
            signal.signal(by_signal, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {by_signal})
            os.kill(os.getpid(), by_signal)
        os._exit(code & 0xFF)


#: The name of a child's thread that waits for its client to go away.
WATCH_THREAD = "forkserver-client-watch"
#: What the server blocks across a fork, and a child unblocks once its own handlers are set.
CHILD_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def client_gone(pid: int, session: bool) -> None:
    """A child's client is gone (killed): the child goes too, with its session's whole group, as the
    command would have in the client's place. The child's own watch thread does the same, but needs
    the GIL, which a hung extension may hold."""
    try:
        if session and os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
