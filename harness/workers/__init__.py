"""Workers: one Ray actor per rank that owns its payload from start to reap (Dynamo's lifecycle, made
small), and what they stand on.

A payload is an :class:`InProcess` object built inside the actor or a :class:`Subprocess` (a server) in
its own process group. A worker that dies raises :class:`WorkerDied` wherever the driver touches it.
The API list, the lifecycle and the modules: docs/modules.md.

Example (an in-process payload and a server subprocess, each in its placement group; run by
``tests/test_examples.py``)::

    import sys, tempfile
    from harness import topology
    from harness.cluster import Cluster
    from harness.workers import HttpCheck, InProcess, Probe, Subprocess, WorkerSpec, start_worker

    run_dir = tempfile.mkdtemp()
    topo = topology.get("2-gpu-h100")
    with Cluster.start(topo, simulate=True) as cluster:
        placement = cluster.place(topo)
        dec = start_worker(WorkerSpec("decode-0", InProcess(Probe), run_dir=run_dir), placement.of("decode")[0])
        assert dec.call("context").gpu_ids == dec.gpu_ids        # runs in the actor
        srv = start_worker(WorkerSpec("http-0", Subprocess((sys.executable, "-m", "http.server", "{http}")),
                                      run_dir=run_dir, ports=("http",),
                                      ready=(HttpCheck("http://127.0.0.1:{http}/"),)),
                           placement.of("prefill")[0])
        assert srv.url("http").startswith("http://127.0.0.1:")
        srv.stop()
        dec.stop()
        cluster.release(placement)
"""

from harness.workers.actor import current, tail_file
from harness.workers.handle import Worker, launch_worker, payload_error, start_worker
from harness.workers.node_ref import NodeRef
from harness.workers.probe_payload import Probe
from harness.workers.spec import (
    TAIL_LINES,
    CallCheck,
    Check,
    HttpCheck,
    InProcess,
    PlacementBundles,
    PortCheck,
    RolePlacement,
    Subprocess,
    WorkerContext,
    WorkerDied,
    WorkerInfo,
    WorkerSpec,
    WorkerStartError,
)
from harness.workers.watchdog import Watchdog

__all__ = [
    "TAIL_LINES",
    "CallCheck",
    "Check",
    "HttpCheck",
    "InProcess",
    "NodeRef",
    "PlacementBundles",
    "PortCheck",
    "RolePlacement",
    "Probe",
    "Subprocess",
    "Watchdog",
    "Worker",
    "WorkerContext",
    "WorkerDied",
    "WorkerInfo",
    "WorkerSpec",
    "WorkerStartError",
    "current",
    "launch_worker",
    "payload_error",
    "start_worker",
    "tail_file",
]
