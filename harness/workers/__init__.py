"""Workers: one Ray actor per rank that owns its payload from start to reap (Dynamo's lifecycle, made
small), and what they stand on.

A payload is either

* :class:`InProcess` — an object built inside the actor (``cls(*args, **kwargs)``; ``cls`` may be a
  class or an import string ``"pkg.mod:Class"`` so the driver need not import it); its methods are
  called remotely with :meth:`Worker.call`; or
* :class:`Subprocess` — a command (a server) started by the actor in its own process group, with
  stdout+stderr (its children's too) written to the worker's log file.

Every worker has a log file ``<run_dir>/workers/<name>.log`` (the actor's own stdout/stderr go there
too), ports leased from the harness's own range and reported back (:mod:`.ports`; named in
:attr:`WorkerSpec.ports`; ``{name}`` placeholders in a subprocess's argv/env and in check URLs are
replaced by them; no port is handed out twice on one machine), ``CUDA_VISIBLE_DEVICES`` set from
the GPU ids Ray assigned (they may be non-contiguous, e.g. ``"1,3"``), and a readiness deadline
during which every poll first checks that the actor and its subprocess are alive. A worker that
dies raises :class:`WorkerDied` (name, cause, last 50 log lines; a lost node is named in the cause)
— from :meth:`Worker.wait_ready`, :meth:`Worker.call`, :meth:`Worker.check`, and, while a pytest
test runs, from the test itself (the plugin arms a :class:`Watchdog`). Stop is graceful: SIGTERM to
the process group, a bounded wait, SIGKILL; then the actor is killed.

Modules, one concern each: :mod:`.spec` (what to run, how to tell it is ready), :mod:`.actor` (the
actor body, inside its process), :mod:`.handle` (the driver's :class:`Worker`, :func:`start_worker`),
:mod:`.watchdog`, :mod:`.nodes` (which Ray node a worker runs on), :mod:`.probe`; below them
:mod:`.procs` (the process registry), :mod:`.ports`, :mod:`.forkserver` (start actors and the
harness's Python subprocesses as forks of a preloaded process) and :mod:`.suiterun` (pytest inside
a worker).

API::

    WorkerSpec(name, payload, *, run_dir, ports=(), ready=(), ready_timeout=120.0, env={},
               num_cpus=0.1, stop_grace=5.0, runtime_env=None, setup=())
    InProcess(cls, args=(), kwargs={})                 # cls: class or "module:Class"
    Subprocess(argv, env={}, cwd=None, fatal=())       # argv items may contain "{port_name}"
    HttpCheck(url, status=200) | PortCheck(port) | CallCheck(method)   # readiness checks
    start_worker(spec, group=None, bundle_index=0, timeout=None) -> Worker   # started and ready
    launch_worker(spec, group=None, bundle_index=0, timeout=None) -> Worker  # started, ports known; then
    worker.wait_ready(timeout=None)                                          # ready
    Probe                            # a ready-made in-process payload: context(), env(name), pid(), echo(x)
    worker.call(method, *args, timeout=60.0, **kwargs) -> Any               # in-process payloads
    worker.info -> WorkerInfo(name, node_id, hostname, pid, gpu_ids, cuda_visible_devices,
                              ports, log_path, payload_pid, payload_start)
    worker.ports["http"], worker.url("http")                                # "http://127.0.0.1:PORT"
    worker.poll() -> str | None      # None while alive, else the cause
    worker.check()                   # raises WorkerDied
    worker.tail(n=50) -> str
    worker.stop(grace=None)          # idempotent; kills the whole process group
    worker.node -> NodeRef | None    # the Ray node it runs on (label, raylet address)
    current() -> WorkerContext       # inside an in-process payload: name, gpu_ids, ports, log_path

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
from harness.workers.nodes import NodeRef
from harness.workers.probe import Probe
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

__all__ = ["TAIL_LINES", "CallCheck", "Check", "HttpCheck", "InProcess", "NodeRef", "PlacementBundles", "PortCheck", "RolePlacement",
           "Probe", "Subprocess", "Watchdog", "Worker", "WorkerContext", "WorkerDied", "WorkerInfo", "WorkerSpec",
           "WorkerStartError", "current", "launch_worker", "payload_error", "start_worker", "tail_file"]
