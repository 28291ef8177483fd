"""The process registry: a run killed with SIGKILL is reaped by the next, and nothing else is touched."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from harness.clock import wait_for
from harness.workers import procs


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setattr(procs, "REGISTRY_DIR", tmp_path / "procs")
    return tmp_path / "procs"


def _spawn_owner_with_group() -> tuple[subprocess.Popen, int, int]:
    """A stand-in 'pytest' (owner) that started a process group with two members, registered it, and
    exits; returns (owner, group leader pid, child pid)."""
    code = (
        "import os, subprocess, sys; from harness.workers import procs; procs.claim();"
        "p = subprocess.Popen(['sh', '-c', 'sleep 300 & echo $!; wait'], "
        "stdout=subprocess.PIPE, start_new_session=True);"
        "child = int(p.stdout.readline());"
        "procs.register(p.pid, kind='pgid', label='test group');"
        "print(p.pid, child, flush=True); sys.stdin.read()"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "HARNESS_OWNER": "", "HARNESS_PROCS_DIR": str(procs.REGISTRY_DIR)},
    )
    leader, child = map(int, owner.stdout.readline().split())
    return owner, leader, child


def test_reap_stale_kills_the_group_of_a_dead_owner(registry, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))
    owner, leader, child = _spawn_owner_with_group()
    try:
        assert procs.alive(leader) and procs.alive(child)
        assert procs.reap_stale() == []  # owner alive: untouched
        assert procs.alive(leader) and procs.alive(child)
        owner.kill()
        owner.wait()
        reaped = procs.reap_stale()
        assert [e.pid for e in reaped] == [leader]
        assert procs.wait_gone([leader, child], 10) == []
        assert procs.entries() == []
    finally:
        for p in (leader, child):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_recycled_pid_is_not_killed(registry):
    victim = subprocess.Popen(["sleep", "300"])
    try:
        entry = procs.Entry(
            kind="pid", pid=victim.pid, start=procs.start_time(victim.pid) + 1, owner=999999999, owner_start=1
        )
        assert procs.kill_entry(entry) is False
        assert procs.alive(victim.pid)
    finally:
        victim.kill()
        victim.wait()


def test_a_step_of_the_wall_clock_leaves_a_live_owner_alive(registry, tmp_path, monkeypatch):
    # psutil's create_time() is the boot time the wall clock implies now plus the start tick: a step of
    # the clock (seen here) moved it, every live owner then read as dead, and reap_stale removed the Ray
    # temp dirs of running test sessions. The step is psutil's boot time moving by a second.
    import psutil._pslinux

    monkeypatch.delenv(procs.OWNER_ENV, raising=False)
    ray_dir = Path(tempfile.mkdtemp(prefix="ph-", dir="/tmp"))  # as the cluster makes its Ray temp dir
    try:
        assert procs.register(os.getpid(), kind="dir", label="ray temp dir", path=ray_dir) is not None
        before = procs.start_time(os.getpid())
        real = psutil._pslinux.boot_time
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: real() + 1.0)
        assert procs.start_time(os.getpid()) == before
        assert procs.reap_stale() == [] and ray_dir.is_dir() and len(procs.entries()) == 1
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)


def test_register_and_unregister(registry):
    f = procs.register(os.getpid(), label="me")
    assert f is not None and f.exists()
    (e,) = procs.entries()
    assert e.pid == os.getpid() and e.start == procs.start_time(os.getpid())
    procs.unregister(os.getpid())
    assert procs.entries() == []


def test_descendants_and_group_members():
    p = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(procs.descendants(p.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(procs.descendants(p.pid)) == 2
        assert sorted(procs.group_members(p.pid)) == sorted([p.pid, *procs.descendants(p.pid)])
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_run_logged_returns_the_status_with_output_in_the_log(tmp_path):
    log = tmp_path / "run.log"
    code, timed_out = procs.run_logged(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
        cwd=tmp_path,
        env=os.environ,
        log=log,
        timeout_s=60,
    )
    assert (code, timed_out) == (3, False)
    assert log.read_text().split() == ["out", "err"]


def test_run_logged_kills_the_whole_group_past_its_limit(tmp_path):
    pid_file = tmp_path / "grandchild"
    code = (
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    code, timed_out = procs.run_logged(
        [sys.executable, "-c", code], cwd=tmp_path, env=os.environ, log=tmp_path / "run.log", timeout_s=3
    )
    assert (code, timed_out) == (-signal.SIGKILL, True)
    assert procs.wait_gone([int(pid_file.read_text())], timeout=10) == [], "the command's child outlived the kill"


def test_an_interrupted_run_logged_hands_the_interrupt_to_its_command(tmp_path):
    # harness matrix / faults check / mutate run each command in a session of its own, so ^C reaches only
    # them: the interrupt must be passed on (a rerun-test then stops its groups) before they exit.
    saw, started = tmp_path / "saw-sigint", tmp_path / "started"
    inner = (
        f"import pathlib, signal, time; "
        f"signal.signal(signal.SIGINT, lambda *a: (pathlib.Path({str(saw)!r}).touch(), exit(130))); "
        f"pathlib.Path({str(started)!r}).touch(); time.sleep(60)"
    )
    outer = (
        f"import os, sys; from harness.workers import procs; "
        f"procs.run_logged([sys.executable, '-c', {inner!r}], cwd={str(tmp_path)!r}, env=os.environ, "
        f"log=procs.Path({str(tmp_path / 'run.log')!r}), timeout_s=60)"
    )
    # Started as a terminal starts it (SIGINT default): a test run in the background of a script (CI, a
    # nohup'd job) inherits SIGINT ignored, and the harness process would then never see the interrupt.
    p = subprocess.Popen([sys.executable, "-c", outer], preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(started.exists, 30, "the command started")
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=30) != 0
    finally:
        p.kill()
    assert saw.exists(), "the command never got the interrupt"


def test_wait_gone_tells_a_process_from_a_later_one_with_its_pid():
    me = os.getpid()
    start = procs.start_time(me)
    # Known by its start time, this process still runs ...
    assert procs.wait_gone([me], 0.2, {me: start}) == [me]
    # ... and a process that started at another time under this pid is gone (its pid was reused).
    assert procs.wait_gone([me], 0.2, {me: start + 1}) == []


def test_a_planted_dir_entry_never_removes_a_directory_the_harness_did_not_make(registry, tmp_path):
    # Before: reap_stale rmtree'd whatever a dead owner's `dir` entry named (reproduced: a planted entry deleted
    # its target). Now only the harness's own temp directories (ph-* in the temp directory) are ever removed.
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data").write_text("keep")
    procs.registry_dir()
    planted = procs.Entry(kind="dir", pid=1, start=0, owner=2**22 + 11, owner_start=1.0, label="x", path=str(precious))
    (registry / f"{planted.owner}-dir-1.json").write_text(json.dumps(dataclasses.asdict(planted)))
    assert procs.reap_stale() == []
    assert (precious / "data").read_text() == "keep" and procs.entries() == []
    with pytest.raises(ValueError, match="not a directory the harness made"):
        procs.register(os.getpid(), kind="dir", path=precious)


def test_the_state_directory_must_be_the_users_own(tmp_path):
    mine = procs.private_dir(tmp_path / "state")
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    os.chmod(mine, 0o755)  # ours, readable by others: narrowed
    assert stat.S_IMODE(procs.private_dir(mine).stat().st_mode) == 0o700
    os.chmod(mine, 0o775)  # an older harness's mkdir under umask 002: only our own group can write it
    assert stat.S_IMODE(procs.private_dir(mine).stat().st_mode) == 0o700
    os.chmod(mine, 0o777)  # others could plant entries: refused
    with pytest.raises(procs.UnsafeDirError, match=r"others can write it \(mode 777\); remove it"):
        procs.private_dir(mine)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(procs.UnsafeDirError, match="not a directory"):
        procs.private_dir(link)
    if os.getuid() == 0:  # only root can hand a directory to another user
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 12345, 12345)
        with pytest.raises(procs.UnsafeDirError, match=r"owned by uid 12345, not by you"):
            procs.private_dir(theirs)


def test_an_unsafe_state_directory_is_one_line_and_exit_2_from_a_command(tmp_path):
    # A fresh process, as a user runs it: a pytest worker here may already be connected to Ray.
    open_dir = tmp_path / "procs"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    env = {**os.environ, "HARNESS_PROCS_DIR": str(open_dir), "HARNESS_OWNER": ""}
    harness = Path(sys.executable).with_name("harness")
    done = subprocess.run(
        [str(harness), "topology", "check", "cpu", "--simulate"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"harness: {open_dir}: others can write it (mode 777); "), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
