"""Teardown of the store-free P→D transport (:mod:`harness.engines.sim.peer`) over many runs: nothing leaks.

``--runs`` times it opens the transport, moves and verifies one request, and closes it, counting processes,
ports, connections, threads and fds; every run after the warm-up must match the baseline exactly. Exits 1
on a leak. What it counts and why the warm-up: docs/modules.md.

Usage: ``.venv/bin/python bench/peer_teardown.py [--runs 50]``
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile

import psutil

WARM_UP = 3  # runs before the baseline


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/peer_teardown.py", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=50, help="open/transfer/close runs (default 50)")
    args = p.parse_args(argv)
    if args.runs <= WARM_UP:
        print(
            f"bench/peer_teardown.py: --runs must be > {WARM_UP} (the first {WARM_UP} set the baseline), "
            f"got {args.runs}",
            file=sys.stderr,
        )
        sys.exit(2)
    return args


def _tree() -> list[psutil.Process]:
    return [psutil.Process(), *psutil.Process().children(recursive=True)]


def counts(rank_pids: list[int]) -> dict[str, int]:
    """What a leak would grow: processes, listening ports, connections, rank threads and fds, groups."""
    from ray.experimental.collective import get_collective_groups

    listen, conns, procs = set(), 0, 0
    for proc in _tree():
        try:
            for c in proc.net_connections("tcp"):
                if c.status == psutil.CONN_LISTEN:
                    listen.add((proc.pid, c.laddr.port))
                elif c.status == psutil.CONN_ESTABLISHED:
                    conns += 1
            procs += 1
        except psutil.NoSuchProcess:
            pass
    ranks = [psutil.Process(pid) for pid in rank_pids]
    return {
        "processes": procs,
        "listening": len(listen),
        "connections": conns,
        "rank_threads": sum(r.num_threads() for r in ranks),
        "rank_fds": sum(r.num_fds() for r in ranks),
        "collective_groups": len(get_collective_groups([])),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING)
    from harness import topology
    from harness.cluster import Cluster
    from harness.engines.sim import deploy, peer
    from harness.engines.sim.workload import KVSpec
    from harness.engines.sim.kv_transfer import plan, transfer

    os.environ[peer.MODE_ENV] = "peer"  # this script proves the store-free path: no silent fallback
    spec = KVSpec(kind="swa", page_size=64, window=100, full_tokens=32 * 64, swa_tokens=12 * 64, req_slots=4)
    topo = topology.get("cpu")
    run_dir = tempfile.mkdtemp(prefix="pd-teardown-")
    leaks: list[str] = []
    with Cluster.start(topo) as cluster:
        dep = deploy.start(cluster, topo, run_dir, spec, name_prefix="teardown-")
        pair = dep.pair
        rank_pids = [w.info.pid for w in dep.workers]
        peer.disconnect(pair.prefill, pair.decode)  # deploy opened it; every run below opens its own
        try:
            base: dict[str, int] = {}
            for i in range(args.runs):
                link = peer.connect(pair.prefill, pair.decode)
                assert link is not None
                rid = f"t{i}"
                dst = pair.decode.all("admit", rid, 700, 1)
                src = pair.prefill.all("prefill", rid, 700)
                st = transfer(
                    pair.prefill,
                    pair.decode,
                    rid,
                    plan(src, dst, 4),
                    pair.page_bytes,
                    max_inflight_bytes=1 << 20,
                    link=link,
                )
                assert st.peer and st.bytes > 0
                if i == 0:  # what an endpoint left open would add to the counts below
                    print(f"run 1, transport open: {counts(rank_pids)}")
                pair.decode.all("commit", rid, sorted(dst[0]["full"].values()), sorted(dst[0]["swa"].values()))
                pair.prefill.all("release", rid)
                pair.decode.all("abort", rid)
                peer.disconnect(pair.prefill, pair.decode)
                now = counts(rank_pids)
                if i < WARM_UP:
                    base = now
                    print(f"run {i + 1} (warm-up): {now}")
                elif now != base:
                    leaks.append(f"run {i + 1}: {now}")
                    print(f"run {i + 1} differs from the baseline: {now}")
            print(f"baseline: run {WARM_UP}; after run {args.runs}: {now} ({len(leaks)} run(s) off the baseline)")
        finally:
            dep.stop()
        gone = [
            pid for pid in rank_pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        ]
        print(f"after stop: rank processes left {gone}, tree {counts([]) if not gone else '-'}")
        if gone:
            leaks.append(f"rank processes {gone} outlived the deployment")
    shutil.rmtree(run_dir, ignore_errors=True)
    if leaks:
        print(f"LEAK: {len(leaks)} finding(s)", file=sys.stderr)
        return 1
    print(f"no leak over {args.runs} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
