"""Runs a person can find: ``run.json``, ``runs/latest``, retention and ``harness runs``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import cli, runs

REPO = Path(__file__).resolve().parent.parent


def _run(base: Path, name: str, state: str = "passed", started: float | None = None, **extra) -> Path:
    """A finished run directory under ``base`` as a command leaves it (``run.json`` written by runs.record)."""
    path = base / name
    with runs.record(path, ["rerun-test", name], target="sglang 0.5.23 (installed)", base=base) as rec:
        rec.finish(state, report=path / "report" / "index.html")
    data = json.loads((path / runs.RUN_FILE).read_text())
    data.update({"started": started if started is not None else data["started"], **extra})
    (path / runs.RUN_FILE).write_text(json.dumps(data))
    return path


def test_a_run_is_recorded_and_latest_points_at_it(tmp_path):
    base = tmp_path / "runs"
    with runs.record(
        base / "r1", ["/venv/bin/rerun-test", "test_a.py", "--sglang", "../my tree"], target="sglang 0.5.23 (tree)"
    ) as rec:
        info = runs.read(base / "r1")
        assert (info.state, info.pid, info.alive()) == ("running", os.getpid(), True)
        rec.finish("failed", report=base / "r1" / "report" / "index.html")
    info = runs.read(base / "r1")
    assert (info.state, info.command, info.target) == (
        "failed",
        "rerun-test test_a.py --sglang '../my tree'",
        "sglang 0.5.23 (tree)",
    )
    assert info.ended is not None and info.ended >= info.started and not info.alive()
    assert os.readlink(base / runs.LATEST) == "r1"
    with runs.record(base / "r2", ["harness", "gate", "run", "per-commit"]):
        pass  # a block that says nothing ended well
    assert runs.read(base / "r2").state == "passed" and os.readlink(base / runs.LATEST) == "r2"
    assert [r.name for r in runs.scan(base)] == ["r2", "r1"]  # newest first, latest left out


def test_a_run_that_raises_is_an_error_and_a_refused_one_leaves_nothing(tmp_path):
    base = tmp_path / "runs"
    with pytest.raises(RuntimeError):
        with runs.record(base / "crashed", ["rerun-test"]):
            raise RuntimeError("boom")
    assert runs.read(base / "crashed").state == "error"
    with pytest.raises(ValueError):
        with runs.record(base / "refused", ["rerun-test"], refused=(ValueError,)):
            raise ValueError("bad input")
    assert not (base / "refused").exists()
    assert os.readlink(base / runs.LATEST) == "crashed"  # a refused run is never the latest


def test_latest_is_replaced_in_one_rename(tmp_path):
    base = tmp_path / "runs"
    (base / "a").mkdir(parents=True)
    (base / "b").mkdir()
    runs.point_latest(base, base / "a")
    inode = (base / runs.LATEST).lstat().st_ino
    runs.point_latest(base, base / "b")
    assert os.readlink(base / runs.LATEST) == "b" and (base / runs.LATEST).lstat().st_ino != inode
    assert sorted(p.name for p in base.iterdir()) == ["a", "b", "latest"]  # no temporary link left


def test_retention_keeps_the_newest_and_never_the_protected(tmp_path):
    base = tmp_path / "runs"
    now = time.time()
    for i in range(4):
        _run(base, f"old-{i}", started=now - 10_000 - i)
    ci = base / "ci"
    ci.mkdir()
    os.utime(ci, (now - 90_000, now - 90_000))
    # in progress: recorded as running by this (live) process
    running = _run(base, "running", started=now - 50_000, state="passed")
    data = json.loads((running / runs.RUN_FILE).read_text())
    (running / runs.RUN_FILE).write_text(json.dumps({**data, "state": "running", "ended": None, "pid": os.getpid()}))
    # died while running: its pid is gone, so it is old like any other
    dead = _run(base, "dead", started=now - 60_000)
    data = json.loads((dead / runs.RUN_FILE).read_text())
    (dead / runs.RUN_FILE).write_text(json.dumps({**data, "state": "running", "pid": 2**22 + 7}))
    bundle = _run(base, "gate-with-repro", started=now - 70_000)
    (bundle / "report" / "failures" / "t").mkdir(parents=True)
    (bundle / "report" / "failures" / "t" / "repro.json").write_text("{}")
    source = _run(base, "reran", started=now - 80_000)
    _run(base, "repro", started=now - 5, source=str(source / "report" / "failures" / "t" / "repro.json"))
    unrecorded = base / "fresh-unrecorded"
    unrecorded.mkdir()
    stale = base / "stale-unrecorded"
    stale.mkdir()
    os.utime(stale, (now - 20_000, now - 20_000))

    removed = runs.prune(base, keep=3)  # the newest three: fresh-unrecorded, repro, old-0

    kept = sorted(p.name for p in base.iterdir() if p.name != runs.BASE_MARKER)
    assert sorted(p.name for p in removed) == sorted(["old-1", "old-2", "old-3", "dead", "stale-unrecorded"])
    assert kept == sorted(["ci", "fresh-unrecorded", "gate-with-repro", "latest", "old-0", "repro", "reran", "running"])
    found = runs.scan(base)
    why = {r.name: runs.kept_because(r, found) for r in found}
    assert why["ci"] == "runs/ci is never removed" and why["running"] == "in progress"
    assert why["gate-with-repro"] == "holds a repro bundle" and why["reran"] == "repro reran it"
    assert why["fresh-unrecorded"].startswith("not recorded") and why["old-0"] == ""
    assert why["repro"] == "runs/latest points at it"
    assert runs.prune(base, keep=0) == []  # 0 keeps every run


def test_retention_never_removes_a_folder_the_harness_did_not_create(tmp_path):
    # A person's own ~/runs holds experiments; a run given --run-dir ~/runs/x must not prune them, nor may
    # `harness runs --prune` there (before: any parent named `runs` was a runs base; 5 folders deleted).
    home_runs = tmp_path / "home" / "runs"
    old = time.time() - 20_000
    for i in range(5):
        (home_runs / f"my-experiment-{i}").mkdir(parents=True)
        os.utime(home_runs / f"my-experiment-{i}", (old, old))
    with runs.record(home_runs / "x", ["rerun-test", "x"]) as rec:
        rec.finish("passed")
    assert runs.prune(home_runs, keep=1) == []
    assert sorted(p.name for p in home_runs.iterdir()) == [*(f"my-experiment-{i}" for i in range(5)), "x"]
    assert not runs.is_marked(home_runs)
    assert runs.is_marked(runs.DEFAULT_BASE)  # the repository's own runs/, even from before the marker
    why = {r.name: runs.kept_because(r, runs.scan(home_runs)) for r in runs.scan(home_runs)}
    assert why["my-experiment-0"] == "not recorded, in a folder the harness did not create"


def test_the_kept_count_is_stated_and_a_bad_one_refused():
    assert runs.keep_count({}) == runs.DEFAULT_KEEP
    assert runs.keep_count({runs.KEEP_ENV: "5"}) == 5
    with pytest.raises(ValueError, match=r"HARNESS_KEEP_RUNS='five': not a whole number"):
        runs.keep_count({runs.KEEP_ENV: "five"})


def test_harness_runs_lists_them_newest_first(tmp_path, capsys, monkeypatch):
    base = tmp_path / "runs"
    now = time.time()
    _run(base, "20261201-100000-1", started=now - 600, state="failed")
    _run(base, "20261201-110000-2", started=now - 60)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["runs", "--runs-dir", str(base)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        f"2 run(s) in runs; keeping the newest {runs.DEFAULT_KEEP} (set HARNESS_KEEP_RUNS=N or pass --keep N; "
        "0 keeps all)"
    )
    assert out[1] == "latest: runs/latest -> 20261201-110000-2"
    assert out[2].split() == ["started", "verdict", "took", "command", "target", "report"]
    first, second = out[3], out[4]
    assert " passed " in first and "rerun-test 20261201-110000-2" in first
    assert first.endswith("runs/20261201-110000-2/report/index.html")
    assert " failed " in second and "sglang 0.5.23 (installed)" in second
    assert cli.main(["runs", "--runs-dir", str(base), "--json", "--limit", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in data["runs"]] == ["20261201-110000-2"] and data["keep"] == runs.DEFAULT_KEEP
    assert cli.main(["runs", "--runs-dir", str(base), "--prune", "--keep", "1"]) == 0
    assert "removed 20261201-100000-1" in capsys.readouterr().out
    assert not (base / "20261201-100000-1").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["runs", "--limit", "-1"], "--limit -1: must be ≥ 0"),
        (["runs", "--keep", "-2"], "--keep -2: must be ≥ 0"),
    ],
)
def test_harness_runs_refuses_bad_numbers_in_one_line(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("harness: ") and message in err and "\n" not in err


def test_a_refused_rerun_test_leaves_no_run_directory(tmp_path):
    # --ray-address with nothing listening: the join preflight refuses before the run starts.
    run_dir = tmp_path / "runs" / "refused"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.commands.rerun",
            "--ray-address",
            "127.0.0.1:1",
            "--run-dir",
            str(run_dir),
            "test_decode_reservation.py",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HARNESS_JOIN_TIMEOUT": "3"},
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1 and "127.0.0.1:1" in done.stderr
    assert not run_dir.exists() and not (tmp_path / "runs").exists()
