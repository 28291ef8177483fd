"""A fork server for Ray workers: import a rank's heavy modules once, start every rank as a fork.

A simulated PD rank's process imports torch and sglang's memory paths: seconds of CPU per rank, paid by every
rank of every deployment. A :class:`ForkServer` imports them once and then only forks; the forked child *is*
the Ray worker (or one of the harness's own Python subprocesses, :func:`python_command`), placed and run as
before. How it works, its enforced limits and its modules: docs/modules.md.
"""

from harness.workers.forkserver.envmatch import SCANNED_PREFIXES
from harness.workers.forkserver.server_handle import (
    CLIENT,
    DEFAULT_START_TIMEOUT_S,
    MATCH_FILE,
    SOCKET_ENV,
    ForkServer,
    client_command,
)
from harness.workers.forkserver.sharing import (
    ADVERTISE_ENV,
    VOLATILE_ENV,
    Inherited,
    python_command,
    running_shared,
    shared,
    stop_shared,
)
from harness.workers.forkserver.policy import OFF_ENV, forks
from harness.workers.forkserver.serve import READY, ForkServerError

__all__ = [
    "OFF_ENV",
    "READY",
    "forks",
    "SCANNED_PREFIXES",
    "ForkServerError",
    "ADVERTISE_ENV",
    "CLIENT",
    "DEFAULT_START_TIMEOUT_S",
    "MATCH_FILE",
    "SOCKET_ENV",
    "VOLATILE_ENV",
    "ForkServer",
    "Inherited",
    "client_command",
    "python_command",
    "running_shared",
    "shared",
    "stop_shared",
]
