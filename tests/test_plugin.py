"""The pytest plugin, driven through pytester: options, markers, skips, fail-fast, reports, teardown.

Runs that need Ray go through ``runpytest_subprocess`` (one Ray per process); the others run inline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from harness.workers import procs

pytestmark = pytest.mark.est_time(30)

pytest_plugins = ["pytester"]


def _inline(pytester, *args):
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)


def test_header_names_topology_ray_and_sglang(pytester):
    pytester.makepyfile("def test_ok(): pass")
    result = _inline(pytester, "--topology", "2-gpu-h100", "--ray-address", "10.0.0.1:6379", "--run-dir", "rd")
    import importlib.metadata

    version = importlib.metadata.version("sglang")
    result.stdout.fnmatch_lines(
        [
            f"harness: sglang {version} (installed), root *",
            "harness: topology=2-gpu-h100, ray=10.0.0.1:6379, simulate=*, run dir=rd",
        ]
    )
    result.assert_outcomes(passed=1)


def test_unplaceable_topology_is_skipped_with_the_runner_reason(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.topology("2-gpu-h100")
        def test_needs_gpus(pd_workers):
            raise AssertionError("must not run")
    """)
    result = _inline(pytester, "--no-simulate", "-rs", "--run-dir", "rd")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*needs 2×H100 (runner 2-gpu-h100); run with --simulate or on that runner"])


def test_marker_with_several_topologies_parametrizes(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.topology("cpu", "2-gpu-h100")
        def test_t(topology):
            print("TOPO", topology.name, topology.total_gpus)
    """)
    result = _inline(pytester, "-v", "-s")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*::test_t?cpu? TOPO cpu 0", "*::test_t?2-gpu-h100? TOPO 2-gpu-h100 2"])


def test_topology_option_selects_and_skips(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.topology("cpu", "2-gpu-h100")
        def test_t(topology):
            assert topology.name == "cpu"

        @pytest.mark.topology("8-gpu-h200")
        def test_other(topology):
            raise AssertionError("must not run")

        def test_default(topology):
            assert topology.name == "cpu"
    """)
    result = _inline(pytester, "--topology", "cpu", "-rs")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*runs on 8-gpu-h200; --topology is cpu"])


def test_unknown_topology_in_a_marker_is_one_clear_error(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.topology("4-gpu-nope")
        def test_t(topology):
            pass
    """)
    result = _inline(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["test_*.py::test_t: unknown topology '4-gpu-nope'; use one of: *"])


def test_markers_are_registered_for_strict_markers(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.est_time(3)
        @pytest.mark.topology("cpu")
        def test_t():
            pass
    """)
    _inline(pytester, "--strict-markers").assert_outcomes(passed=1)


# ---------------------------------------------------------------- fail-fast, timeouts, orphans (real Ray)

FAILFAST = r"""
import json, os, re, threading, time
from pathlib import Path

import pytest

from harness.workers import Subprocess, WorkerDied

OUT = Path(os.environ["HARNESS_TEST_OUT"])
CHATTY = "for i in $(seq 1 80); do echo line-$i; done; sleep 300 & echo child=$!; wait"
pytestmark = pytest.mark.topology("2-gpu-h100")


def start(pd_workers, role="decode"):
    w = pd_workers(role, Subprocess(("sh", "-c", CHATTY)))
    for _ in range(600):
        m = re.search(r"child=(\d+)", w.log_path.read_text())
        if m:
            break
        time.sleep(0.05)
    with (OUT / "pids.jsonl").open("a") as f:
        f.write(json.dumps([w.info.pid, w.info.payload_pid, int(m.group(1))]) + "\n")
    return w


def kill_soon(pid, name):
    def run():
        time.sleep(0.3)
        (OUT / f"{name}.killed").write_text(repr(time.time()))
        os.kill(pid, 9)
    threading.Thread(target=run, daemon=True).start()


def blocked(name):
    try:
        time.sleep(60)
    except WorkerDied:
        killed = float((OUT / f"{name}.killed").read_text())
        (OUT / f"{name}.latency").write_text(repr(time.time() - killed))
        raise


def test_payload_sigkilled(pd_workers):
    w = start(pd_workers)
    kill_soon(w.info.payload_pid, "payload")
    blocked("payload")


def test_actor_sigkilled(pd_workers):
    w = start(pd_workers, "prefill")
    kill_soon(w.info.pid, "actor")
    blocked("actor")


def test_swallowed_death_still_fails(pd_workers):
    w = start(pd_workers)
    kill_soon(w.info.payload_pid, "swallowed")
    try:
        time.sleep(60)
    except Exception:
        pass


@pytest.fixture
def running(pd_workers):
    return start(pd_workers)  # in setup: the timeout covers only the test function


@pytest.mark.timeout(1)
def test_times_out(running):
    time.sleep(60)


def test_session_goes_on(pd_workers):
    w = start(pd_workers)
    w.check()
    (OUT / "owner").write_text(str(os.getpid()))


def test_blocked_in_ray_get(pd_workers):
    import ray

    @ray.remote(num_cpus=0.01)
    def slow():
        time.sleep(60)

    w = start(pd_workers)
    kill_soon(w.info.payload_pid, "rayget")
    try:
        ray.get(slow.remote(), timeout=60)  # Ray's C loop lets only KeyboardInterrupt through
    except BaseException:
        killed = float((OUT / "rayget.killed").read_text())
        (OUT / "rayget.latency").write_text(repr(time.time() - killed))
        raise
"""


def test_fail_fast_log_tail_timeout_and_no_orphans(pytester, tmp_path, monkeypatch):
    pytester.makepyfile(test_failfast=FAILFAST)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("HARNESS_TEST_OUT", str(out))
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--simulate",
        "--run-dir",
        str(tmp_path / "run"),
        "-o",
        "timeout_func_only=true",
        timeout=600,
    )
    result.assert_outcomes(failed=5, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*WorkerDied: worker decode-0-0 died: subprocess pid * (sh) exit code -9 (killed by SIGKILL)",
            "*--- last 50 lines of its log (*decode-0-0.log) ---",
            "*line-32",
            "*line-80",
            "*child=*",
        ]
    )
    result.stdout.fnmatch_lines(["*WorkerDied: worker prefill-0-0 died: actor died*"])
    result.stdout.fnmatch_lines(["*- worker decode-0-0 log (last 50 lines, *decode-0-0.log) -*"])
    result.stdout.fnmatch_lines(["*_ test_swallowed_death_still_fails _*", "*WorkerDied: worker decode-0-0-2 died*"])
    result.stdout.fnmatch_lines(["*_ test_blocked_in_ray_get _*", "E*WorkerDied: worker decode-0-0-5 died: *"])
    result.stdout.fnmatch_lines(
        ["*Failed: Timeout (>1.0s) from pytest-timeout.", "*- worker decode-0-0-3 log (last 50 lines, *"]
    )
    tail = result.stdout.str().split("last 50 lines of its log")[1].split("worker decode-0-0 log")[0]
    assert "line-31\n" not in tail and "line-32\n" in tail
    latencies = {n: float((out / f"{n}.latency").read_text()) for n in ("payload", "actor", "rayget")}
    print(f"fail-fast latency from SIGKILL to the test's WorkerDied: {latencies}")
    assert all(v < 10 for v in latencies.values()), latencies
    # Teardown left nothing: no worker, payload or grandchild process, no registry entry of that run.
    pids = [p for line in (out / "pids.jsonl").read_text().splitlines() for p in json.loads(line)]
    assert len(pids) == 18
    assert procs.wait_gone(pids, 10) == []
    owner = int((out / "owner").read_text())
    assert [e for e in procs.entries() if e.owner == owner] == []


HOLD = r"""
import json, os, re, time
from pathlib import Path

import pytest

from harness.workers import procs
from harness.workers import Subprocess

OUT = Path(os.environ["HARNESS_TEST_OUT"])


@pytest.mark.topology("2-gpu-h100")
def test_hold(pd_workers):
    w = pd_workers("decode", Subprocess(("sh", "-c", "sleep 300 & echo child=$!; wait")))
    for _ in range(600):
        m = re.search(r"child=(\d+)", w.log_path.read_text())
        if m:
            break
        time.sleep(0.05)
    ours = [e.pid for e in procs.entries() if e.owner == os.getpid() and e.kind != "dir"]
    (OUT / "ready.json").write_text(json.dumps({"pytest": os.getpid(), "child": int(m.group(1)),
                                                "payload": w.info.payload_pid, "actor": w.info.pid,
                                                "registered": ours}))
    time.sleep(300)
"""


def test_sigkill_of_pytest_is_cleaned_up_by_the_next_run(pytester, tmp_path):
    pytester.makepyfile(test_hold=HOLD)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "HARNESS_TEST_OUT": str(out)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--simulate",
            "-q",
            "--run-dir",
            str(tmp_path / "run"),
            "test_hold.py",
        ],
        cwd=pytester.path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        while not (out / "ready.json").exists():
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the held test never got ready"
            time.sleep(0.2)
        time.sleep(0.2)
        held = json.loads((out / "ready.json").read_text())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    pids = [held["child"], held["payload"], held["actor"], *held["registered"]]
    assert procs.entries(), "the killed run's processes should still be registered"
    # A new run starts clean: its start reaps what the killed run left.
    pytester.makepyfile(test_next="def test_ok(): pass")
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "test_next.py").assert_outcomes(passed=1)
    assert procs.wait_gone(pids, 10) == []
    assert [e for e in procs.entries() if e.owner == held["pytest"]] == []


def test_ctrl_c_runs_teardown(pytester, tmp_path):
    """SIGINT (Ctrl-C) mid-test: pytest's teardown stops the worker and Ray; nothing needs reaping."""
    pytester.makepyfile(test_hold=HOLD)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "HARNESS_TEST_OUT": str(out)}
    # Ctrl-C as a terminal delivers it: a run started in the background of a script (CI) inherits
    # SIGINT ignored, and Python then never raises KeyboardInterrupt.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--simulate",
            "-q",
            "--run-dir",
            str(tmp_path / "run"),
            "test_hold.py",
        ],
        cwd=pytester.path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 300
        while not (out / "ready.json").exists():
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the held test never got ready"
            time.sleep(0.2)
        time.sleep(0.2)
        held = json.loads((out / "ready.json").read_text())
        proc.send_signal(signal.SIGINT)
        try:
            output = proc.communicate(timeout=120)[0].decode()
        except subprocess.TimeoutExpired:
            # Say where it hangs: pytest's faulthandler prints every thread's stack on SIGABRT.
            proc.send_signal(signal.SIGABRT)
            tail = proc.communicate(timeout=60)[0].decode()[-6000:]
            pytest.fail(f"pytest did not finish within 120 s of Ctrl-C; its output and stacks:\n{tail}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "KeyboardInterrupt" in output
    assert proc.returncode == 2, output
    pids = [held["child"], held["payload"], held["actor"], *held["registered"]]
    assert procs.wait_gone(pids, 10) == [], output
    assert [e for e in procs.entries() if e.owner == held["pytest"]] == []
