"""Real CPU servers start as forks of the server fork server (harness.engines.server.stack),
and the next model's stack starts ahead of its tests (harness.plugins.servers):
the Ray worker runs the fork server's client, the server itself is a child of the fork server named
by its real command, at the worker's priority, with sglang imported after its own sitecustomize
(compat patches and probe installed in it), and the stack serves. A stack's router starts beside its
servers and registers them once ready, and a router that cannot start leaves no server behind. Same
model and flags as ``test_disaggregation_basic_server.py``, so in one session both use one stack."""

from __future__ import annotations

import dataclasses
import os
import re
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from harness import topology
from harness.workers import forkserver
from harness.engines.server.server_preload import SERVER_PRELOAD

MODEL = "tiny-llama"

pytestmark = [
    pytest.mark.engine(
        "sglang-server", models=(MODEL,), gpu_topologies=("2-gpu-h100",), server_args=("--page-size", "64")
    ),
    pytest.mark.topology("cpu"),
    pytest.mark.est_time(45),
    pytest.mark.timeout(900),
]


def test_cpu_servers_are_forks_of_the_preloaded_fork_server(sglang_servers):
    stack = sglang_servers.pd(MODEL)
    assert sglang_servers.forkserver, "servers on the embedded cpu cluster should start from the fork server"
    servers = [
        s
        for s in forkserver.running_shared()
        if f"--preload {SERVER_PRELOAD}" in " ".join(psutil.Process(s.pid).cmdline())
    ]
    assert servers, "no server fork server is running"
    children = {c.pid: c for s in servers for c in psutil.Process(s.pid).children()}
    parents = set()
    for w in (stack.prefill, stack.decode):
        client = psutil.Process(w.info.payload_pid)
        assert "forkserver/client.py" in " ".join(client.cmdline()), client.cmdline()
        log = open(w.info.log_path, errors="replace").read()
        assert "differ from the fork server's" not in log, f"{w.name} ran as a fresh interpreter"
        # The process serving is a fork-server child named by the real command, at the worker's priority.
        mine = [c for c in children.values() if f"--port {w.ports['http']} " in " ".join(c.cmdline())]
        assert len(mine) == 1, f"{w.name}: no fork-server child serves port {w.ports['http']}"
        assert "-m sglang.launch_server" in " ".join(mine[0].cmdline())
        assert mine[0].nice() == client.nice()
        parents.add(mine[0].ppid())
        # sglang was imported after the child's sitecustomize: the probe and the patches are in it.
        assert f"accounting probe installed in pid {mine[0].pid}" in log
        assert f"compat patch cpu-fork-children applied in pid {mine[0].pid}" in log
    assert len(parents) == 1, "prefill and decode (same environment) did not share one fork server"
    assert stack.client("router").generate(list(range(4, 70)), 4).output_ids


def test_a_faults_patched_sglang_on_the_path_forks_from_the_same_server(sglang_servers, tmp_path):
    """A server whose path starts with a fault's scratch copy of ``sglang/`` (what the fault check's
    runs give theirs) is served by the fork server already running: the server preload imports
    nothing from any ``PYTHONPATH`` directory (free path on), so no run starts one of its own."""
    from harness.engines.server import launcher, stack as server_stack

    sglang_servers.pd(MODEL)
    running = {
        s.socket_path
        for s in forkserver.running_shared()
        if f"--preload {SERVER_PRELOAD}" in " ".join(psutil.Process(s.pid).cmdline())
    }
    assert running, "no server fork server is running"
    overlay = tmp_path / "overlay"
    (overlay / "sglang").mkdir(parents=True)
    cmd = launcher.plain_server_command(topology.get("cpu"), model="m", ports=launcher.ServerPorts(http=0, nccl=0))
    env = server_stack.command_env(cmd)
    env["PYTHONPATH"] = os.pathsep.join([str(overlay), env["PYTHONPATH"]])
    assert server_stack.fork_server(env).socket_path in running


def test_the_next_models_stack_starts_ahead_in_its_own_placement(request, ray_cluster, run_dir, caplog):
    """While one model's tests run, the next model's PD stack and baseline start in the background,
    in a placement of their own (the running model keeps its bundles for a fresh stack); the test
    that asks for them gets that stack; stopping the last model frees every placement, and closing
    leaves nothing. Each server exits on the stop's SIGTERM: none waits out the grace to be killed
    (sglang's crash diagnostics, a 5 s sleep, are off on CPU)."""
    from harness import topology
    from harness.plugins.stacks import session_stacks

    stacks = session_stacks(
        request.config, ray_cluster, topology.get("cpu"), run_dir, server_args=("--page-size", "64")
    )
    stacks.order = ["tiny-llama", "tiny-mellum-swa"]
    try:
        stacks.prestart_next("tiny-llama")
        assert len(stacks._more_placements) == 1, "the stack ahead has no placement of its own"
        stack = stacks.pd("tiny-mellum-swa", with_plain=True)
        assert stacks.taken_ahead == ["tiny-mellum-swa"]
        assert all(w in stacks.workers for w in (*stack.workers, stacks.plain("tiny-mellum-swa"))), (
            "not owned by the tests"
        )
        ids = list(range(4, 90))
        assert stack.client("router").generate(ids, 4).output_ids
        stacks.prestart_next("tiny-mellum-swa")  # the last model: nothing to start
        assert len(stacks._more_placements) == 1
        # Its last test done, nothing runs in the placements: they are given back (a later test of
        # the session may place the same topology, and Ray's group names are unique).
        stacks.stop_model("tiny-mellum-swa")
        assert stacks._more_placements == [] and stacks._placement is None
    finally:
        left = stacks.close()
    assert left == [], f"server processes left: {left}"
    # A server that outlived the stop's grace fails this only when sglang's crash diagnostics held it (their
    # 5 s sleep logs "before crash diagnostics"): on a loaded 2-core runner a clean shutdown can outlast the
    # grace too, so the time alone is no evidence (fresh-clone CI at load 10+ saw that).
    killed = [r.getMessage() for r in caplog.records if "ignored SIGTERM" in r.getMessage()]
    held = [
        p.name
        for p in Path(run_dir.workers).glob("*.log")
        if "before crash diagnostics" in p.read_text(errors="replace")
    ]
    assert not held, f"servers waited for sglang's crash diagnostics before exiting: {held} (killed: {killed})"
    assert stacks._more_placements == [] and stacks._placement is None


def test_the_router_starts_beside_its_servers_and_registers_them_once_ready(sglang_servers):
    # The session's stack of this model (started once, shared with the tests above).
    stack = sglang_servers.pd(MODEL)
    router = psutil.Process(stack.router.info.payload_pid)
    router_cmd = " ".join(router.cmdline())
    assert "--prefill" not in router_cmd and "--decode" not in router_cmd, router_cmd
    # It was up before the servers: started while they were still loading (a router started after
    # them, given their URLs, would start later than their "ready to roll" line).
    started = datetime.fromtimestamp(router.create_time()).replace(microsecond=0)
    for w in (stack.prefill, stack.decode):
        ready = [
            ln for ln in open(w.info.log_path, errors="replace") if "The server is fired up and ready to roll" in ln
        ]
        assert ready, f"{w.name} never logged that it is ready"
        at = datetime.strptime(ready[0][1:20], "%Y-%m-%d %H:%M:%S")
        assert started < at, f"router started at {started}, after {w.name} was ready at {at}"
    # Registered through /workers once each was ready: both listed, healthy, with prefill's bootstrap port.
    listed = {w["worker_type"]: w for w in stack.client("router").workers()}
    assert set(listed) == {"prefill", "decode"} and all(w.get("is_healthy") for w in listed.values()), listed
    assert listed["prefill"]["url"] == stack.prefill.url("http") and listed["decode"]["url"] == stack.decode.url("http")
    assert listed["prefill"].get("bootstrap_port") == stack.prefill.ports["bootstrap"], listed["prefill"]


def test_a_router_that_cannot_start_stops_the_servers_launched_beside_it(ray_cluster, run_dir):
    # The router's command fails (a topology with no router role) while prefill and decode are still
    # being launched beside it: the error is raised, and both servers, launched a moment later, are
    # stopped too, not left running outside the stack.
    from harness.engines.server.launcher import LaunchError
    from harness.engines.server.models import ensure_model
    from harness.engines.server.stack import start_pd_stack

    cpu = topology.get("cpu")
    no_router = dataclasses.replace(cpu, roles=tuple(r for r in cpu.roles if r.kind != "router"))
    names = ("prefill-norouter", "decode-norouter", "router-norouter")
    with pytest.raises(LaunchError, match="no router role"):
        start_pd_stack(
            no_router,
            ensure_model(MODEL),
            run_dir.root,
            names=names,
            forkserver=ray_cluster.starts_forked("server", cpu),
        )
    for name in names[:2]:
        log = (run_dir.workers / f"{name}.log").read_text()
        assert "[harness] exec " in log, f"{name} was never launched"
        port = re.search(r"'http': (\d+)", log).group(1)
        left = [
            p.pid for p in psutil.process_iter(["cmdline"]) if f"--port {port} " in " ".join(p.info["cmdline"] or ())
        ]
        assert left == [], f"{name} left running: {left}"
