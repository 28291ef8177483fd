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

from harness import topology
from harness.rundir import REPO_ROOT
from harness.workers import forkserver
from harness.workers.forkserver import CLIENT, SOCKET_ENV, ForkServer, ForkServerError
from harness.engines.sim import deploy
from harness.engines.sim.driver import run
from harness.engines.sim.workload import KVSpec, PDRequest

pytestmark = [pytest.mark.est_time(60), pytest.mark.timeout(600)]

SPEC = KVSpec(kind="swa", page_size=64, window=100, full_tokens=32 * 64, swa_tokens=12 * 64, req_slots=8)


def _module(tmp_path, name: str, body: str) -> dict[str, str]:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def _sigint_default() -> None:
    """Start a client as a terminal would (SIGINT default): pytest run in the background of a script
    inherits SIGINT ignored, and the client rightly hands that on to its child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _client(server: ForkServer, argv: list[str], extra_env: dict | None = None, **kw) -> subprocess.Popen:
    env = {**os.environ, **(extra_env or {}), SOCKET_ENV: server.socket_path}
    return subprocess.Popen([sys.executable, "-I", "-S", str(CLIENT), *argv], env=env, **kw)


def test_child_runs_the_script_with_the_clients_argv_env_and_exit_status(tmp_path):
    env = _module(tmp_path, "fs_preload", "import json\nLOADED = True\n")
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys
        print("args", sys.argv[1:], os.environ["CHILD_VAR"], "fs_preload" in sys.modules, flush=True)
        sys.exit(7)
    """)
    )
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
        child = psutil.Process(int(pidfile.read_text()))  # before it can go
        assert child.ppid() == server.pid
        p.kill()  # what a raylet's SIGKILL of the process it started does
        p.wait(10)
        assert psutil.wait_procs([child], timeout=10)[1] == [], "the child outlived its client"
    finally:
        server.stop()


def test_server_refuses_to_fork_with_threads_running(tmp_path):
    env = _module(
        tmp_path,
        "fs_threads",
        """
        import threading, time
        def start():
            threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    """,
    )
    with pytest.raises(ForkServerError, match="left 2 threads; a fork would copy only one"):
        ForkServer.start("fs_threads:start", env)


def test_preload_covers_every_sglang_module_a_rank_imports():
    """A rank built after the preload (SWA and DeepSeek-V4 hisparse pools) imports no further sglang
    module: the fork server's children run only code imported before the fork."""
    code = textwrap.dedent("""
        import sys, tempfile
        from harness.engines.fork_preload import rank
        rank()
        before = {m for m in sys.modules if m.startswith(("sglang", "harness"))}
        from harness.engines.sim.decode_rank import DecodeWorker
        from harness.engines.sim.prefill_rank import PrefillWorker
        from harness.engines.sim.workload import KVSpec
        d = tempfile.mkdtemp()
        for spec in (KVSpec(kind="swa", page_size=64, window=100, full_tokens=24 * 64, swa_tokens=10 * 64),
                     KVSpec(kind="dsv4", page_size=256, window=128, hisparse=True, full_tokens=16 * 256,
                            swa_tokens=8 * 256)):
            DecodeWorker("d", 0, spec, d)
            PrefillWorker("p", 0, spec, d)
        print("NEW", sorted(m for m in sys.modules if m.startswith(("sglang", "harness")) and m not in before))
    """)
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    new = next(line for line in r.stdout.splitlines() if line.startswith("NEW"))
    assert [m for m in eval(new[4:]) if m.startswith("sglang")] == [], new


def test_forked_ranks_are_ray_actors_in_their_bundles_running_real_pools(ray_cluster, run_dir):
    topo = topology.get("cpu")
    assert ray_cluster.starts_forked("rank", topo)
    dep = deploy.start(ray_cluster, topo, run_dir.root, SPEC, name_prefix="fork-test-")
    try:
        # The process that forks them: the server's own, or, started as a fork of this worker's Python
        # server (when an earlier test started one here), that fork.
        servers = {s.serving_pid for s in forkserver.running_shared()}
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


TWO_INSTANCES = """\
name = "two-instances"
runner = "ubuntu-latest"

[cluster]
nodes = 1
gpus_per_node = 0

[roles.prefill]
count = 2
gpus_per_rank = 0

[roles.decode]
count = {decode}
gpus_per_rank = 0
"""


def _two_instances(tmp_path, decode: int = 2) -> topology.Topology:
    path = tmp_path / "two-instances.toml"
    path.write_text(TWO_INSTANCES.format(decode=decode))
    return topology.load(path)


def test_every_instance_of_a_topology_is_its_own_pair_of_forked_ranks(ray_cluster, run_dir, tmp_path):
    """``instances=None`` starts one PD pair per prefill/decode group (how the 32-rank
    ``4-node-32-gpu-h200`` runs its two TP8 instances per role), here on the same fork server as
    above, so it costs four forks."""
    topo = _two_instances(tmp_path)
    dep = deploy.start(ray_cluster, topo, run_dir.root, SPEC, name_prefix="instances-test-", instances=None)
    try:
        assert [[w.name for w in (*p.prefill.members, *p.decode.members)] for p in dep.pairs] == [
            ["instances-test-prefill-0-r0", "instances-test-decode-0-r0"],
            ["instances-test-prefill-1-r0", "instances-test-decode-1-r0"],
        ]
        assert len({w.info.pid for w in dep.workers}) == 4
        for i, pair in enumerate(dep.pairs):
            res = run(pair, [PDRequest(f"i{i}-{j}", 100 + 50 * j, decode_steps=3) for j in range(2)])
            res.assert_clean()
            assert len(res.completed) == 2
    finally:
        dep.stop()
    with pytest.raises(
        ValueError,
        match=r"^two-instances: instances=3, but the topology has 2 prefill/decode "
        r"pair\(s\); pass 1 to 2",
    ):
        deploy.start(ray_cluster, topo, run_dir.root, SPEC, instances=3)
    with pytest.raises(ValueError, match=r"^two-instances: prefill has 2 group\(s\), decode 1: pairs need as many"):
        deploy.start(ray_cluster, _two_instances(tmp_path, decode=1), run_dir.root, SPEC, instances=None)


def _site(tmp_path, body: str) -> str:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(body))
    (site / "fs_mod.py").write_text(
        textwrap.dedent("""
        import os, sys
        import sitecustomize
        with open(os.environ["OUT"], "w") as f:
            f.write(repr((__name__, sys.argv[1:], sitecustomize.SEEN, os.getpid(), os.nice(0),
                          open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ").decode().strip())))
    """)
    )
    return str(site)


def test_module_child_reruns_sitecustomize_with_its_env_at_the_clients_priority(tmp_path):
    site = _site(tmp_path, "import os\nSEEN = os.environ.get('SITE_VAR', '')\n")
    server = ForkServer.start("json", {**os.environ, "PYTHONPATH": site}, must_match=("PYTHONPATH",))
    try:
        out = tmp_path / "out.txt"
        p = _client(
            server,
            ["-m", "fs_mod", "x", "--y"],
            {"SITE_VAR": "child", "OUT": str(out), "PYTHONPATH": site},
            preexec_fn=lambda: os.nice(3),
        )
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
    server = ForkServer.start(
        "json", {**os.environ, "PYTHONPATH": site + os.pathsep + str(tmp_path)}, must_match=("PYTHONPATH",)
    )
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


def test_a_free_path_server_forks_a_client_whose_path_shadows_nothing_it_imported(tmp_path):
    """A server started ``free_path`` forks a client whose ``PYTHONPATH`` adds a directory holding
    nothing the preload imported (a fault's patched ``sglang/``), and the child finds its modules on
    its own path, in a fresh interpreter's order; a directory that shadows a preloaded package (the
    harness's own, here) gets a fresh interpreter, as any differing path did before."""
    site = _site(tmp_path, "SEEN = 'fresh'\n")
    server = ForkServer.start("json", {**os.environ, "PYTHONPATH": site}, must_match=("PYTHONPATH",), free_path=True)
    overlay, shadow = tmp_path / "overlay", tmp_path / "shadow"
    (overlay / "fs_pkg").mkdir(parents=True)
    (overlay / "fs_pkg" / "__init__.py").write_text("")
    (shadow / "harness").mkdir(parents=True)
    probe = (
        "import os, sys, fs_pkg\nopen(os.environ['OUT'], 'w').write(repr((os.getpid(), fs_pkg.__file__, sys.path)))\n"
    )
    (overlay / "fs_probe.py").write_text(probe)
    try:
        out = tmp_path / "out.txt"
        path = os.pathsep.join([str(overlay), site])
        p = _client(server, ["-m", "fs_probe"], {"OUT": str(out), "PYTHONPATH": path}, stderr=subprocess.PIPE)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        pid, found, sys_path = eval(out.read_text())
        assert pid != p.pid and b"differ from the fork server's" not in err, "the client was not forked"
        assert found == str(overlay / "fs_pkg" / "__init__.py")
        assert sys_path.index(str(overlay)) < sys_path.index(site) < sys_path.index(os.path.dirname(os.__file__))
        assert sys_path.count(site) == 1

        p = _client(
            server,
            ["-m", "fs_mod"],
            {"OUT": str(out), "PYTHONPATH": os.pathsep.join([str(shadow), site])},
            stderr=subprocess.PIPE,
        )
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert eval(out.read_text())[3] == p.pid, "a client whose path shadows the harness was forked"
        assert b"PYTHONPATH differ from the fork server's" in err
    finally:
        server.stop()


def test_free_path_is_off_when_the_preload_imported_from_the_servers_own_path(tmp_path):
    from harness.workers.forkserver import envmatch

    (tmp_path / "fs_own.py").write_text("")
    sys.path.insert(0, str(tmp_path))
    try:
        import fs_own  # noqa: F401

        assert envmatch.free_path(str(tmp_path), sys.modules) is None
        free = envmatch.free_path(str(tmp_path / "elsewhere"), sys.modules)
        assert free is not None and "fs_own" in free["tops"] and "os" not in free["tops"]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("fs_own", None)


def test_a_descendant_uses_its_ancestors_advertised_free_path_server(tmp_path):
    """``shared(advertise=True)`` names the server to the processes started after; their own
    ``shared`` call (with another ``PYTHONPATH``) returns it instead of starting one."""
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "a")}
    before = os.environ.get(forkserver.ADVERTISE_ENV)
    server = forkserver.shared("json", {}, base=env, must_match=("PYTHONPATH",), free_path=True, advertise=True)
    assert isinstance(server, ForkServer)
    try:
        code = (
            "import os\nfrom harness.workers import forkserver\n"
            "s = forkserver.shared('json', {}, base={**os.environ, 'PYTHONPATH': os.environ['B']}, "
            "must_match=('PYTHONPATH',), free_path=True)\n"
            "print(type(s).__name__, s.socket_path)"
        )
        r = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "B": str(tmp_path / "b")},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["Inherited", server.socket_path]
    finally:
        server.stop()
        if before is None:
            os.environ.pop(forkserver.ADVERTISE_ENV, None)
        else:
            os.environ[forkserver.ADVERTISE_ENV] = before


def test_server_preload_imports_no_sglang_and_leaves_one_thread():
    code = textwrap.dedent("""
        import os, sys
        from harness.engines.server import server_preload
        server_preload.server()
        assert not [m for m in sys.modules if m.split(".")[0] == "sglang"]
        print(len(os.listdir("/proc/self/task")), "torch" in sys.modules, "transformers.modeling_utils" in sys.modules)
    """)
    r = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["1", "True", "True"]


def test_server_preload_list_is_current():
    """Regenerate with ``python -m harness.engines.server.server_preload --write-server-modules`` when this fails."""
    from harness.engines.server import server_preload

    listed = set(server_preload.SERVER_MODULES_FILE.read_text().split())
    now = set(server_preload.list_server_modules())
    missing = sorted(now - listed)
    assert not missing, f"{len(missing)} third-party modules of the server graph are not preloaded, e.g. {missing[:5]}"


# ------------------------------------------------------------------- Python subprocesses (python_command)

_PRELOAD_MODULE = """
    import os
    MODE = os.environ.get("FS_MODE", "")          # read at import: decides what this module is
    os.environ.setdefault("FS_SET_BY_IMPORT", "yes")  # as torch and Ray set variables when imported
    SNAPSHOT = dict(os.environ)                       # a scan (wsgiref keeps one): not a read of each
"""


@pytest.fixture
def python_servers():
    """The test's own Python fork servers (``forkserver.sharing._PYTHON``), stopped after it; the process's
    others (started by earlier tests of this worker, and advertised in its environment) are hidden
    meanwhile and put back."""
    saved = list(forkserver.sharing._PYTHON), os.environ.get(forkserver.ADVERTISE_ENV)
    forkserver.sharing._PYTHON.clear()
    os.environ.pop(forkserver.ADVERTISE_ENV, None)
    yield
    for server in forkserver.sharing._PYTHON:
        server.stop()
    forkserver.sharing._PYTHON[:] = saved[0]
    if saved[1] is None:
        os.environ.pop(forkserver.ADVERTISE_ENV, None)
    else:
        os.environ[forkserver.ADVERTISE_ENV] = saved[1]


def _wait_file(path, proc, timeout=60.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "the child did not start"
        time.sleep(0.05)
    return path.read_text()


def test_a_python_subprocess_is_a_fork_that_ends_as_a_fresh_interpreter_ends(tmp_path, python_servers):
    env = {**_module(tmp_path, "fs_pymod", _PRELOAD_MODULE), "FS_MODE": "a"}
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(f"""
        import atexit, os, signal, sys
        import fs_pymod
        atexit.register(lambda: open({str(tmp_path / "atexit")!r}, "w").write("ran"))
        print(os.getppid(), fs_pymod.MODE, os.environ.get("FS_SET_BY_IMPORT"),
              signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
        sys.exit("a message")
    """)
    )
    argv, cenv = forkserver.python_command([sys.executable, str(script)], env, preload="fs_pymod")
    assert argv[:4] == [sys.executable, "-I", "-S", str(CLIENT)] and cenv[SOCKET_ENV]
    p = subprocess.Popen(
        argv, env=cenv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_default
    )
    out, err = p.communicate(timeout=60)
    ppid, mode, set_by_import, sigint_default = out.split()
    assert int(ppid) == forkserver.sharing._PYTHON[0].pid, "not forked from the server"
    # What the import set is there, SIGINT raises KeyboardInterrupt, atexit ran, SystemExit's message
    # was printed with status 1: as `python child.py` does.
    assert (mode, set_by_import, sigint_default) == ("a", "yes", "True")
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (p.returncode, err.strip()) == (1, "a message")


def test_a_python_subprocess_whose_import_time_env_differs_gets_its_own_server(tmp_path, python_servers):
    env = {**_module(tmp_path, "fs_pymod", _PRELOAD_MODULE), "FS_SCANNED": "1"}
    script = tmp_path / "child.py"
    script.write_text("import os, fs_pymod\nprint(os.getppid(), fs_pymod.MODE)\n")
    seen = []
    for mode in ("a", "b", "a"):
        argv, cenv = forkserver.python_command(
            [sys.executable, str(script)], {**env, "FS_MODE": mode}, preload="fs_pymod"
        )
        out = subprocess.run(argv, env=cenv, capture_output=True, text=True, timeout=60).stdout.split()
        seen.append((int(out[0]), out[1]))
    servers = [s.pid for s in forkserver.sharing._PYTHON]
    # FS_MODE was read by the preload: "b" cannot share "a"'s server; the second "a" reuses the first.
    assert seen == [(servers[0], "a"), (servers[1], "b"), (servers[0], "a")]
    # A variable the preload did not read, or only saw in a scan of the whole environment, or one read
    # only when used (PYTHONBREAKPOINT) is the child's own business; a value the preload's imports set
    # themselves (the client's parent made the same imports) is where the server's ended up too.
    argv, cenv = forkserver.python_command(
        [sys.executable, str(script)],
        {**env, "FS_MODE": "a", "FS_OTHER": "x", "FS_SCANNED": "2", "PYTHONBREAKPOINT": "0", "FS_SET_BY_IMPORT": "yes"},
        preload="fs_pymod",
    )
    assert subprocess.run(argv, env=cenv, capture_output=True, text=True, timeout=60).stdout.split() == [
        str(servers[0]),
        "a",
    ]
    # A client of a server whose preload read another value is not forked.
    p = _client(
        forkserver.sharing._PYTHON[0],
        [str(script)],
        {**env, "FS_MODE": "c"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = p.communicate(timeout=60)
    assert out.split()[1] == b"c" and b"FS_MODE differ from the fork server's" in err
    # Options before the script, and HARNESS_FORK_START=0 (or the old HARNESS_FORK_PYTHON=0), keep the command as it is.
    assert forkserver.python_command([sys.executable, "-X", "dev", str(script)], env, preload="fs_pymod")[0][1] == "-X"
    for off in ({**env, forkserver.OFF_ENV: "0"}, {**env, "HARNESS_FORK_PYTHON": "0"}):
        assert forkserver.python_command([sys.executable, str(script)], off, preload="fs_pymod")[0] == [
            sys.executable,
            str(script),
        ]


def test_a_session_client_interrupts_and_kills_its_childs_whole_tree(tmp_path, python_servers):
    env = _module(tmp_path, "fs_pymod", _PRELOAD_MODULE)
    script = tmp_path / "tree.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, subprocess, sys, time
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        if os.path.exists("/proc/self/autogroup"):
            open({str(tmp_path / "autogroup")!r}, "w").write(open("/proc/self/autogroup").read())
        open({str(tmp_path / "pids")!r}, "w").write(f"{{os.getpid()}} {{grandchild.pid}}")
        try:
            time.sleep(600)
        except KeyboardInterrupt:
            open({str(tmp_path / "interrupted")!r}, "w").write("yes")
            raise
    """)
    )
    argv, cenv = forkserver.python_command([sys.executable, str(script)], env, preload="fs_pymod")
    # ^C to the session (as a terminal or rerun-test's stop sends it): KeyboardInterrupt in the child,
    # which then dies by SIGINT, and its client with it.
    # Started niced (as CI starts the fault check): the session's scheduling group gets that priority
    # too, where the kernel groups by session (autogroups), or a niced command would take a full share.
    p = subprocess.Popen(
        argv,
        env=cenv,
        start_new_session=True,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: (os.nice(4), _sigint_default()),
    )
    child, grandchild = map(int, _wait_file(tmp_path / "pids", p).split())
    assert psutil.Process(child).ppid() == forkserver.sharing._PYTHON[0].pid
    assert psutil.Process(child).nice() == os.nice(0) + 4
    if (tmp_path / "autogroup").exists():
        assert (tmp_path / "autogroup").read_text().split()[-1] == str(os.nice(0) + 4)
    os.killpg(p.pid, signal.SIGINT)
    assert p.wait(30) == -signal.SIGINT
    assert (tmp_path / "interrupted").read_text() == "yes"
    # A timeout's SIGKILL of the session (procs.run_logged): the child and what it started are gone
    # too, as they would be had the command run in the session itself.
    (tmp_path / "pids").unlink()
    p = subprocess.Popen(argv, env=cenv, start_new_session=True, stderr=subprocess.DEVNULL)
    tree = [psutil.Process(int(pid)) for pid in _wait_file(tmp_path / "pids", p).split()]  # before they can go
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(10)
    gone, alive = psutil.wait_procs(tree, timeout=15)
    assert not alive, f"outlived the session's kill: {alive}"


def test_a_forked_pytest_rewrites_the_harness_plugin_and_warns_of_nothing(tmp_path, python_servers):
    from harness.engines import fork_preload

    (tmp_path / "test_fork.py").write_text(
        textwrap.dedent(f"""
        import os, sys
        def test_it():
            open({str(tmp_path / "ppid")!r}, "w").write(str(os.getppid()))
            assert type(sys.modules["harness"].__loader__).__name__ == "AssertionRewritingHook"
    """)
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(tmp_path / "test_fork.py"),
        "-q",
        "-p",
        "no:cacheprovider",
        "-W",
        "error::pytest.PytestAssertRewriteWarning",
    ]
    argv, env = fork_preload.python_command(cmd, dict(os.environ))  # one thread each by default: forkable
    # Run from the repository, as rerun-test runs its groups: pytest rewrites a module its import path
    # finds (from elsewhere, a fresh interpreter finds the editable-installed harness through its
    # finder, unrewritten, and so would the child).
    p = subprocess.run(
        argv + ["--rootdir", str(tmp_path)], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "warning" not in p.stdout.lower(), p.stdout[-2000:]
    assert int((tmp_path / "ppid").read_text()) == forkserver.sharing._PYTHON[0].pid, "not forked"


def test_a_child_stuck_holding_the_gil_goes_with_its_killed_client(tmp_path, python_servers):
    # sum() over a huge range runs in C and never lets another thread take the GIL: the child's own
    # watch thread cannot act; the server must.
    env = _module(tmp_path, "fs_pymod", _PRELOAD_MODULE)
    script = tmp_path / "stuck.py"
    script.write_text(f"import os\nopen({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\nsum(range(10**15))\n")
    argv, cenv = forkserver.python_command([sys.executable, str(script)], env, preload="fs_pymod")
    p = subprocess.Popen(argv, env=cenv, start_new_session=True)
    child = psutil.Process(int(_wait_file(tmp_path / "pid", p)))
    time.sleep(0.5)  # well inside sum()
    os.killpg(p.pid, signal.SIGKILL)  # a timeout's kill of the session
    p.wait(10)
    try:
        assert psutil.wait_procs([child], timeout=15)[1] == [], "the child outlived its client"
    finally:
        if child.is_running():  # never leave it spinning
            child.kill()


def test_a_client_its_server_cannot_serve_runs_the_command_itself(tmp_path, python_servers):
    env = _module(tmp_path, "fs_pymod", _PRELOAD_MODULE)
    script = tmp_path / "child.py"
    script.write_text("import os\nprint(os.getpid())\n")
    argv, cenv = forkserver.python_command([sys.executable, str(script)], env, preload="fs_pymod")
    forkserver.sharing._PYTHON[0].stop()  # gone before the command starts
    p = subprocess.Popen(argv, env=cenv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "starting a fresh interpreter" in err, err
    assert int(out) == p.pid  # the client became the command (exec), as Python would have run it


def test_a_descendant_forks_from_its_ancestors_server(tmp_path, python_servers):
    env = _module(tmp_path, "fs_pymod", _PRELOAD_MODULE)
    script = tmp_path / "child.py"
    script.write_text("import os\nprint(os.getppid())\n")
    forkserver.python_command([sys.executable, str(script)], env, preload="fs_pymod")
    [server] = forkserver.sharing._PYTHON
    # A process this one starts (as a test starts rerun-test) builds its own command: it takes the
    # server this process advertises, starts none, and its command runs as that server's child.
    code = textwrap.dedent(f"""
        import os, subprocess, sys
        from harness.workers import forkserver
        argv, env = forkserver.python_command([sys.executable, {str(script)!r}], dict(os.environ), preload="fs_pymod")
        sock, n = env[forkserver.SOCKET_ENV], len(forkserver.sharing._PYTHON)
        print(sock, n, subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60).stdout.strip())
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, **{k: v for k, v in os.environ.items() if k == forkserver.ADVERTISE_ENV}},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [server.socket_path, "0", str(server.pid)]
    # Once it is gone, a descendant starts its own.
    server.stop()
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, forkserver.ADVERTISE_ENV: server.socket_path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[1] == "1"


def test_a_server_whose_preload_extends_a_python_servers_is_its_fork_and_goes_with_its_owner(tmp_path, python_servers):
    # rerun-test's groups are forks of its Python server; a group's rank fork server (whose preload adds
    # sglang to that server's third-party graph) is started as a fork of the same server (launch), so it
    # imports only what it adds. It still ends with the process that started it (its owner, not its
    # parent), and a child whose client leads a process group of its own (a Ray worker) leads one too.
    env = _module(tmp_path, "fs_pymod", _PRELOAD_MODULE)
    (tmp_path / "fs_ext.py").write_text("import fs_pymod\nEXTENDED = True\n")
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys, psutil
        me = psutil.Process()
        print(me.ppid(), me.parent().ppid(), "fs_ext" in sys.modules, os.getpgid(0) == os.getpid(), flush=True)
    """)
    )
    forkserver.python_command([sys.executable, str(script)], env, preload="fs_pymod")
    [python_server] = forkserver.sharing._PYTHON

    def launch(argv, launch_env):
        return forkserver.python_command(argv, launch_env, preload="fs_pymod", start_server=False)

    ext = ForkServer.start("fs_ext", env, launch=launch)
    try:
        for group, leads in ((False, "False"), (True, "True")):
            out = subprocess.run(
                ext.command([sys.executable, str(script)]),
                env={**env, SOCKET_ENV: ext.socket_path},
                capture_output=True,
                text=True,
                timeout=60,
                preexec_fn=os.setpgrp if group else None,
            )
            assert out.returncode == 0, out.stderr
            assert out.stdout.split() == [str(ext.serving_pid), str(python_server.pid), "True", leads], (
                group,
                out.stdout,
                out.stderr,
            )
    finally:
        ext.stop()
    # Without a Python server serving it, the command is left as it was (a fresh interpreter).
    argv = [sys.executable, "-m", "fs_ext"]
    assert launch(argv, {**env, "FS_MODE": "other"}) == (argv, {**env, "FS_MODE": "other"})
    # Its owner killed (its parent, the Python server, lives on), it exits.
    code = textwrap.dedent("""
        import os, sys, time
        from harness.workers import forkserver
        from harness.workers.forkserver import ForkServer
        def launch(argv, env):
            return forkserver.python_command(argv, env, preload="fs_pymod", start_server=False)
        ext = ForkServer.start("fs_ext", dict(os.environ), launch=launch)
        print(ext.socket_path, flush=True)
        time.sleep(600)
    """)
    owner = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**env, forkserver.ADVERTISE_ENV: python_server.socket_path},
        stdout=subprocess.PIPE,
        text=True,
    )
    socket_path = owner.stdout.readline().strip()
    [served] = [p for p in psutil.Process(python_server.pid).children() if socket_path in " ".join(p.cmdline())]
    owner.kill()
    owner.wait(timeout=30)
    served.wait(timeout=30)


def test_a_faulted_runs_rank_server_is_a_fork_of_the_python_server_and_imports_the_patched_copy(
    tmp_path, python_servers, monkeypatch
):
    # A fault-check run (or a mutant's) puts a patched copy first (overlay and PYTHONPATH) and names its
    # faults; its ranks apply them themselves and run no sitecustomize, so their fork server is still a
    # fork of the Python server (whose preload imported no sglang) and imports the patched copy from the
    # path its child rebuilt. A fresh one spent about 7 CPU-s more per fault run.
    from harness import faults
    from harness.engines import fork_preload
    from harness.targets.sglang.selection import OVERLAY_ENV

    # A preload from site-packages (as the real one's graph is), not from the server's PYTHONPATH.
    monkeypatch.setattr(fork_preload, "PYTHON_PRELOAD", "psutil")
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **fork_preload.ONE_THREAD_ENV}
    script = tmp_path / "child.py"
    script.write_text("import os\nimport fs_patched\nprint(os.getppid(), fs_patched.PATCHED)\n")
    fork_preload.python_command([sys.executable, str(script)], env)
    [server] = forkserver.sharing._PYTHON
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "fs_patched.py").write_text("PATCHED = True\n")
    faulted = {
        **env,
        faults.ENV_VAR: "corrupt-kv-page",
        OVERLAY_ENV: str(scratch),
        "PYTHONPATH": os.pathsep.join(p for p in (str(scratch), env["PYTHONPATH"]) if p),
    }
    argv, cenv = fork_preload.after_python([sys.executable, str(script)], faulted)
    out = subprocess.run(argv, env=cenv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(server.pid), "True"], out.stderr
    # A harness subprocess naming a fault is still a fresh interpreter (a server's sitecustomize applies it).
    assert fork_preload.python_command([sys.executable, str(script)], faulted)[0] == [sys.executable, str(script)]
    # A directory first on the path that would shadow a preloaded module gets a fresh interpreter.
    (scratch / "psutil.py").write_text("SHADOW = True\n")
    assert fork_preload.after_python([sys.executable, str(script)], faulted)[0] == [sys.executable, str(script)]


# ------------------------------------------------------------------- which processes start as forks (policy)


@pytest.mark.parametrize(
    ("kind", "kwargs", "env", "want"),
    [
        ("rank", {}, {}, True),
        ("server", {}, {}, True),
        ("python", {}, {}, True),
        ("rank", {"real_devices": True}, {}, False),  # a CUDA context does not survive a fork
        ("server", {"local": False}, {}, False),  # a joined cluster's workers run elsewhere
        ("rank", {}, {"HARNESS_FORK_START": "0"}, False),  # the one switch, for every kind
        ("server", {}, {"HARNESS_FORK_START": "0"}, False),
        ("python", {}, {"HARNESS_FORK_START": "0"}, False),
        ("rank", {}, {"HARNESS_RANK_FORKSERVER": "0"}, False),  # the old per-kind switches still work...
        ("server", {}, {"HARNESS_RANK_FORKSERVER": "0"}, True),  # ...for their own kind only
        ("server", {}, {"HARNESS_SERVER_FORKSERVER": "0"}, False),
        ("python", {}, {"HARNESS_FORK_PYTHON": "0"}, False),
    ],
)
def test_one_rule_decides_which_processes_start_as_forks(kind, kwargs, env, want):
    assert forkserver.forks(kind, env=env, **kwargs) is want


def test_an_old_switch_warns_with_the_new_one(caplog):
    from harness.workers.forkserver import policy

    policy._WARNED.discard("HARNESS_SERVER_FORKSERVER")
    with caplog.at_level("WARNING"):
        assert not forkserver.forks("server", env={"HARNESS_SERVER_FORKSERVER": "0"})
    assert "HARNESS_SERVER_FORKSERVER=0 is deprecated: set HARNESS_FORK_START=0" in caplog.text


def test_a_cluster_forks_simulated_ranks_and_servers_only_without_real_gpus(ray_cluster):
    assert ray_cluster.starts_forked("rank", topology.get("cpu")) and ray_cluster.starts_forked(
        "server", topology.get("cpu")
    )
    # Logical GPUs: a simulated GPU topology's processes drive no device.
    assert ray_cluster.starts_forked("rank", topology.get("8-gpu-h200")) is ray_cluster.simulate


def test_a_server_knows_its_owner_gone_with_or_without_pidfds(monkeypatch):
    from harness.workers.forkserver import serve

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pidfds in (True, False):
        if not pidfds:  # a kernel before 5.3
            monkeypatch.setattr(
                os, "pidfd_open", lambda pid: (_ for _ in ()).throw(OSError(38, "Function not implemented"))
            )
        assert not serve._owner_gone(os.getpid())(), pidfds
        assert serve._owner_gone(dead.pid)(), pidfds
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = serve._owner_gone(live.pid)  # without pidfds still: its /proc entry
    assert not watch()
    live.kill()
    live.wait()
    assert watch()
