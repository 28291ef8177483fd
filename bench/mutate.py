"""Mutants per minute of ``harness mutate`` on the default function set, on this machine.

Runs ``harness mutate --limit N`` (default 30: the issue's goal is at least 30 mutants in at most 10 minutes
on 2 cores) and reads its ``mutation.json``: wall time, its split, mutants per minute, verdicts. Detail:
docs/modules.md.

Usage: ``.venv/bin/python bench/mutate.py [--limit N] [--jobs J]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=30)
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-mutate-") as tmp:
        out = Path(tmp) / "run"
        start = time.monotonic()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "harness.cli",
                "mutate",
                "--limit",
                str(args.limit),
                "--jobs",
                str(args.jobs),
                "--run-dir",
                str(out),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        wall = time.monotonic() - start
        if done.returncode != 0:
            print(done.stdout[-2000:], done.stderr[-2000:], sep="\n")
            return 1
        result = json.loads((out / "mutation.json").read_text())
        map_s = next(
            (float(line.split(" in ")[1].split()[0]) for line in done.stdout.splitlines() if "coverage map of" in line),
            0.0,
        )
    per = [m["seconds"] for m in result["mutants"] if m["verdict"] != "not covered"]
    n = result["total"]
    print(f"harness mutate --limit {args.limit} --jobs {args.jobs} (default set, installed sglang)")
    print(
        f"  mutants            {n} ({result['killed']} killed: {result['killed_by_sglang']} by sglang's checks, "
        f"{result['killed_by_crash']} by a crash; {result['survived']} survived, {result['timeout']} timeout, "
        f"{result['not_covered']} not covered); score {result['score']:.2f}"
    )
    print(f"  wall               {wall:.0f} s (coverage map {map_s:.0f} s, mutants {wall - map_s:.0f} s)")
    print(
        f"  mutants per minute {60 * n / wall:.1f} "
        f"(goal: ≥ 30 in ≤ 600 s: {'met' if n >= 30 and wall <= 600 else 'not met'})"
    )
    if per:
        print(f"  per mutant run     median {statistics.median(per):.1f} s, max {max(per):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
