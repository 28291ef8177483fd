"""Harness overhead per topology (simulated), as ratios against a bare ``ray.init`` + actor in the same run.

Each measurement (bare Ray, the harness API, a no-op test) runs in a fresh process; each topology row is
paired with a baseline measured just before it, because the machine's load moves absolute numbers. The
three measurements: docs/modules.md.

Usage: ``.venv/bin/python bench/overhead.py [--topology NAME ...] [--repeat N]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = ("cpu", "2-gpu-h100", "8-gpu-h200", "2-node-16-gpu-h200")

NOOP_TEST = textwrap.dedent("""
    from harness.workers import Probe, InProcess

    def test_noop(pd_workers, topology):
        for role in topology.roles:
            pd_workers(role.name, InProcess(Probe))
""")


def _child_baseline() -> dict:
    t0 = float(os.environ["BENCH_T0"])
    import ray

    tdir = tempfile.mkdtemp(prefix="pb-", dir="/tmp")
    ray.init(include_dashboard=False, logging_level="ERROR", _temp_dir=tdir, num_cpus=4, log_to_driver=False)

    @ray.remote(num_cpus=0.1)
    class Actor:
        def ping(self) -> int:
            return os.getpid()

    a = Actor.remote()
    ray.get(a.ping.remote(), timeout=300)
    ready = time.time() - t0
    ray.shutdown()
    return {"ready": ready, "total": time.time() - t0}


def _child_harness(name: str) -> dict:
    t0 = float(os.environ["BENCH_T0"])
    from harness import rundir, topology
    from harness.cluster import Cluster
    from harness.workers import InProcess, Probe, WorkerSpec, start_worker

    topo = topology.get(name)
    run = rundir.create(Path(tempfile.mkdtemp(prefix="bench-run-")))
    with Cluster.start(topo, simulate=True) as cluster:
        placement = cluster.place(topo)
        workers = []
        first = placement.groups[0]
        workers.append(start_worker(WorkerSpec(f"{first.name}-0", InProcess(Probe), run_dir=run.root), first))
        ready = time.time() - t0
        for g in placement.groups[1:]:
            workers.append(start_worker(WorkerSpec(f"{g.name}-0", InProcess(Probe), run_dir=run.root), g))
        for w in workers:
            w.stop()
    return {"ready": ready, "total": time.time() - t0}


def _run(argv: list[str], env_extra: dict | None = None, json_out: bool = True) -> dict:
    env = {**os.environ, "BENCH_T0": repr(time.time()), **(env_extra or {})}
    t0 = time.time()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    wall = time.time() - t0
    if proc.returncode != 0:
        sys.exit(
            f"overhead: {' '.join(argv[:4])} ... failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    if not json_out:
        return {"total": wall}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _noop_pytest(name: str, workdir: Path) -> dict:
    test = workdir / "test_noop_overhead.py"
    test.write_text(NOOP_TEST)
    return _run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(test),
            "-q",
            "-p",
            "no:cacheprovider",
            "--simulate",
            "--topology",
            name,
            "--run-dir",
            str(workdir / f"run-{name}"),
            "--rootdir",
            str(workdir),
        ],
        json_out=False,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", action="append", choices=TOPOLOGIES, help="measure only these (repeatable)")
    p.add_argument("--repeat", type=int, default=1, help="measurements per row (median reported)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = _child_baseline() if args.child[0] == "baseline" else _child_harness(args.child[1])
        print(json.dumps(result))
        return 0
    if args.repeat < 1:
        print("overhead: --repeat must be ≥ 1", file=sys.stderr)
        return 2
    names = args.topology or list(TOPOLOGIES)
    me = [sys.executable, str(Path(__file__).resolve())]
    # Each topology row is paired with a baseline measured just before it: the machine's load drifts
    # between minutes, so a ratio only means something against a neighbour.
    rows: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for _ in range(args.repeat):
            for n in names:
                base = _run(me + ["--child", "baseline"])
                res = {**_run(me + ["--child", "harness", n]), "noop": _noop_pytest(n, Path(tmp))["total"]}
                row = rows.setdefault(n, {})
                for k, v in res.items():
                    row.setdefault(k, []).append(v)
                row.setdefault("ready_ratio", []).append(res["ready"] / base["ready"])
                row.setdefault("total_ratio", []).append(res["total"] / base["total"])
                row.setdefault("noop_ratio", []).append(res["noop"] / base["total"])
                row.setdefault("base_ready", []).append(base["ready"])
                row.setdefault("base_total", []).append(base["total"])
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in rows.items()}
    print(
        f"ratios against a bare ray.init + 1 actor (num_cpus=0.1) measured just before each row; "
        f"median of {args.repeat}; load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'topology':20} {'baseline ready/total':>21} {'first worker ready':>19} {'ratio':>6} "
        f"{'all workers+shutdown':>21} {'ratio':>6} {'no-op pytest':>13} {'ratio':>6}"
    )
    for n in names:
        r = med[n]
        print(
            f"{n:20} {r['base_ready']:>9.1f} s /{r['base_total']:>6.1f} s "
            f"{r['ready']:>17.1f} s {r['ready_ratio']:>6.2f} "
            f"{r['total']:>19.1f} s {r['total_ratio']:>6.2f} {r['noop']:>11.1f} s {r['noop_ratio']:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
