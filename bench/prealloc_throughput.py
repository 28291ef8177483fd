"""PD decode prealloc + release throughput on sglang's real objects, against a bare allocator loop.

For the non-hisparse and hisparse paths it times real prealloc + release cycles and bare allocator cycles
side by side and prints the ratio, the number to compare. Target: >= 2,000 real cycles/s on the
non-hisparse path on a 2-core CPU machine. What each cycle is and why one torch thread: docs/modules.md.

Usage: ``.venv/bin/python bench/prealloc_throughput.py [--seconds 1.0] [--repeat 3] [--device cpu] [--torch-threads 1]``
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger("bench.prealloc_throughput")

FILLS = (300, 1000, 129, 64, 700, 1)
TARGET_NON_HISPARSE = 2000.0


@dataclass(frozen=True)
class PathCase:
    """One prealloc path to measure."""

    name: str
    hisparse: bool
    page_size: int
    window: int


CASES = (PathCase("non-hisparse", False, 64, 128), PathCase("hisparse", True, 256, 128))


def _rate(cycle: Callable[[int], None], seconds: float, repeat: int) -> tuple[float, float]:
    """Median cycles per wall second and per CPU second of this process over ``repeat`` windows of
    about ``seconds`` each. The CPU-second rate is what an idle machine would come close to; the
    wall rate is what this run got while sharing the cores."""
    wall_rates, cpu_rates = [], []
    for _ in range(repeat):
        count, start, cpu_start = 0, time.perf_counter(), time.process_time()
        deadline = start + seconds
        while True:
            cycle(count)
            count += 1
            if count % 16 == 0 and time.perf_counter() >= deadline:
                break
        wall_rates.append(count / (time.perf_counter() - start))
        cpu_rates.append(count / max(time.process_time() - cpu_start, 1e-9))
    return statistics.median(wall_rates), statistics.median(cpu_rates)


def measure(case: PathCase, device: str, seconds: float, repeat: int) -> dict[str, Any]:
    """Real and bare cycles per second for one path.

    Args:
        case: the path.
        device: "cpu" or "cuda:N".
        seconds: length of one timed window.
        repeat: timed windows per figure.

    Returns:
        ``{"path", "real", "bare", "ratio"}``.
    """
    import torch

    from harness.engines.sim import DecodeConfig, DecodeSide, make_req

    side = DecodeSide(DecodeConfig(hisparse=case.hisparse, page_size=case.page_size, window=case.window, device=device))
    pending: list[Any] = []

    def refill() -> None:
        pending.extend(make_req(f"b{i}", FILLS[i % len(FILLS)]) for i in range(4096))

    def real(i: int) -> None:
        if not pending:
            refill()
        req = pending.pop()
        side.prealloc(req)
        side.release(req)

    swa_allocator = side.allocator.logical_attn_allocator if case.hisparse else side.allocator
    allocator = swa_allocator.full_attn_allocator
    lens = [
        (
            torch.tensor([0], dtype=torch.int64, device=device),
            torch.tensor([0], dtype=torch.int64),
            torch.tensor([n], dtype=torch.int64, device=device),
            torch.tensor([n], dtype=torch.int64),
            torch.tensor([-1], dtype=torch.int64, device=device),
            n,
        )
        for n in FILLS
    ]

    def bare(i: int) -> None:
        args = lens[i % len(lens)]
        kv_loc = allocator.alloc_extend(*args)
        allocator.free(kv_loc)

    refill()
    real(0), bare(0)  # warm-up: first calls build caches
    real_rate, real_cpu = _rate(real, seconds, repeat)
    bare_rate, bare_cpu = _rate(bare, seconds, repeat)
    if side.snapshot().free() != side.baseline.free():
        raise RuntimeError(
            f"{case.name}: pools did not return to baseline: {side.snapshot().taken_since(side.baseline)}"
        )
    return {
        "path": case.name,
        "real": real_rate,
        "bare": bare_rate,
        "ratio": real_rate / bare_rate,
        "real_cpu": real_cpu,
        "bare_cpu": bare_cpu,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="length of one timed window (default 1.0)")
    parser.add_argument("--repeat", type=int, default=3, help="timed windows per figure, median kept (default 3)")
    parser.add_argument("--device", default="cpu", help="device to build the pools on (default cpu)")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.repeat < 1 or args.torch_threads < 1:
        print(
            "prealloc_throughput: --seconds must be > 0, --repeat and --torch-threads >= 1; "
            "e.g. --seconds 1 --repeat 3",
            file=sys.stderr,
        )
        return 2
    import torch

    torch.set_num_threads(args.torch_threads)
    logging.basicConfig(level=logging.WARNING)
    import harness.targets.sglang as adapter

    print(
        f"{adapter.TARGET.label()}; faults active: {adapter.ACTIVE_FAULTS or 'none'}; "
        f"device {args.device}; torch threads {torch.get_num_threads()}; fills {FILLS}; "
        f"{args.repeat} x {args.seconds:.1f} s windows; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'path':<14}{'real /s':>10}{'bare /s':>10}{'real/bare':>11}{'real /cpu-s':>13}{'bare /cpu-s':>13}")
    for case in CASES:
        # sglang's scheduler loop runs under DynamicGradMode (torch.inference_mode), so the real
        # path is timed the way it runs in a server: no autograd bookkeeping on its small tensors.
        with torch.inference_mode():
            row = measure(case, args.device, args.seconds, args.repeat)
        print(
            f"{row['path']:<14}{row['real']:>10,.0f}{row['bare']:>10,.0f}{row['ratio']:>11.3f}"
            f"{row['real_cpu']:>13,.0f}{row['bare_cpu']:>13,.0f}"
        )
        if not case.hisparse:
            verdict = "meets" if row["real"] >= TARGET_NON_HISPARSE else "below"
            print(
                f"  non-hisparse {verdict} the {TARGET_NON_HISPARSE:,.0f} cycles/s target in wall time "
                f"({row['real_cpu']:,.0f} per CPU second)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
