"""A fork server for Ray workers: import a rank's heavy modules once, start every rank as a fork.

A simulated PD rank is a Ray actor whose process imports torch and sglang's memory paths: seconds
of CPU per rank, paid again by every rank of every deployment. A :class:`ForkServer` is one
process that imported them once (``preload``: ``"module:function"``, called once) and then only
forks. A Ray actor started with :meth:`ForkServer.runtime_env` (Ray's documented ``py_executable``
runtime-env field) is launched by Ray through :mod:`.client`, which hands the
worker's argv, environment, working directory and stdio to the server; the forked child runs Ray's
own ``default_worker.py`` with them. The child *is* the Ray worker: the actor is still created by
Ray, placed in its placement-group bundle, and runs the same code, on modules that were imported
before the fork instead of after it.

Limits, each enforced:

* the server refuses to serve when ``preload`` left more than one thread (a fork copies only the
  calling thread; a lock held by another would stay held forever in every child);
* modules read some environment at import (sglang's env flags, ``HARNESS_FAULTS``, OpenMP's thread
  count): the server is started with the environment its ranks get, and :func:`shared` keeps one
  server per distinct environment. A server started ``free_path`` also forks a client whose
  ``PYTHONPATH`` differs when no directory that differs holds a module its preload imported (the
  child rebuilds ``sys.path`` from its own), and ``shared(advertise=True)`` names it to the
  processes started after, whose own :func:`shared` then uses it (the fault check's runs);
* nothing that touches a GPU may run before the fork (a CUDA context does not survive one): callers
  use it only for ranks without real GPUs (:func:`harness.engines.sim.deploy.start` decides).

The same server starts the harness's own Python subprocesses (:func:`python_command`: the fault
check's pytest runs, ``rerun-test``'s groups). Such a child must behave as the fresh interpreter it
replaces, and does: it gets the client's argv, environment, working directory, stdio, priority and
SIGINT disposition (KeyboardInterrupt); what the preload's imports set in the environment; its own
torch and numpy seeds; on exit, its threads joined and its ``atexit`` handlers run, and a death by
signal for an uncaught KeyboardInterrupt. A client leading its own session (started with
``start_new_session``) has its child lead one too, so a signal or a kill of that session reaches
everything the command started. Whatever the preload read from the environment (recorded while it
runs) and every variable of :data:`~.envmatch.SCANNED_PREFIXES` must be equal for a client to be forked.

The server stops with :meth:`ForkServer.stop` (and at interpreter exit for :func:`shared` ones); it
also exits when the process that started it is gone, and it is registered in :mod:`harness.workers.procs` so a run killed
with SIGKILL has it reaped by the next one. A child dies with its client (Ray's stand-in process).

Modules: :mod:`.handle` (the driver's :class:`ForkServer`, :func:`shared`, :func:`python_command`),
:mod:`.policy` (which processes start as forks, and the one switch ``HARNESS_FORK_START=0``),
:mod:`.serve` (the server process), :mod:`.child` (what a forked child does to become its client's
process), :mod:`.envmatch` (which environment a client must share), :mod:`.client` (the stdlib-only
client Ray runs as a worker's ``py_executable``).
"""

from harness.workers.forkserver.envmatch import SCANNED_PREFIXES
from harness.workers.forkserver.handle import (
    ADVERTISE_ENV,
    CLIENT,
    DEFAULT_START_TIMEOUT_S,
    MATCH_FILE,
    SOCKET_ENV,
    VOLATILE_ENV,
    ForkServer,
    Inherited,
    client_command,
    python_command,
    running_shared,
    shared,
    stop_shared,
)
from harness.workers.forkserver.policy import OFF_ENV, forks
from harness.workers.forkserver.serve import READY, ForkServerError

__all__ = ["OFF_ENV", "READY", "forks", "SCANNED_PREFIXES", "ForkServerError", "ADVERTISE_ENV", "CLIENT", "DEFAULT_START_TIMEOUT_S", "MATCH_FILE", "SOCKET_ENV", "VOLATILE_ENV", "ForkServer", "Inherited", "client_command", "python_command", "running_shared", "shared", "stop_shared"]
