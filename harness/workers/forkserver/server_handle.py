"""The driver's side of one fork server: start it (:meth:`ForkServer.start`), stop it, and use it by its
socket (the client command, a Ray actor's runtime environment, whether it forks an environment). Sharing one
per preload and environment, and the harness's Python subprocesses as forks: :mod:`.sharing`. The whole
story: the package's section in docs/modules.md (:mod:`harness.workers.forkserver`).
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from harness.clock import Deadline
from harness.workers import procs
from harness.workers.forkserver import client
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


class BySocket:
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
        match = match_of(self.socket_path)
        return match[0] if match else None


def match_of(socket_path: str) -> tuple[int, dict] | None:
    """The serving pid and the whole :data:`MATCH_FILE` of the server at ``socket_path`` (None: no
    readable file, not a fork server's)."""
    try:
        with open(os.path.join(os.path.dirname(socket_path), MATCH_FILE)) as f:
            match = json.load(f)
        return int(match["pid"]), match
    except (OSError, ValueError, KeyError, TypeError):
        return None


class ForkServer(BySocket):
    """A started fork server (see the module docstring); use :meth:`runtime_env` on Ray actors."""

    def __init__(
        self, proc: subprocess.Popen, socket_path: str, log_path: Path, tmpdir: str, preload: str = ""
    ) -> None:
        self.proc = proc
        self.preload = preload
        self.socket_path = socket_path
        self.log_path = log_path
        self._tmpdir = tmpdir

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(
        cls,
        preload: str,
        env: Mapping[str, str] | None = None,
        timeout: float = DEFAULT_START_TIMEOUT_S,
        must_match: Sequence[str] = (),
        record_env: bool = False,
        reimport: Sequence[str] = (),
        free_path: bool = False,
        launch: Launch | None = None,
    ) -> "ForkServer":
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
                fork of a server whose preload this one's extends (:func:`.sharing.python_command` with
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
