"""PD over Ray on 2-gpu-h100 (TP1 + TP1) against 8-gpu-h200 (TP4 + TP4), simulated, in one run.

For each topology: start a local Ray with the topology's GPUs as logical GPUs, start one worker per
TP rank of the first prefill and decode groups (each imports sglang and builds real pools), then run
the seeded randomized workload of ``suites/e2e/test_swa_accounting.py`` (``--requests`` requests,
hybrid-SWA pools, page 64, window 100) through the full P→D path with the ledger checked at the end.

Prints, per topology: rank start-up seconds, workload seconds, requests/s, the CPU seconds the rank
processes used (start-up and workload), and the 8-gpu / 2-gpu ratios (the issue's goal: ≤ 2 for the
whole simulation). The CPU seconds show what the wall time is bound by on a machine with few cores:
eight rank processes need eight sglang imports and four times the rank work of two, and only
``os.cpu_count()`` of them run at once.

Usage::

    .venv/bin/python bench/topology_scaling.py [--requests 200] [--seed 20251129]
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


@dataclass(frozen=True)
class Measured:
    """One topology's numbers."""

    ranks: int
    start_s: float
    work_s: float
    requests: int
    start_cpu_s: float
    work_cpu_s: float

    @property
    def total_s(self) -> float:
        return self.start_s + self.work_s


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/topology_scaling.py", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200, help="requests in the workload (default 200)")
    p.add_argument("--seed", type=int, default=20251129, help="workload seed (default 20251129)")
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


def measure(name: str, requests: int, seed: int) -> Measured:
    from harness import topology
    from harness.cluster import Cluster
    from harness.pd import deploy
    from harness.pd.run import run
    from harness.pd.spec import KVSpec, workload

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
                res = run(dep.pair, reqs, chunk_pages=8)
                res.assert_clean()
                work_cpu = _cpu_s(pids) - start_cpu
            finally:
                dep.stop()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return Measured(len(dep.workers), start_s, res.wall_s, len(res.completed) + len(res.aborted), start_cpu, work_cpu)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING)
    got = {name: measure(name, args.requests, args.seed) for name in (SMALL, LARGE)}
    print(f"{os.cpu_count()} CPU cores; workload: {args.requests} requests, seed {args.seed}")
    print(f"{'topology':12} {'ranks':>5} {'start s':>8} {'work s':>7} {'total s':>8} {'req/s':>6} "
          f"{'start cpu-s':>11} {'work cpu-s':>10}")
    for name, m in got.items():
        print(f"{name:12} {m.ranks:5d} {m.start_s:8.1f} {m.work_s:7.1f} {m.total_s:8.1f} {m.requests / m.work_s:6.1f} "
              f"{m.start_cpu_s:11.1f} {m.work_cpu_s:10.1f}")
    s, l = got[SMALL], got[LARGE]
    print(f"ratio {LARGE} / {SMALL}: start {l.start_s / s.start_s:.2f}, workload {l.work_s / s.work_s:.2f}, "
          f"whole {l.total_s / s.total_s:.2f} (goal ≤ 2)")
    print(f"rank CPU seconds {LARGE} / {SMALL}: start {l.start_cpu_s / s.start_cpu_s:.2f}, "
          f"workload {l.work_cpu_s / s.work_cpu_s:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
