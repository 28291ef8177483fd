"""PD over Ray on 2-gpu-h100 (TP1 + TP1) against 8-gpu-h200 (TP4 + TP4), simulated, in one run.

For each topology: start a local Ray with the topology's GPUs as logical GPUs, start one worker per
TP rank of the first prefill and decode groups (each builds real sglang pools), then run the seeded
randomized workload of ``suites/e2e/test_swa_accounting.py`` (``--requests`` requests, hybrid-SWA
pools, page 64, window 100) through the full P→D path with the ledger checked at the end.

Ranks start two ways (``--rank-start``, default both, measured in the same run):

* ``fork`` — the default of :mod:`harness.pd.deploy`: each rank's Ray worker is a fork of a
  :mod:`harness.workers.forkserver` that imported what a rank runs once (its preload CPU is printed on its
  own line: paid once per driver process, shared by every deployment after it);
* ``fresh`` — every rank's process imports torch and sglang itself (``HARNESS_FORK_START=0``).

Prints, per mode and topology: rank start-up seconds, workload seconds, requests/s, the CPU seconds
of the rank processes (start-up and workload) and **CPU seconds per rank start** — the rank process
plus, for forked ranks, the process Ray started for it (``setup_worker.py`` exec'd into the fork
server's client) — and the 8-gpu / 2-gpu ratios (the issue's goals: ≤ 1.5 CPU-s per rank start,
≤ 2 for the whole simulation).

Usage::

    .venv/bin/python bench/topology_scaling.py [--requests 200] [--seed 20251129] [--rank-start both|fork|fresh]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

SMALL, LARGE = "2-gpu-h100", "8-gpu-h200"
PAGE, WINDOW = 64, 100
MODES = ("fork", "fresh")


@dataclass(frozen=True)
class Measured:
    """One topology's numbers."""

    ranks: int
    start_s: float
    work_s: float
    requests: int
    start_cpu_s: float
    work_cpu_s: float
    standin_cpu_s: float  # the processes Ray started for forked ranks (0 for fresh ones)

    @property
    def total_s(self) -> float:
        return self.start_s + self.work_s

    @property
    def cpu_per_rank_start(self) -> float:
        return (self.start_cpu_s + self.standin_cpu_s) / self.ranks


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/topology_scaling.py", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200, help="requests in the workload (default 200)")
    p.add_argument("--seed", type=int, default=20251129, help="workload seed (default 20251129)")
    p.add_argument("--rank-start", choices=("both", *MODES), default="both",
                   help="fork (from the fork server), fresh (own imports) or both (default)")
    args = p.parse_args(argv)
    if args.requests < 1:
        print(f"bench/topology_scaling.py: --requests must be ≥ 1, got {args.requests}; pass a positive integer",
              file=sys.stderr)
        sys.exit(2)
    return args


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes have used so far (0 for one that is gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _standins(sockets: set[str]) -> list[int]:
    """Pids of the fork-server clients (Ray's stand-ins for forked ranks) of our servers."""
    import psutil

    from harness.workers.forkserver import CLIENT, SOCKET_ENV

    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(CLIENT) in " ".join(p.info["cmdline"] or ()) and p.environ().get(SOCKET_ENV) in sockets:
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def measure(name: str, requests: int, seed: int, mode: str) -> Measured:
    from harness import topology
    from harness.workers import forkserver
    from harness.cluster import Cluster
    from harness.pd import deploy
    from harness.pd.run import run
    from harness.pd.spec import KVSpec, workload

    os.environ[forkserver.OFF_ENV] = "1" if mode == "fork" else "0"
    spec = KVSpec(kind="swa", page_size=PAGE, window=WINDOW, full_tokens=24 * PAGE, swa_tokens=10 * PAGE, req_slots=8)
    reqs = workload(seed, requests, page_size=PAGE, max_prompt=6 * PAGE, max_steps=12, abort_rate=0.05, prefix=f"{name}-")
    topo = topology.get(name)
    run_dir = tempfile.mkdtemp(prefix="pd-scaling-")
    try:
        with Cluster.start(topo, simulate=True) as cluster:
            t0 = time.perf_counter()
            dep = deploy.start(cluster, topo, run_dir, spec, name_prefix="scaling-")
            try:
                start_s = time.perf_counter() - t0
                pids = [w.info.pid for w in dep.workers]
                start_cpu = _cpu_s(pids)
                standins = _standins({s.socket_path for s in forkserver.running_shared()}) if mode == "fork" else []
                standin_cpu = _cpu_s(standins)
                res = run(dep.pair, reqs, chunk_pages=8)
                res.assert_clean()
                work_cpu = _cpu_s(pids) - start_cpu
            finally:
                dep.stop()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return Measured(len(dep.workers), start_s, res.wall_s, len(res.completed) + len(res.aborted), start_cpu, work_cpu,
                    standin_cpu)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING)
    from harness.workers import forkserver

    modes = MODES if args.rank_start == "both" else (args.rank_start,)
    got = {(mode, name): measure(name, args.requests, args.seed, mode) for mode in modes for name in (SMALL, LARGE)}
    preload_cpu = sum(_cpu_s([s.pid]) for s in forkserver.running_shared())
    forkserver.stop_shared()
    load = os.getloadavg()
    print(f"{os.cpu_count()} CPU cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
          f"workload: {args.requests} requests, seed {args.seed}")
    print(f"{'mode':5} {'topology':12} {'ranks':>5} {'start s':>8} {'work s':>7} {'total s':>8} {'req/s':>6} "
          f"{'start cpu-s':>11} {'work cpu-s':>10} {'cpu-s/rank start':>16}")
    for (mode, name), m in got.items():
        print(f"{mode:5} {name:12} {m.ranks:5d} {m.start_s:8.1f} {m.work_s:7.1f} {m.total_s:8.1f} {m.requests / m.work_s:6.1f} "
              f"{m.start_cpu_s + m.standin_cpu_s:11.1f} {m.work_cpu_s:10.1f} {m.cpu_per_rank_start:16.2f}")
    if "fork" in modes:
        print(f"fork server preload (once per driver process, before the first rank): {preload_cpu:.1f} cpu-s")
    for mode in modes:
        s, l = got[(mode, SMALL)], got[(mode, LARGE)]
        print(f"{mode}: ratio {LARGE} / {SMALL}: start {l.start_s / s.start_s:.2f}, workload {l.work_s / s.work_s:.2f}, "
              f"whole {l.total_s / s.total_s:.2f} (goal ≤ 2); cpu-s per rank start {s.cpu_per_rank_start:.2f} / "
              f"{l.cpu_per_rank_start:.2f} (goal ≤ 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
