"""What measuring the target costs: ``rerun-test --coverage`` against the same run without it, side by side.

Each round runs the same specs plain, then with ``--coverage``; the median ratio over ``--repeat`` rounds is
reported, because the machine's load moves every absolute number. What it runs: docs/modules.md.

Usage: ``.venv/bin/python bench/coverage_overhead.py [--repeat N] [--server] [SPEC ...]``
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SPECS = ("test_decode_prealloc_ledger.py", "test_disaggregation_basic.py")


def _run(specs: list[str], coverage: bool, run_dir: Path) -> float:
    cmd = [sys.executable, "-m", "harness.commands.rerun", *specs, "--run-dir", str(run_dir)]
    cmd += ["--coverage"] if coverage else []
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{done.stdout[-2000:]}")
    return wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("specs", nargs="*")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--server", action="store_true", help="run the real servers' suite too (engine all)")
    args = p.parse_args()
    specs = list(args.specs or DEFAULT_SPECS)
    if not args.server:
        specs += ["--engine", "sim"]
    plain, measured = [], []
    with tempfile.TemporaryDirectory(prefix="bench-cov-") as tmp:
        for i in range(args.repeat):
            plain.append(_run(specs, False, Path(tmp) / f"plain-{i}"))
            measured.append(_run(specs, True, Path(tmp) / f"cov-{i}"))
    ratios = [m / q for m, q in zip(measured, plain)]
    print(f"rerun-test {' '.join(specs)}: {args.repeat} round(s), plain then --coverage")
    print(f"  plain      {', '.join(f'{w:.0f}' for w in plain)} s")
    print(f"  --coverage {', '.join(f'{w:.0f}' for w in measured)} s")
    print(
        f"  overhead   x{statistics.median(ratios):.2f} (median of the rounds' ratios; min x{min(ratios):.2f}, "
        f"max x{max(ratios):.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
