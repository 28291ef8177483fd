"""Workers: one Ray actor per rank that owns its payload from start to reap (the spec, the actor, the
driver's handle, the watchdog), and what they stand on: the process registry (:mod:`.procs`), the
port leases (:mod:`.ports`), the fork server that starts them preloaded (:mod:`.forkserver`).

The public names are re-exported here; see :mod:`harness.workers.worker`.
"""

from harness.workers.worker import (
    TAIL_LINES,
    CallCheck,
    HttpCheck,
    InProcess,
    NodeRef,
    PortCheck,
    Probe,
    Subprocess,
    Watchdog,
    Worker,
    WorkerContext,
    WorkerDied,
    WorkerInfo,
    WorkerSpec,
    WorkerStartError,
    current,
    start_worker,
    tail_file,
)

__all__ = ["TAIL_LINES", "CallCheck", "HttpCheck", "InProcess", "NodeRef", "PortCheck", "Probe", "Subprocess",
           "Watchdog", "Worker", "WorkerContext", "WorkerDied", "WorkerInfo", "WorkerSpec", "WorkerStartError",
           "current", "start_worker", "tail_file"]
