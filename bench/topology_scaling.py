"""PD over Ray at 2, 8, 16 and 32 simulated ranks, in one run: wall time, CPU seconds and memory per size.

Every rank of each shipped topology starts (forked or fresh, ``--rank-start``) and a seeded workload runs
through the full P→D path. It prints times, CPU-s per rank start, memory (PSS) and the issue's two goals,
each PASS or FAIL. Sizes, start modes and goals: docs/modules.md. Usage:
``.venv/bin/python bench/topology_scaling.py [--requests 200] [--seed N] [--rank-start fork|fresh|both] [--sizes 2,8]``
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

SIZES = {2: "2-gpu-h100", 8: "8-gpu-h200", 16: "2-node-16-gpu-h200", 32: "4-node-32-gpu-h200"}
PAGE, WINDOW = 64, 100
MODES = ("fork", "fresh")
PSS_GOAL_MB = 150.0
MB = 1 << 20


@dataclass(frozen=True)
class Memory:
    """Memory of a set of processes, bytes: PSS and RSS summed over them."""

    pss: int = 0
    rss: int = 0

    def __add__(self, other: "Memory") -> "Memory":
        return Memory(self.pss + other.pss, self.rss + other.rss)


@dataclass(frozen=True)
class Measured:
    """One size's numbers."""

    topology: str
    ranks: int
    preload_s: float  # the fork server's start on this cluster, before the ranks (0: one already served)
    start_s: float
    work_s: float
    requests: int
    start_cpu_s: float
    work_cpu_s: float
    standin_cpu_s: float  # the processes Ray started for forked ranks (0 for fresh ones)
    rank_mem: Memory  # the rank processes (Ray workers), after the workload
    standin_mem: Memory  # their stand-ins (forked ranks only)

    @property
    def total_s(self) -> float:
        return self.start_s + self.work_s

    @property
    def cpu_per_rank_start(self) -> float:
        return (self.start_cpu_s + self.standin_cpu_s) / self.ranks

    @property
    def pss(self) -> int:
        """PSS summed over everything a rank adds: its process and its stand-in."""
        return (self.rank_mem + self.standin_mem).pss


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        sizes = []
    if not sizes or any(s not in SIZES for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: pass sizes from {', '.join(map(str, SIZES))}, comma-separated")
    return sizes


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/topology_scaling.py", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200, help="requests in the workload (default 200)")
    p.add_argument("--seed", type=int, default=20251129, help="workload seed (default 20251129)")
    p.add_argument(
        "--rank-start",
        choices=("both", *MODES),
        default="fork",
        help="fork (from the fork server, default), fresh (own imports) or both",
    )
    p.add_argument(
        "--sizes", type=_sizes, default=sorted(SIZES), help="rank counts, comma-separated (default 2,8,16,32)"
    )
    args = p.parse_args(argv)
    if args.requests < 1:
        print(
            f"bench/topology_scaling.py: --requests must be ≥ 1, got {args.requests}; pass a positive integer",
            file=sys.stderr,
        )
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


def _memory(pids: list[int]) -> Memory:
    """PSS and RSS summed over the processes (``/proc/PID/smaps_rollup`` through psutil)."""
    import psutil

    out = Memory()
    for pid in pids:
        try:
            m = psutil.Process(pid).memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out += Memory(m.pss, m.rss)
    return out


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


def measure(ranks: int, requests: int, seed: int, mode: str) -> Measured:
    from harness import topology
    from harness.cluster import Cluster
    from harness.engines.sim import deploy
    from harness.engines.sim.driver import RunResult, run
    from harness.engines.sim.workload import KVSpec, workload
    from harness.workers import forkserver

    name = SIZES[ranks]
    os.environ[forkserver.OFF_ENV] = "1" if mode == "fork" else "0"
    spec = KVSpec(kind="swa", page_size=PAGE, window=WINDOW, full_tokens=24 * PAGE, swa_tokens=10 * PAGE, req_slots=8)
    reqs = workload(
        seed, requests, page_size=PAGE, max_prompt=6 * PAGE, max_steps=12, abort_rate=0.05, prefix=f"{name}-"
    )
    topo = topology.get(name)
    run_dir = tempfile.mkdtemp(prefix="pd-scaling-")
    try:
        with Cluster.start(topo, simulate=True) as cluster:
            # The fork server first, so start_s is the ranks' own: a server serves one environment,
            # and a multi-node cluster's (RAY_TMPDIR: its own temp dir) differs from the last one's.
            t0 = time.perf_counter()
            deploy.rank_runtime_env(cluster, topo)
            preload_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            dep = deploy.start(cluster, topo, run_dir, spec, name_prefix="scaling-", instances=None)
            try:
                start_s = time.perf_counter() - t0
                pids = [w.info.pid for w in dep.workers]
                if len(pids) != ranks:
                    raise RuntimeError(f"{name}: started {len(pids)} ranks, expected {ranks}")
                start_cpu = _cpu_s(pids)
                standins = _standins({s.socket_path for s in forkserver.running_shared()}) if mode == "fork" else []
                standin_cpu = _cpu_s(standins)
                shares = [reqs[i :: len(dep.pairs)] for i in range(len(dep.pairs))]
                t1 = time.perf_counter()
                with ThreadPoolExecutor(max_workers=len(dep.pairs)) as pool:
                    results: list[RunResult] = list(
                        pool.map(lambda ps: run(ps[0], ps[1], chunk_pages=8), zip(dep.pairs, shares))
                    )
                work_s = time.perf_counter() - t1
                for res in results:  # every request ended (completed, aborted, ...), or run() raised
                    res.assert_clean()
                work_cpu = _cpu_s(pids) - start_cpu
                rank_mem, standin_mem = _memory(pids), _memory(standins)
            finally:
                dep.stop()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return Measured(
        name, ranks, preload_s, start_s, work_s, len(reqs), start_cpu, work_cpu, standin_cpu, rank_mem, standin_mem
    )


def goals(got: dict[int, Measured]) -> list[str]:
    """The two goals, one line each: PASS / FAIL with the measured values (or why not measured)."""
    lines = []
    sizes = sorted(got)
    steps = [((a, b), (got[b].pss - got[a].pss) / (b - a) / MB) for a, b in zip(sizes, sizes[1:])]
    if steps:
        worst = max(v for _, v in steps)
        shown = ", ".join(f"{a}→{b}: {v:.0f}" for (a, b), v in steps)
        lines.append(
            f"memory goal: PSS growth per added rank ≤ {PSS_GOAL_MB:.0f} MB: {shown} MB/rank "
            f"→ {'PASS' if worst <= PSS_GOAL_MB else 'FAIL'}"
        )
    else:
        lines.append("memory goal: needs two sizes")
    if all(n in got for n in (2, 8, 16, 32)):
        small = (got[8].total_s - got[2].total_s) / 6
        large = (got[32].total_s - got[16].total_s) / 16
        lines.append(
            f"time goal: (T32 − T16) / 16 = {large:.2f} s/rank ≤ (T8 − T2) / 6 = {small:.2f} s/rank "
            f"→ {'PASS' if large <= small else 'FAIL'}"
        )
        for what in ("start_s", "work_s"):
            s8, s2, s32, s16 = (getattr(got[n], what) for n in (8, 2, 32, 16))
            lines.append(f"  ({what.removesuffix('_s')} only: {(s32 - s16) / 16:.2f} vs {(s8 - s2) / 6:.2f} s/rank)")
        # The same comparison in CPU seconds of the rank processes: what the wall time is made of on a
        # machine whose cores are shared, without the other work's share of them.
        c8, c2, c32, c16 = (got[n].start_cpu_s + got[n].standin_cpu_s + got[n].work_cpu_s for n in (8, 2, 32, 16))
        lines.append(
            f"  (in CPU-s, start-up + workload: {(c32 - c16) / 16:.2f} vs {(c8 - c2) / 6:.2f} cpu-s/rank "
            f"→ {'PASS' if (c32 - c16) / 16 <= (c8 - c2) / 6 else 'FAIL'}; not the goal, less bent by other load)"
        )
    else:
        lines.append("time goal: needs sizes 2, 8, 16 and 32")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING)
    from harness.workers import forkserver

    modes = MODES if args.rank_start == "both" else (args.rank_start,)
    before = os.getloadavg()
    got = {(mode, n): measure(n, args.requests, args.seed, mode) for mode in modes for n in args.sizes}
    servers = forkserver.running_shared()
    preload_cpu = sum(_cpu_s([s.pid]) for s in servers)
    server_mem = _memory([s.pid for s in servers])
    forkserver.stop_shared()
    after = os.getloadavg()
    print(
        f"{os.cpu_count()} CPU cores; load average before {before[0]:.1f} {before[1]:.1f} {before[2]:.1f}, "
        f"after {after[0]:.1f} {after[1]:.1f} {after[2]:.1f}; workload: {args.requests} requests, seed {args.seed}"
    )
    print(
        f"{'mode':5} {'topology':18} {'ranks':>5} {'preload s':>9} {'start s':>7} {'work s':>6} {'total s':>7} "
        f"{'req/s':>5} {'start cpu-s':>11} {'of it stand-ins':>15} {'work cpu-s':>10} {'cpu-s/rank start':>16} "
        f"{'PSS MB':>7} {'RSS MB':>7} "
        f"{'PSS/rank':>8} {'RSS/rank':>8} {'stand-in PSS':>12}"
    )
    for (mode, _), m in got.items():
        print(
            f"{mode:5} {m.topology:18} {m.ranks:5d} {m.preload_s:9.1f} {m.start_s:7.1f} {m.work_s:6.1f} "
            f"{m.total_s:7.1f} {m.requests / m.work_s:5.1f} {m.start_cpu_s + m.standin_cpu_s:11.1f} "
            f"{m.standin_cpu_s:15.1f} {m.work_cpu_s:10.1f} "
            f"{m.cpu_per_rank_start:16.2f} {m.pss / MB:7.0f} {(m.rank_mem + m.standin_mem).rss / MB:7.0f} "
            f"{m.rank_mem.pss / m.ranks / MB:8.0f} {m.rank_mem.rss / m.ranks / MB:8.0f} {m.standin_mem.pss / MB:12.0f}"
        )
    if "fork" in modes:
        print(
            f"fork servers ({len(servers)}; one per environment, started before the ranks, not in start s or T): "
            f"preload {preload_cpu:.1f} cpu-s, PSS {server_mem.pss / MB:.0f} MB, "
            f"RSS {server_mem.rss / MB:.0f} MB at the end"
        )
    for mode in modes:
        print(f"{mode}:")
        for line in goals({n: m for (md, n), m in got.items() if md == mode}):
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
