"""The fork server: ranks forked from a process that imported sglang are still Ray actors in their
bundles running the real pools; the server forks only when safe; a child never outlives its client;
the preload covers everything a rank imports. A child runs ``-m MODULE`` as ``python -m`` would,
after ``sitecustomize`` ran again with its environment, at its client's priority and named by its
command; a client whose import-deciding environment differs is not forked. The server preload
imports sglang's third-party graph and nothing of sglang, and its list is current."""

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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_child_killed_by_a_signal_ends_its_client_by_the_same_signal(tmp_path, sig):
    # An sglang server whose scheduler failed kills its own process tree, itself included, with SIGKILL.
    script = tmp_path / "suicide.py"
    script.write_text(f"import os\nos.kill(os.getpid(), {int(sig)})\n")
    server = ForkServer.start("os")
    try:
        p = _client(server, [str(script)], stderr=subprocess.PIPE)
        _, err = p.communicate(timeout=60)
        assert p.returncode == -sig, err.decode()
        assert b"Traceback" not in err
    finally:
        server.stop()


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


def _site(tmp_path, body: str) -> str:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(body))
    (site / "fs_mod.py").write_text(textwrap.dedent("""
        import os, sys
        import sitecustomize
        with open(os.environ["OUT"], "w") as f:
            f.write(repr((__name__, sys.argv[1:], sitecustomize.SEEN, os.getpid(), os.nice(0),
                          open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ").decode().strip())))
    """))
    return str(site)


def test_module_child_reruns_sitecustomize_with_its_env_at_the_clients_priority(tmp_path):
    site = _site(tmp_path, "import os\nSEEN = os.environ.get('SITE_VAR', '')\n")
    server = ForkServer.start("json", {**os.environ, "PYTHONPATH": site}, must_match=("PYTHONPATH",))
    try:
        out = tmp_path / "out.txt"
        p = _client(server, ["-m", "fs_mod", "x", "--y"], {"SITE_VAR": "child", "OUT": str(out), "PYTHONPATH": site},
                    preexec_fn=lambda: os.nice(3))
        assert p.wait(60) == 0
        name, args, seen, pid, nice, cmdline = eval(out.read_text())
        assert (name, args) == ("__main__", ["x", "--y"])
        # The fork server's own sitecustomize run saw no SITE_VAR; the child's run saw the client's.
        assert seen == "child"
        assert pid != p.pid, "not forked: the client ran it itself"
        assert nice == os.nice(0) + 3, "the child does not run at its client's priority"
        assert cmdline.endswith("-m fs_mod x --y"), cmdline
    finally:
        server.stop()


def test_a_client_whose_import_path_differs_runs_a_fresh_interpreter(tmp_path):
    site = _site(tmp_path, "SEEN = 'fresh'\n")
    server = ForkServer.start("json", {**os.environ, "PYTHONPATH": site + os.pathsep + str(tmp_path)},
                              must_match=("PYTHONPATH",))
    try:
        out = tmp_path / "out.txt"
        p = _client(server, ["-m", "fs_mod", "z"], {"OUT": str(out), "PYTHONPATH": site}, stderr=subprocess.PIPE)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        name, args, seen, pid, _nice, _cmd = eval(out.read_text())
        # The same process (exec'd), running the module on its own import path.
        assert (name, args, seen, pid) == ("__main__", ["z"], "fresh", p.pid)
        assert b"PYTHONPATH differ from the fork server's; starting a fresh interpreter" in err
    finally:
        server.stop()


def test_server_preload_imports_no_sglang_and_leaves_one_thread():
    code = textwrap.dedent("""
        import os, sys
        from harness.targets.sglang import preload
        preload.server()
        assert not [m for m in sys.modules if m.split(".")[0] == "sglang"]
        print(len(os.listdir("/proc/self/task")), "torch" in sys.modules, "transformers.modeling_utils" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["1", "True", "True"]


def test_server_preload_list_is_current():
    """Regenerate with ``python -m harness.targets.sglang.preload --write-server-modules`` when this fails."""
    from harness.targets.sglang import preload

    listed = set(preload.SERVER_MODULES_FILE.read_text().split())
    now = set(preload.list_server_modules())
    missing = sorted(now - listed)
    assert not missing, f"{len(missing)} third-party modules of the server graph are not preloaded, e.g. {missing[:5]}"
