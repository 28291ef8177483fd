"""Soak figures of a PD pair: requests/s and the leak's slope over many requests, on either engine.

Both engines run :func:`harness.engines.soak_driver.drive`, the code the soak suites run: ``--engine sim``
(10,000 requests) or ``--engine server`` (2,000, the real CPU stack). It prints requests/s, the largest leak
and its slope per 1,000 requests. Goal: slope 0 (a leak is never a tolerance). Setup: docs/modules.md.

Usage: ``.venv/bin/python bench/soak.py [--engine sim|server] [--requests N] [--every K] [--seed 0]``
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile

PAGE, WINDOW = 64, 100
#: Per engine: default requests and checkpoint interval.
DEFAULTS = {"sim": (10_000, 100), "server": (2_000, 100)}
SERVER_MODEL = "tiny-mellum-swa"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--engine",
        choices=sorted(DEFAULTS),
        default="sim",
        help="sim: the simulated PD engine on Ray; server: the real CPU stack (default sim)",
    )
    p.add_argument("--requests", type=int, default=None, help="requests in all (default 10000 sim, 2000 server)")
    p.add_argument("--every", type=int, default=None, help="requests per batch, between checkpoints (default 100)")
    p.add_argument("--concurrency", type=int, default=4, help="server: requests in flight at once (default 4)")
    p.add_argument("--seed", type=int, default=0, help="the mix's seed (default 0)")
    args = p.parse_args(argv)
    n, every = DEFAULTS[args.engine]
    args.requests = n if args.requests is None else args.requests
    args.every = every if args.every is None else args.every
    if args.requests < 1 or args.every < 1 or args.concurrency < 1:
        p.error(
            f"--requests, --every and --concurrency must be at least 1 "
            f"(got {args.requests}, {args.every}, {args.concurrency})"
        )
    return args


def run_sim(args: argparse.Namespace, run_dir: str):
    from harness import topology
    from harness.cluster import Cluster
    from harness.engines.sim import deploy
    from harness.engines.sim.sim_soak import soak
    from harness.engines.sim.workload import KVSpec

    spec = KVSpec(
        kind="swa",
        page_size=PAGE,
        window=WINDOW,
        radix_cache=True,
        full_tokens=48 * PAGE,
        swa_tokens=16 * PAGE,
        req_slots=8,
    )
    topo = topology.get("2-gpu-h100")
    with Cluster.start(topo, simulate=True) as cluster:
        dep = deploy.start(cluster, topo, run_dir, spec, name_prefix="soak-")
        try:
            result = soak(dep.pair, args.requests, every=args.every, seed=args.seed)
        finally:
            dep.stop()
    return result, f"simulated engine, 2-gpu-h100, SWA page {PAGE} window {WINDOW}, radix cache on"


def run_server(args: argparse.Namespace, run_dir: str):
    from harness import rundir, topology
    from harness.cluster import Cluster
    from harness.engines.server.server_soak import soak_stack
    from harness.engines.server.stack_pool import StackPool, counted_names

    topo = topology.get("cpu")
    run = rundir.create(run_dir)
    with Cluster.start(topo) as cluster:
        # The stack as the real-server suites get theirs (harness.plugins.stacks): the same pool, its own callbacks.
        pool = StackPool(cluster, topo, run, unique_name=counted_names("soak-"))
        try:
            stack = pool.pd(SERVER_MODEL)
            result = soak_stack(
                stack,
                run.ledger,
                args.requests,
                every=args.every,
                seed=args.seed,
                page_size=PAGE,
                concurrency=args.concurrency,
            )
        finally:
            left = pool.close()
    if left:
        raise RuntimeError(f"server processes left after the soak: {left}")
    return result, (
        f"real CPU stack (sglang prefill + decode + router, {SERVER_MODEL}, page {PAGE}, started in "
        f"{stack.started_s:.0f} s), {args.concurrency} in flight"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING)
    run_dir = tempfile.mkdtemp(prefix="pd-soak-")
    keep = True  # logs and ledgers stay when the soak fails or raises
    try:
        try:
            result, what = (run_server if args.engine == "server" else run_sim)(args, run_dir)
        except Exception as e:  # noqa: BLE001 - a dead worker, a reset that failed, a missing model: one line
            print(f"the soak stopped: {type(e).__name__}: {' '.join(str(e).split())[:600]}")
            return 1
        s = result.summary()
        load = os.getloadavg()
        print(
            f"{os.cpu_count()} CPU cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
            f"{what}; seed {args.seed}"
        )
        print(
            f"requests {s['requests']} (completed {s['completed']}, aborted {s['aborted']}, prefix hits "
            f"{s['prefix_hits']}) in {s['wall_s']:.1f} s: {s['requests_per_s']:.1f} requests/s"
        )
        print(
            f"checkpoints {s['checkpoints']} (every {args.every}); largest leak {s['max_leak']}; "
            f"slope {s['slope']:.4f} slots per 1,000 requests (goal: 0)"
        )
        try:
            result.assert_clean()
        except AssertionError as e:  # PDError and LeakError are
            print(f"the soak failed: {e}")
            return 1
        keep = False
        return 0
    finally:
        if keep:
            print(f"(logs and ledgers kept in {run_dir})", file=sys.stderr)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
