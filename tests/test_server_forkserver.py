"""Real CPU servers start as forks of the server fork server (harness.targets.sglang.server.stack):
the Ray worker runs the fork server's client, the server itself is a child of the fork server named
by its real command, at the worker's priority, with sglang imported after its own sitecustomize
(compat patches and probe installed in it), and the stack serves. Same model and flags as
``test_disaggregation_basic_server.py``, so in one session both use one stack."""

from __future__ import annotations

import psutil
import pytest

from harness import forkserver
from harness.targets.sglang.preload import SERVER_PRELOAD

MODEL = "tiny-llama"

pytestmark = [pytest.mark.engine("sglang-server", models=(MODEL,), gpu_topologies=("2-gpu-h100",),
                                 server_args=("--page-size", "64")),
              pytest.mark.topology("cpu"), pytest.mark.est_time(30), pytest.mark.timeout(900)]


def test_cpu_servers_are_forks_of_the_preloaded_fork_server(sglang_servers):
    stack = sglang_servers.pd(MODEL)
    assert sglang_servers.forkserver, "servers on the embedded cpu cluster should start from the fork server"
    servers = [s for s in forkserver.running_shared() if f"--preload {SERVER_PRELOAD}" in " ".join(psutil.Process(s.pid).cmdline())]
    assert len(servers) == 1, f"expected one server fork server, found {len(servers)}"
    children = {c.pid: c for c in psutil.Process(servers[0].pid).children()}
    for w in (stack.prefill, stack.decode):
        client = psutil.Process(w.info.payload_pid)
        assert "forkserver_client.py" in " ".join(client.cmdline()), client.cmdline()
        log = open(w.info.log_path, errors="replace").read()
        assert "differ from the fork server's" not in log, f"{w.name} ran as a fresh interpreter"
        # The process serving is a fork-server child named by the real command, at the worker's priority.
        mine = [c for c in children.values() if f"--port {w.ports['http']} " in " ".join(c.cmdline())]
        assert len(mine) == 1, f"{w.name}: no fork-server child serves port {w.ports['http']}"
        assert "-m sglang.launch_server" in " ".join(mine[0].cmdline())
        assert mine[0].nice() == client.nice()
        # sglang was imported after the child's sitecustomize: the probe and the patches are in it.
        assert f"accounting probe installed in pid {mine[0].pid}" in log
        assert f"compat patch cpu-fork-children applied in pid {mine[0].pid}" in log
    assert stack.client("router").generate(list(range(4, 70)), 4).output_ids
