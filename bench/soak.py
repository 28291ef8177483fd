"""Soak figures of the simulated PD engine: requests/s and the leak's slope over many requests.

It runs :func:`harness.pd.soak.soak` — the code the soak suite
(``suites/disaggregation/test_disaggregation_soak.py``, 300 requests under ``./dev test``) runs — on
one PD pair of the simulated 2-GPU H100 topology, with hybrid-SWA pools and the radix cache on:
batches of ``--every`` requests (page-boundary prompt lengths, a tenth aborted mid-transfer, a third
sharing a prefix), every pool read against its baseline after each batch. It prints requests per
second of the soak's wall time, the checkpoints, the largest leak any of them read and the slope of
the leak (slots per 1,000 requests). Goal: slope 0 (exactly: a leak is never a tolerance) over at least
10,000 requests.

Usage::

    .venv/bin/python bench/soak.py [--requests 10000] [--every 100] [--seed 0]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile

PAGE, WINDOW = 64, 100


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000, help="requests in all (default 10000)")
    p.add_argument("--every", type=int, default=100, help="requests per batch, between checkpoints (default 100)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    args = p.parse_args(argv)
    if args.requests < 1 or args.every < 1:
        p.error(f"--requests and --every must be at least 1 (got {args.requests}, {args.every})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING)
    from harness import topology
    from harness.cluster import Cluster
    from harness.pd import deploy
    from harness.pd.soak import soak
    from harness.pd.spec import KVSpec

    spec = KVSpec(kind="swa", page_size=PAGE, window=WINDOW, radix_cache=True, full_tokens=48 * PAGE,
                  swa_tokens=16 * PAGE, req_slots=8)
    topo = topology.get("2-gpu-h100")
    run_dir = tempfile.mkdtemp(prefix="pd-soak-")
    try:
        with Cluster.start(topo, simulate=True) as cluster:
            dep = deploy.start(cluster, topo, run_dir, spec, name_prefix="soak-")
            try:
                result = soak(dep.pair, args.requests, every=args.every, seed=args.seed)
            finally:
                dep.stop()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    s = result.summary()
    load = os.getloadavg()
    print(f"{os.cpu_count()} CPU cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; simulated engine, "
          f"2-gpu-h100, SWA page {PAGE} window {WINDOW}, radix cache on; seed {args.seed}")
    print(f"requests {s['requests']} (completed {s['completed']}, aborted {s['aborted']}, prefix hits "
          f"{s['prefix_hits']}) in {s['wall_s']:.1f} s: {s['requests_per_s']:.1f} requests/s")
    print(f"checkpoints {s['checkpoints']} (every {args.every}); largest leak {s['max_leak']}; "
          f"slope {s['slope']:.4f} slots per 1,000 requests (goal: 0)")
    if result.failed is not None:
        print(f"a batch broke a rule: {result.failed.problems[:3]} {[str(v) for v in result.failed.violations[:3]]}")
        return 1
    return 0 if s["max_leak"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
