"""A fork server for Ray workers: import a rank's heavy modules once, start every rank as a fork.

A simulated PD rank is a Ray actor whose process imports torch and sglang's memory paths: seconds
of CPU per rank, paid again by every rank of every deployment. A :class:`ForkServer` is one
process that imported them once (``preload``: ``"module:function"``, called once) and then only
forks. A Ray actor started with :meth:`ForkServer.runtime_env` (Ray's documented ``py_executable``
runtime-env field) is launched by Ray through :mod:`harness.workers.forkserver_client`, which hands the
worker's argv, environment, working directory and stdio to the server; the forked child runs Ray's
own ``default_worker.py`` with them. The child *is* the Ray worker: the actor is still created by
Ray, placed in its placement-group bundle, and runs the same code, on modules that were imported
before the fork instead of after it.

Limits, each enforced:

* the server refuses to serve when ``preload`` left more than one thread (a fork copies only the
  calling thread; a lock held by another would stay held forever in every child);
* modules read some environment at import (sglang's env flags, ``HARNESS_FAULTS``, OpenMP's thread
  count): the server is started with the environment its ranks get, and :func:`shared` keeps one
  server per distinct environment;
* nothing that touches a GPU may run before the fork (a CUDA context does not survive one): callers
  use it only for ranks without real GPUs (:func:`harness.pd.deploy.start` decides).

The same server starts the harness's own Python subprocesses (:func:`python_command`: the fault
check's pytest runs, ``rerun-test``'s groups). Such a child must behave as the fresh interpreter it
replaces, and does: it gets the client's argv, environment, working directory, stdio, priority and
SIGINT disposition (KeyboardInterrupt); what the preload's imports set in the environment; its own
torch and numpy seeds; on exit, its threads joined and its ``atexit`` handlers run, and a death by
signal for an uncaught KeyboardInterrupt. A client leading its own session (started with
``start_new_session``) has its child lead one too, so a signal or a kill of that session reaches
everything the command started. Whatever the preload read from the environment (recorded while it
runs) and every variable of :data:`SCANNED_PREFIXES` must be equal for a client to be forked.

The server stops with :meth:`ForkServer.stop` (and at interpreter exit for :func:`shared` ones); it
also exits when its parent is gone, and it is registered in :mod:`harness.workers.procs` so a run killed
with SIGKILL has it reaped by the next one. A child dies with its client (Ray's stand-in process).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import json
import logging
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Mapping, Sequence

from harness.workers import forkserver_client
from harness.workers import procs

log = logging.getLogger(__name__)

CLIENT = Path(__file__).resolve().parent / "forkserver_client.py"
#: The env var naming the server's socket to the client, and the file beside the socket naming the
#: env values a client must share to be forked: defined by the (stdlib-only) client.
SOCKET_ENV, MATCH_FILE = forkserver_client.ENV, forkserver_client.MATCH_FILE
READY = "forkserver ready"
DEFAULT_START_TIMEOUT_S = 300.0
_POLL_S = 0.2


class ForkServerError(RuntimeError):
    """The fork server did not start (its log tail says why) or cannot serve safely."""


# --------------------------------------------------------------------------------------------
# the server process
# --------------------------------------------------------------------------------------------


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
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
    with its own environment, and what it installs may depend on it (the sglang servers' does)."""
    site = sys.modules.get("sitecustomize")
    if site is not None and getattr(site, "__file__", None):
        importlib.reload(site)


def _run_child(conn: socket.socket, fds: list[int], req: dict, others: list[socket.socket]) -> None:
    """In the forked child: become the requested process (never returns).

    ``argv`` is what follows the interpreter on its command line: a script path and its arguments,
    or ``-m MODULE`` and its arguments.
    """
    code, by_signal = 1, 0
    session = bool(req.get("session"))
    try:
        if session:  # the client leads a session of its own: so does the command (its tree is the session)
            os.setsid()
        for s in others:
            s.close()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        # SIGINT as a fresh interpreter has it: KeyboardInterrupt, or ignored when it was inherited ignored.
        signal.signal(signal.SIGINT, signal.SIG_IGN if req.get("sigint_ignored") else signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _CHILD_SIGNALS)
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
            forkserver_client.autogroup_nice()
        argv = list(req["argv"])
        _title(argv)  # before the environment changes: setproctitle needs the initial environ block
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ.update(_PRELOAD_SET)
        for name in _PRELOAD_UNSET:
            os.environ.pop(name, None)
        for name in [m for m in sys.modules if m.split(".")[0] in _REIMPORT]:
            del sys.modules[name]
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

        threading.Thread(target=die_with_client, name="forkserver-client-watch", daemon=True).start()
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
                stream.reconfigure(line_buffering=True)
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


class _EnvReads:
    """Records the names of the env vars Python code reads (``os.environ[k]``, ``.get``, ``in``,
    ``os.getenv``) while it is active, except reads by modules of the ``skip`` packages (imported
    afresh by each child, so what they read here does not matter).

    Code that scans the environment (iterates it, copies it) reads every variable from one place;
    such a place (one that read only variables that are set, and more than half of them) is a scan,
    not a read of each (a helper that reads many names also reads unset ones):
    :data:`SCANNED_PREFIXES` names the families the preloads scan for (tqdm's ``TQDM_``, networkx's,
    fsspec's); ``wsgiref`` keeps a copy of the whole environment for CGI, which the harness never runs.
    """

    def __init__(self, skip: Sequence[str] = ()) -> None:
        self.by_place: dict[tuple[str, int], set[str]] = {}
        self.skip = frozenset(skip)

    def names(self, before: Mapping[str, str]) -> set[str]:
        """The variables read, scans left out (``before``: the environment when recording began;
        a scan may also see what the recorded code set since)."""
        were_set = set(before) | set(os.environ)

        def is_scan(keys: set[str]) -> bool:
            return len(keys) > len(before) // 2 and keys <= were_set

        return {k for keys in self.by_place.values() if not is_scan(keys) for k in keys}

    def _record(self, key: str) -> None:
        frame = sys._getframe(2)
        while frame is not None and (frame.f_globals.get("__name__") in ("os", "_collections_abc")
                                     or frame.f_globals is globals()):  # past os, the ABCs and these wrappers
            frame = frame.f_back
        if frame is None:
            return
        if str(frame.f_globals.get("__name__", "")).split(".")[0] in self.skip:
            return
        self.by_place.setdefault((frame.f_code.co_filename, frame.f_lineno), set()).add(key)

    def __enter__(self) -> "_EnvReads":
        cls = type(os.environ)
        self._saved = (cls.__getitem__, cls.__contains__)
        getitem, contains = self._saved
        record = self._record

        def recorded_getitem(env, key):
            record(key)
            return getitem(env, key)

        def recorded_contains(env, key):
            record(key)
            return contains(env, key)

        cls.__getitem__, cls.__contains__ = recorded_getitem, recorded_contains  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc) -> None:
        cls = type(os.environ)
        cls.__getitem__, cls.__contains__ = self._saved  # type: ignore[method-assign]


#: Env families read where Python code cannot see it (the interpreter at start, native libraries
#: when they load: OpenMP, BLAS, the allocator, torch's C++ side) or by preloaded modules that scan
#: the environment by prefix (tqdm, networkx, fsspec): with ``record_env``, every variable of these
#: families must be equal (or absent) on both sides.
SCANNED_PREFIXES: tuple[str, ...] = ("PYTHON", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "GOTO_", "BLIS_",
                                     "LD_", "MALLOC_", "CUDA_", "TORCH_", "PYTORCH_", "TQDM_", "NETWORKX_", "FSSPEC_")
#: Variables of those families read only when used, by the child itself (``breakpoint()`` reads
#: ``PYTHONBREAKPOINT`` at each call; a Ray driver sets it): never compared.
READ_WHEN_USED: tuple[str, ...] = ("PYTHONBREAKPOINT",)


#: What the preload added to (or changed in) this server's environment, and what it removed.
_PRELOAD_SET: dict[str, str] = {}
_PRELOAD_UNSET: list[str] = []
#: Packages each child imports afresh (``serve``'s ``reimport``).
_REIMPORT: list[str] = []


def _write_match(path: str, names: Sequence[str], prefixes: Sequence[str], env: Mapping[str, str],
                 preload: str = "") -> None:
    """Write :data:`MATCH_FILE` beside the socket ``path``: the values in ``env`` (``""``: unset) of
    ``names`` and of every variable of ``prefixes`` (but :data:`READ_WHEN_USED`), and the values the
    preload itself set: a client that already has those (its parent imported the same modules) is
    where a fresh interpreter would be after the same imports."""
    match = {"env": {k: env.get(k, "") for k in sorted(set(names)) if k not in READ_WHEN_USED},
             "prefixes": {p: {k: v for k, v in env.items() if k.startswith(p) and k not in READ_WHEN_USED}
                          for p in prefixes},
             "ignore": list(READ_WHEN_USED), "set_by_preload": dict(_PRELOAD_SET),
             "preload": preload, "pid": os.getpid()}
    tmp = os.path.join(os.path.dirname(path), f".{MATCH_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump(match, f)
    os.replace(tmp, os.path.join(os.path.dirname(path), MATCH_FILE))


#: What the server blocks across a fork, and a child unblocks once its own handlers are set.
_CHILD_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def _client_gone(pid: int, session: bool) -> None:
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


def serve(socket_path: str, preload: str, must_match: Sequence[str] = (), record_env: bool = False,
          reimport: Sequence[str] = ()) -> int:
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

    Returns:
        The exit status (0 when the parent went away or SIGTERM arrived).

    Raises:
        ForkServerError: ``preload`` left more than one thread running.
    """
    mod, _, func = preload.partition(":")
    before = dict(os.environ)
    reads = _EnvReads(skip=reimport)
    with reads if record_env else contextlib.nullcontext():
        module = importlib.import_module(mod)
        if func:
            getattr(module, func)()
    if _threads() != 1:
        raise ForkServerError(f"preload {preload!r} left {_threads()} threads; a fork would copy only one "
                              "(set OMP_NUM_THREADS=1 and OPENBLAS_NUM_THREADS=1, or import less)")
    # What the preload itself set (torch, Ray set a few variables when imported): a fresh interpreter
    # has them after its imports, so each child of a server that compares its clients' environments
    # (record_env) gets them on top of its client's; the clients are compared with the environment
    # the preload started from.
    if record_env:
        _PRELOAD_SET.update({k: v for k, v in os.environ.items() if before.get(k) != v})
        _PRELOAD_UNSET.extend(k for k in before if k not in os.environ)
    _REIMPORT.extend(reimport)
    _write_match(socket_path, [*must_match, *reads.names(before)], SCANNED_PREFIXES if record_env else (), before,
                 preload)
    parent = os.getppid()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(socket_path)
    srv.listen(64)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    children: dict[int, tuple[socket.socket, bool]] = {}  # pid -> (its client's connection, leads a session)
    gone: set[int] = set()  # children whose client went away (killed, being reaped)
    print(READY, flush=True)
    while not stopping and os.getppid() == parent:
        conns = {c.fileno(): pid for pid, (c, _) in children.items() if pid not in gone}
        try:
            ready, _, _ = select.select([srv, *conns], [], [], _POLL_S)
        except InterruptedError:
            ready = []
        for fd in ready:
            if fd in conns:  # a client sends nothing after its request: readable means it is gone
                gone.add(conns[fd])
                _client_gone(conns[fd], children[conns[fd]][1])
        if srv in ready:
            conn, _ = srv.accept()
            try:
                req, fds = _recv_request(conn)
            except (OSError, ValueError) as e:
                print(f"forkserver: bad request: {e!r}", file=sys.stderr, flush=True)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            # Signals stay blocked across the fork: one meant for the child before it has set its own
            # handlers is delivered after (not to this server's SIGTERM handler).
            signal.pthread_sigmask(signal.SIG_BLOCK, _CHILD_SIGNALS)
            try:
                pid = os.fork()
            except OSError as e:  # the client sees its connection close with no pid: it runs the command itself
                print(f"forkserver: fork failed: {e!r}", file=sys.stderr, flush=True)
                pid = -1
            if pid == 0:
                _run_child(conn, fds, req, [srv, *(c for c, _ in children.values())])
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _CHILD_SIGNALS)
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
                _client_gone(pid, children[pid][1])
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn, _ = children.pop(pid, (None, False))
            gone.discard(pid)
            if conn is not None:
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()
    srv.close()
    return 0


# --------------------------------------------------------------------------------------------
# the driver's handle
# --------------------------------------------------------------------------------------------


def client_command(argv: Sequence[str]) -> list[str]:
    """The command that runs ``argv`` (``[python, *args]``, this interpreter) as a fork of the
    server whose socket :data:`SOCKET_ENV` names in its env: the client."""
    if not argv or argv[0] != sys.executable:
        raise ValueError(f"a fork server runs commands of its own interpreter ({sys.executable}), not {argv[:1]}")
    return [sys.executable, "-I", "-S", str(CLIENT), *argv[1:]]


class ForkServer:
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
              record_env: bool = False, reimport: Sequence[str] = ()) -> "ForkServer":
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
        cmd += [f"--reimport={name}" for name in reimport]
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=logf, stdin=subprocess.DEVNULL, env=full)
        procs.register(proc.pid, label="fork server")
        server = cls(proc, socket_path, log_path, tmpdir, preload)
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, min(1.0, deadline - time.monotonic())))
            line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
            if line == READY:
                break
            if ready and not line:  # its stdout closed: it is exiting
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is not None or time.monotonic() >= deadline:
                why = f"exited with {proc.poll()}" if proc.poll() is not None else f"not ready within {timeout:g} s"
                tail = server.tail()
                server.stop()
                raise ForkServerError(f"fork server (preload {preload}) {why}; log tail:\n{tail}")
        log.info("fork server %d ready (preload %s) at %s", proc.pid, preload, socket_path)
        return server

    def command(self, argv: Sequence[str]) -> list[str]:
        """The command that runs ``argv`` (``[python, *args]``, this interpreter) as a fork of this
        server: the client, which needs :data:`SOCKET_ENV` set to :attr:`socket_path` in its env."""
        return client_command(argv)

    def runtime_env(self) -> dict[str, Any]:
        """Ray ``runtime_env`` that starts an actor's worker process as a fork of this server."""
        return {"py_executable": f"{sys.executable} -I -S {CLIENT}", "env_vars": {SOCKET_ENV: self.socket_path}}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def serves(self, env: Mapping[str, str]) -> bool:
        """Whether a client with environment ``env`` would be forked (not run as a fresh interpreter)."""
        return not forkserver_client.differing(self.socket_path, env)

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


def shared(preload: str, env: Mapping[str, str], *, base: Mapping[str, str] | None = None,
           must_match: Sequence[str] = ()) -> ForkServer:
    """This process's fork server for ``preload`` with environment ``base | env`` (``base``: this
    process's by default; started on first use, restarted if it died, stopped at interpreter exit).

    Args:
        preload, must_match: as :meth:`ForkServer.start`.
        env: what the children's environment adds to ``base`` (e.g. the ranks' worker env).
        base: the environment ``env`` extends (default ``os.environ``).

    Returns:
        The serving :class:`ForkServer`.

    Raises:
        ForkServerError: it cannot be started.
    """
    full = {k: v for k, v in {**(os.environ if base is None else base), **env}.items() if k not in VOLATILE_ENV}
    # With must_match, only those decide what the server imported (its children get their client's
    # environment); without, all of it may.
    decides = {k: full.get(k, "") for k in must_match} if must_match else full
    key = (preload, tuple(sorted(decides.items())), tuple(must_match))
    with _SHARED_LOCK:
        server = _SHARED.get(key)
        if server is None or not server.alive():
            _stop_at_exit()
            server = _SHARED[key] = ForkServer.start(preload, full, must_match=must_match)
        return server


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
FORK_PYTHON_ENV = "HARNESS_FORK_PYTHON"
#: Sockets of the Python fork servers a process started, for its descendants' :func:`python_command`.
ADVERTISE_ENV = "HARNESS_PYTHON_FORKSERVERS"
_PYTHON: list[ForkServer] = []
_PYTHON_FAILED: set[str] = set()


def python_command(argv: Sequence[str], env: Mapping[str, str], *, preload: str, requires: Mapping[str, str] = {},
                   refuses: Sequence[str] = (), must_match: Sequence[str] = (),
                   reimport: Sequence[str] = ("harness",)) -> tuple[list[str], dict[str, str]]:
    """``argv`` and ``env`` that run a Python subprocess as a fork of a server that ran ``preload``.

    The server is started on first use with ``env`` (``record_env``: a later ``env`` that differs in
    any variable the preload read, or in :data:`SCANNED_PREFIXES`, gets a server of its own), and
    stopped at interpreter exit; this process's environment names it (:data:`ADVERTISE_ENV`), so a
    descendant (a ``rerun-test`` a test runs) forks from it too when its environment fits. The child runs as a fresh interpreter would (see
    :func:`_run_child`), so this changes the start-up cost, not the result. A command is returned
    unchanged (a fresh interpreter) when:

    * ``argv`` is not ``[sys.executable, "-m", MODULE, ...]`` or ``[sys.executable, SCRIPT, ...]``
      (interpreter options need a fresh interpreter);
    * ``$HARNESS_FORK_PYTHON`` is ``0`` (in ``env`` or here);
    * ``env`` lacks a value of ``requires`` (what the preload needs to leave one thread, such as
      ``OMP_NUM_THREADS=1``) or sets one of ``refuses`` (what the preload must not run with);
    * the server cannot start (logged; not tried again for this ``preload``).

    The forks of one server share its hash seed (``PYTHONHASHSEED`` unset: one random draw per
    server, not per command); set ``PYTHONHASHSEED``, or ``HARNESS_FORK_PYTHON=0``, to vary or pin it.

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
    if env.get(FORK_PYTHON_ENV, os.environ.get(FORK_PYTHON_ENV, "1")) == "0":
        return plain
    if any(env.get(k) != v for k, v in requires.items()) or any(env.get(k) for k in refuses):
        return plain
    base = {k: v for k, v in env.items() if k not in VOLATILE_ENV and k != ADVERTISE_ENV}
    with _SHARED_LOCK:
        server = next((s for s in _PYTHON if s.preload == preload and s.alive() and s.serves(env)), None)
        if server is None:
            inherited = next((path for path in _advertised(preload) if not forkserver_client.differing(path, env)), None)
            if inherited is not None:  # an ancestor's server (the test run's, for a rerun-test it started)
                return client_command(argv), {**env, SOCKET_ENV: inherited}
            if preload in _PYTHON_FAILED:  # once: a preload that failed would fail again, at its full cost
                return plain
            try:
                server = ForkServer.start(preload, base, must_match=must_match, record_env=True, reimport=reimport)
            except ForkServerError as e:
                _PYTHON_FAILED.add(preload)
                log.warning("%s; Python subprocesses of this process run as fresh interpreters", e)
                return plain
            _stop_at_exit()
            _PYTHON.append(server)
            # This process's Python subprocesses (a rerun-test a test starts) may fork from it too.
            os.environ[ADVERTISE_ENV] = os.pathsep.join([server.socket_path, *_advertised()])
    return server.command(argv), {**env, SOCKET_ENV: server.socket_path}


def _advertised(preload: str | None = None) -> list[str]:
    """Sockets of the Python fork servers this process or an ancestor started (``$HARNESS_PYTHON_FORKSERVERS``)
    that still serve (their process alive) ``preload`` (any, when None)."""
    out = []
    for path in filter(None, os.environ.get(ADVERTISE_ENV, "").split(os.pathsep)):
        try:
            with open(os.path.join(os.path.dirname(path), MATCH_FILE)) as f:
                match = json.load(f)
            os.kill(int(match["pid"]), 0)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # stopped, or not a fork server
        if preload is None or match.get("preload") == preload:
            out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.workers.forkserver", description=__doc__.splitlines()[0])
    p.add_argument("--socket", required=True, help="AF_UNIX path to listen on")
    p.add_argument("--preload", required=True, help="module:function to run once before serving")
    p.add_argument("--must-match", action="append", default=[], metavar="NAME",
                   help="an env var a client must share to be forked (repeatable)")
    p.add_argument("--record-env", action="store_true",
                   help="also require every env var the preload read, and the scanned families")
    p.add_argument("--reimport", action="append", default=[], metavar="PACKAGE",
                   help="a package each child imports afresh (repeatable)")
    args = p.parse_args(argv)
    try:
        return serve(args.socket, args.preload, args.must_match, args.record_env, args.reimport)
    except ForkServerError as e:
        print(f"forkserver: {e}", file=sys.stderr, flush=True)
        return 3


if __name__ == "__main__":
    sys.exit(main())
