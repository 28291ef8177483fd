"""Exploration throughput on the simulated engine: steps/s and schedules/min of ``harness explore`` on one core.

Runs one seeded :class:`harness.explore.machine.Session` for ``--seconds`` (after a warm-up schedule, so the
first import and pool build are not counted) with torch on one thread, and prints steps/s (goal ≥ 500),
schedules/min and the mean time of each rule. Steps are the rules' operations; the rate divides them by the
whole wall time (pool builds, invariant checks and Hypothesis included). It also divides them by this process's
CPU time, and prints the load average before and after: on a busy machine the wall rate falls with the load,
the CPU rate less so (it leaves out waits on the disk too).

Usage: ``.venv/bin/python bench/explore.py [--seconds 60] [--seed 0]``
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/explore.py", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="time budget (default 60)")
    p.add_argument("--seed", type=int, default=0, help="the seed (default 0)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger("sglang").setLevel(logging.CRITICAL)
    import torch

    torch.set_num_threads(1)
    from harness.explore.machine import Session, replay
    from harness.explore.pair import PairConfig

    run_dir = Path(tempfile.mkdtemp(prefix="bench-explore-"))
    try:
        for warm in (PairConfig(), PairConfig(page_size=256, window=128, hisparse=True)):  # first imports
            replay(warm, [("submit", {"prompt_len": 20, "group": 0, "steps": 1}), ("probe", {})], run_dir)
        session = Session(args.seed, run_dir, seconds=args.seconds)
        load = os.getloadavg()
        t0, c0 = time.perf_counter(), time.process_time()
        finding = session.run()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    prog = session.progress
    print(f"steps/s: {prog.steps / wall:.0f} (goal >= 500)")
    print(f"steps per CPU second: {prog.steps / cpu:.0f} (CPU {cpu:.1f}s of {wall:.1f}s wall)")
    print(
        "load average (1, 5, 15 min): before {:.2f} {:.2f} {:.2f}, after {:.2f} {:.2f} {:.2f}".format(
            *load, *os.getloadavg()
        )
    )
    print(f"schedules/min: {prog.schedules / wall * 60:.0f}")
    print(f"schedules: {prog.schedules}, steps: {prog.steps}, wall: {wall:.1f}s")
    for name in sorted(prog.rule_calls, key=lambda r: -prog.rule_seconds[r] / prog.rule_calls[r]):
        print(f"  {name:9} {1000 * prog.rule_seconds[name] / prog.rule_calls[name]:6.2f} ms x {prog.rule_calls[name]}")
    if finding is not None:
        print("a schedule broke:\n" + "\n".join(finding.lines()))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
