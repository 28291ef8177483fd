"""Worker lifecycle: payloads, ports, readiness deadline, typed death with a log tail, no orphans."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
import urllib.request

import pytest

from harness.workers import procs
from harness.clock import wait_for
from harness.workers import (
    CallCheck,
    HttpCheck,
    InProcess,
    PortCheck,
    Probe,
    Subprocess,
    Watchdog,
    WorkerDied,
    WorkerSpec,
    start_worker,
)

pytestmark = pytest.mark.est_time(20)

HTTP_SERVER = (
    "import http.server, sys; print('serving', flush=True); "
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()"
)
# 80 numbered lines, then a child in the same process group, then wait: the leader's death orphans the child.
CHATTY = "for i in $(seq 1 80); do echo line-$i; done; sleep 300 & echo child=$!; wait"


@pytest.fixture
def cluster(ray_cluster):
    return ray_cluster


@pytest.fixture
def started(cluster):
    """Start workers through this; every one is stopped after the test and its processes checked gone."""
    workers = []

    def start(spec, *args, **kwargs):
        w = start_worker(spec, *args, **kwargs)
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.stop(grace=1.0)
    pids = [p for w in workers if w.info for p in (w.info.pid, w.info.payload_pid) if p]
    assert procs.wait_gone(pids, 10) == [], "worker processes left behind"


def _child_pid(log_path) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = re.search(r"child=(\d+)", log_path.read_text())
        if m:
            return int(m.group(1))
        time.sleep(0.05)
    raise AssertionError("the payload never printed its child pid")


def test_in_process_payload_runs_in_the_actor(started, tmp_path):
    w = started(
        WorkerSpec(
            "probe", InProcess("harness.workers:Probe"), run_dir=tmp_path, ports=("http",), ready=(CallCheck("pid"),)
        )
    )
    assert w.call("pid") == w.info.pid != os.getpid()
    ctx = w.call("context")
    assert (ctx.name, ctx.ports, ctx.log_path) == ("probe", w.ports, str(tmp_path / "workers" / "probe.log"))
    w.call("say", "hello from the payload")
    assert "hello from the payload" in w.tail()
    with pytest.raises(ValueError, match="on purpose"):
        w.call("fail", "on purpose")
    w.check()  # a payload exception is not a death


def test_subprocess_server_gets_os_ports_and_a_log(started, tmp_path):
    w = started(
        WorkerSpec(
            "server",
            Subprocess((sys.executable, "-c", HTTP_SERVER, "{http}")),
            run_dir=tmp_path,
            ports=("http",),
            ready=(HttpCheck("http://127.0.0.1:{http}/"), PortCheck("http")),
            ready_timeout=60,
        )
    )
    port = w.ports["http"]
    assert 1024 < port < 65536
    with urllib.request.urlopen(w.url("http") + "/", timeout=10) as r:
        assert r.status == 200
    log = (tmp_path / "workers" / "server.log").read_text()
    assert f"[harness] exec {sys.executable} -c " in log and f" {port}\nserving" in log
    assert os.getpgid(w.info.payload_pid) == w.info.payload_pid  # its own process group


def test_a_subprocess_pythonpath_goes_in_front_of_the_workers_own(started, tmp_path):
    # The worker's own path (on a joined node: what Ray unpacked there) still follows a PYTHONPATH built elsewhere.
    w = started(
        WorkerSpec(
            "paths",
            Subprocess(("sh", "-c", "echo path=$PYTHONPATH; sleep 300"), env={"PYTHONPATH": "/front/b:/front/c"}),
            run_dir=tmp_path,
            env={"PYTHONPATH": "/own/a:/front/b"},
            ready_timeout=60,
        )
    )
    # A line of its own: the harness's "exec sh -c echo path=..." line names the command before it runs.
    wait_for(lambda: "\npath=" in w.tail(), 30.0, "the payload to print its PYTHONPATH")
    assert "path=/front/b:/front/c:/own/a\n" in (tmp_path / "workers" / "paths.log").read_text()


def test_readiness_deadline_stops_the_worker(started, tmp_path):
    spec = WorkerSpec(
        "never-ready",
        Subprocess(("sleep", "300")),
        run_dir=tmp_path,
        ports=("http",),
        ready=(PortCheck("http"),),
        ready_timeout=3,
    )
    with pytest.raises(TimeoutError, match=r"worker never-ready: not ready after 3 s") as e:
        started(spec)
    pid = int(re.search(r"\(payload pid (\d+)\)", str(e.value)).group(1))
    assert procs.wait_gone([pid], 10) == []


def test_a_payload_that_exits_at_start_raises_worker_died(started, tmp_path):
    spec = WorkerSpec(
        "crasher",
        Subprocess(("sh", "-c", "echo about to fail; exit 3")),
        run_dir=tmp_path,
        ready=(PortCheck("http"),),
        ports=("http",),
        ready_timeout=60,
    )
    with pytest.raises(WorkerDied) as e:
        started(spec)
    assert e.value.name == "crasher"
    assert re.fullmatch(r"subprocess pid \d+ \(sh\) exit code 3", e.value.cause)
    assert "about to fail" in e.value.tail


def test_sigkill_of_the_payload_raises_worker_died_with_the_last_50_lines(started, tmp_path):
    w = started(WorkerSpec("chatty", Subprocess(("sh", "-c", CHATTY)), run_dir=tmp_path))
    child = _child_pid(w.log_path)
    os.kill(w.info.payload_pid, signal.SIGKILL)
    with pytest.raises(WorkerDied) as e:
        for _ in range(100):
            w.check()
            time.sleep(0.05)
    died = e.value
    assert died.cause == f"subprocess pid {w.info.payload_pid} (sh) exit code -9 (killed by SIGKILL)"
    lines = died.tail.splitlines()
    assert len(lines) == 50 and lines[-1] == f"child={child}" and lines[0] == "line-32"
    assert "worker chatty died: subprocess pid" in str(died)
    assert procs.alive(child)  # orphaned in the group until the worker is stopped ...
    w.stop(grace=1.0)
    assert procs.wait_gone([child], 10) == []  # ... which kills the whole group


def test_a_fatal_line_in_the_log_is_the_payloads_death_though_it_runs(started, tmp_path):
    """A server whose serving thread died keeps running: the line it logs (a Subprocess's ``fatal``)
    makes the worker dead, with that line as the cause; text before it, or on a line not yet ended, is not."""
    script = (
        "echo 'Transfer thread starting'; printf 'Transfer thread failed because of 42'; sleep 1; "
        "echo '. Prefill instance is dead.'; exec sleep 300"
    )
    w = started(
        WorkerSpec(
            "server", Subprocess(("sh", "-c", script), fatal=("Transfer thread failed because of",)), run_dir=tmp_path
        )
    )
    assert w.poll() is None  # the fatal text is written, its line not yet ended
    with pytest.raises(WorkerDied) as e:
        for _ in range(200):
            w.check()
            time.sleep(0.05)
    assert (
        e.value.cause
        == "its log says it no longer serves: Transfer thread failed because of 42. Prefill instance is dead."
    )
    assert procs.alive(w.info.payload_pid), "the process itself still runs"
    w.stop(grace=1.0)
    assert procs.wait_gone([w.info.payload_pid], 10) == []


def test_sigkill_of_the_actor_raises_worker_died_and_leaves_no_orphans(started, tmp_path):
    w = started(WorkerSpec("victim", Subprocess(("sh", "-c", CHATTY)), run_dir=tmp_path))
    child = _child_pid(w.log_path)
    os.kill(w.info.pid, signal.SIGKILL)
    with pytest.raises(WorkerDied, match=r"worker victim died: actor died"):
        for _ in range(200):
            w.check()
            time.sleep(0.05)
    w.stop(grace=1.0)
    assert procs.wait_gone([w.info.pid, w.info.payload_pid, child], 10) == []


def test_stop_escalates_to_sigkill_for_a_group_ignoring_sigterm(started, tmp_path):
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('stubborn', flush=True); time.sleep(300)"
    )
    w = started(WorkerSpec("stubborn", Subprocess((sys.executable, "-c", code)), run_dir=tmp_path))
    # Its line (not the exec line quoting the code): the SIGTERM handler is installed.
    wait_for(lambda: "stubborn" in w.log_path.read_text().splitlines(), 30, "the payload ignoring SIGTERM")
    w.stop(grace=0.5)
    assert procs.wait_gone([w.info.payload_pid], 10) == []
    assert procs.group_members(w.info.payload_pid) == []


def test_watchdog_reports_a_death_once(started, tmp_path):
    deaths = []
    w = started(WorkerSpec("watched", Subprocess(("sleep", "300")), run_dir=tmp_path))
    dog = Watchdog(deaths.append, interval=0.05).start()
    try:
        dog.add(w)
        t0 = time.monotonic()
        os.kill(w.info.payload_pid, signal.SIGKILL)
        while not deaths and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        latency = time.monotonic() - t0
        time.sleep(0.3)
    finally:
        dog.close()
    assert [d.name for d in deaths] == ["watched"]
    print(f"watchdog noticed the death after {latency:.2f} s")


class _PolledWorker:
    """Just what the watchdog reads of a worker: its poll blocks until the test lets it answer."""

    node = None
    _stopped = False
    name = "raced"

    def __init__(self):
        self.polling, self.answer, self.dead = threading.Event(), threading.Event(), False

    def poll(self, timeout=None):
        self.polling.set()
        self.answer.wait(10)
        return "exit code -9 (killed by SIGKILL)" if self.dead else None

    def _died(self, cause):
        return WorkerDied(self.name, cause, "")


def test_watchdog_does_not_report_a_worker_removed_while_it_was_being_polled():
    # The kill-on-purpose order (stacks.kill): remove, then SIGKILL. A round that had already taken
    # its snapshot and was inside poll() must not report the death (CI failed on exactly this).
    deaths = []
    w = _PolledWorker()
    dog = Watchdog(deaths.append, interval=0.01).start()
    try:
        dog.add(w)
        assert w.polling.wait(10), "the watchdog never polled"
        dog.remove(w)
        w.dead = True
        w.answer.set()
        time.sleep(0.3)
    finally:
        dog.close()
    assert deaths == []


def test_no_port_is_handed_out_twice_in_20_back_to_back_starts(started, tmp_path):
    seen = []
    for i in range(20):
        w = started(WorkerSpec(f"port-{i}", InProcess(Probe), run_dir=tmp_path, ports=("http",)))
        seen.append(w.ports["http"])
        w.stop(grace=0.5)
    assert len(set(seen)) == 20, seen
    assert sorted(int(x) for x in (tmp_path / "ports").read_text().split()) == sorted(seen)


def test_non_contiguous_gpu_ids_reach_cuda_visible_devices(started, cluster, tmp_path):
    if not cluster.simulate:
        pytest.skip("needs the simulated session cluster (--simulate on a machine without GPUs)")
    from ray.util.placement_group import placement_group, remove_placement_group

    import ray

    pin = {"CPU": 0.1, "harness_node_0": 0.001}
    singles = [placement_group([{**pin, "GPU": 1}], strategy="STRICT_PACK") for _ in range(3)]
    pair = None
    try:
        for pg in singles:
            assert pg.wait(30)
        held = ray.available_resources().get("GPU", 0)
        remove_placement_group(singles[1])  # frees the middle GPU only
        # The pair must be placed after that GPU is back, or it takes two contiguous free ones.
        wait_for(lambda: ray.available_resources().get("GPU", 0) >= held + 1, 30, "the middle GPU freed")
        pair = placement_group([{**pin, "GPU": 2}], strategy="STRICT_PACK")
        assert pair.wait(30)
        w = started(WorkerSpec("two-gpus", InProcess(Probe), run_dir=tmp_path), pair)
        ids = list(w.gpu_ids)
        assert len(ids) == 2 and ids != list(range(ids[0], ids[0] + 2)), f"expected non-contiguous ids, got {ids}"
        assert w.call("env", "CUDA_VISIBLE_DEVICES") == ",".join(map(str, ids)) == w.info.cuda_visible_devices
        w.stop(grace=0.5)
    finally:
        for pg in [singles[0], singles[2]] + ([pair] if pair else []):
            remove_placement_group(pg)
