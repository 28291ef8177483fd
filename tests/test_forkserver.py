"""The fork server: ranks forked from a process that imported sglang are still Ray actors in their
bundles running the real pools; the server forks only when safe; a child never outlives its client;
the preload covers everything a rank imports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from harness import forkserver, topology
from harness.forkserver import CLIENT, SOCKET_ENV, ForkServer, ForkServerError
from harness.pd import deploy
from harness.pd.run import run
from harness.pd.spec import KVSpec, PDRequest

pytestmark = [pytest.mark.est_time(60), pytest.mark.timeout(600)]

SPEC = KVSpec(kind="swa", page_size=64, window=100, full_tokens=32 * 64, swa_tokens=12 * 64, req_slots=8)


def _module(tmp_path, name: str, body: str) -> dict[str, str]:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def _client(server: ForkServer, argv: list[str], extra_env: dict | None = None, **kw) -> subprocess.Popen:
    env = {**os.environ, **(extra_env or {}), SOCKET_ENV: server.socket_path}
    return subprocess.Popen([sys.executable, "-I", "-S", str(CLIENT), *argv], env=env, **kw)


def test_child_runs_the_script_with_the_clients_argv_env_and_exit_status(tmp_path):
    env = _module(tmp_path, "fs_preload", "import json\nLOADED = True\n")
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        print("args", sys.argv[1:], os.environ["CHILD_VAR"], "fs_preload" in sys.modules, flush=True)
        sys.exit(7)
    """))
    server = ForkServer.start("fs_preload", env)
    try:
        out = tmp_path / "out.txt"
        with open(out, "w") as f:
            p = _client(server, [str(script), "a", "b"], {"CHILD_VAR": "x"}, stdout=f)
            assert p.wait(60) == 7
        # The script got the client's argv, env and stdout, in a process that had the preload imported.
        assert out.read_text().strip() == "args ['a', 'b'] x True"
    finally:
        server.stop()
    assert not server.alive()


def test_child_dies_with_its_client(tmp_path):
    script = tmp_path / "sleeper.py"
    pidfile = tmp_path / "pid"
    script.write_text(f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    server = ForkServer.start("os")
    try:
        p = _client(server, [str(script)])
        deadline = time.monotonic() + 30
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.05)
        child = int(pidfile.read_text())
        assert psutil.Process(child).ppid() == server.pid
        p.kill()  # what a raylet's SIGKILL of the process it started does
        p.wait(10)
        assert psutil.wait_procs([psutil.Process(child)], timeout=10)[1] == [], "the child outlived its client"
    finally:
        server.stop()


def test_server_refuses_to_fork_with_threads_running(tmp_path):
    env = _module(tmp_path, "fs_threads", """
        import threading, time
        def start():
            threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    """)
    with pytest.raises(ForkServerError, match="left 2 threads; a fork would copy only one"):
        ForkServer.start("fs_threads:start", env)


def test_preload_covers_every_sglang_module_a_rank_imports():
    """A rank built after the preload (SWA and DeepSeek-V4 hisparse pools) imports no further sglang
    module: the fork server's children run only code imported before the fork."""
    code = textwrap.dedent("""
        import sys, tempfile
        from harness.targets.sglang.preload import rank
        rank()
        before = {m for m in sys.modules if m.startswith(("sglang", "harness"))}
        from harness.pd.decode import DecodeWorker
        from harness.pd.prefill import PrefillWorker
        from harness.pd.spec import KVSpec
        d = tempfile.mkdtemp()
        for spec in (KVSpec(kind="swa", page_size=64, window=100, full_tokens=24 * 64, swa_tokens=10 * 64),
                     KVSpec(kind="dsv4", page_size=256, window=128, hisparse=True, full_tokens=16 * 256,
                            swa_tokens=8 * 256)):
            DecodeWorker("d", 0, spec, d)
            PrefillWorker("p", 0, spec, d)
        print("NEW", sorted(m for m in sys.modules if m.startswith(("sglang", "harness")) and m not in before))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    new = next(line for line in r.stdout.splitlines() if line.startswith("NEW"))
    assert [m for m in eval(new[4:]) if m.startswith("sglang")] == [], new


def test_forked_ranks_are_ray_actors_in_their_bundles_running_real_pools(ray_cluster, run_dir):
    topo = topology.get("cpu")
    assert deploy.uses_forkserver(ray_cluster, topo)
    dep = deploy.start(ray_cluster, topo, run_dir.root, SPEC, name_prefix="fork-test-")
    try:
        servers = {s.pid for s in forkserver.running_shared()}
        for w in dep.workers:
            assert psutil.Process(w.info.pid).ppid() in servers, f"{w.name} was not forked from the fork server"
            assert w.call("layout")["full"], w.name  # a real pool behind it
        res = run(dep.pair, [PDRequest(f"f{i}", 100 + 50 * i, decode_steps=4) for i in range(4)])
        res.assert_clean()
        assert len(res.completed) == 4
        victim = dep.pair.decode.members[0]
        os.kill(victim.info.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while victim.poll() is None:
            assert time.monotonic() < deadline, "Ray never noticed the forked rank's death"
            time.sleep(0.1)
    finally:
        dep.stop()
