"""Helpers of the joined-cluster tests: run the harness's commands as a user would, against a
:class:`raycli.CliCluster`, with an environment the test controls.

Every command gets a clean environment: the test process's own Ray variables (a session cluster
started here sets ``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN``) are dropped, ``HOME`` is a temp dir (so
nothing reads or writes this machine's ``~/.ray``), and the process registry is the test's own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from raycli import CliCluster

REPO = Path(__file__).resolve().parent.parent
TOPOLOGY = "2-node-2-gpu-h100"
COMMAND_TIMEOUT_S = 420.0


@dataclass(frozen=True)
class Done:
    """A finished command: exit code and output (stdout and stderr together)."""

    rc: int
    out: str

    def lines(self) -> list[str]:
        return [ln for ln in self.out.splitlines() if ln.strip()]


def clean_env(home: Path, procs_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a harness command: no inherited Ray or harness-owner variables, ``HOME`` = ``home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTEST_", "HARNESS_"))}
    env.update(HOME=str(home), HARNESS_PROCS_DIR=str(procs_dir), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run(argv: list[str], env: dict[str, str], timeout: float = COMMAND_TIMEOUT_S) -> Done:
    """Run one of the installed commands (``rerun-test``, ``harness``) from the repository root and wait for it."""
    exe = str(Path(sys.executable).with_name(argv[0]))
    done = subprocess.run(
        [exe, *argv[1:]], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    return Done(done.returncode, done.stdout + done.stderr)


def rerun_test(
    cluster: CliCluster, env: dict[str, str], run_dir: Path, *specs: str, address: str | None = None
) -> Done:
    return run(["rerun-test", "--ray-address", address or cluster.address, "--run-dir", str(run_dir), *specs], env)


def linked_tree(dest: Path, version: str | None = None) -> Path:
    """A small sglang tree at ``dest``: links to the installed sglang's package, version and the core
    files the adapter checks (:func:`harness.targets.sglang.releases.core_missing`), no more; with
    ``version``, its own version file saying so. Ray follows links when it packages a tree, so a
    tree of links to *every* file would ship all of sglang (~130 MiB); this one ships a few KiB.
    Nothing here imports it (a worker's probe only asks where ``sglang`` would come from)."""
    import importlib.util

    from harness.targets.sglang import releases

    real = Path(importlib.util.find_spec("sglang").origin).parent
    for rel in ("__init__.py", "_version.py", *{f"srt/{core[0]}" for core in releases._CORE}):
        (dest / "sglang" / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / "sglang" / rel).symlink_to(real / rel)
    if version is not None:
        (dest / "sglang" / "_version.py").unlink()
        (dest / "sglang" / "_version.py").write_text(f'__version__ = version = "{version}"\n')
    return dest


def harness(env: dict[str, str], *args: str) -> Done:
    return run(["harness", *args], env)


def worker_actors(node) -> list[int]:
    """Processes of ``node`` that are harness worker actors or doctor probes (Ray names them ``ray::Class``)."""
    out = []
    for pid in node.members():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith(("ray::_WorkerActor", "ray::Probe")):
            out.append(pid)
    return out
