"""P→D KV transfer rate through Ray, as a ratio to an in-process torch copy of the same bytes.

Starts a local Ray (topology ``cpu``: one prefill and one decode worker on real sglang DeepSeek-V4
pools), preallocates one long request on decode (the real ``_pre_alloc``), prefills it, then moves
its pages (full pages for all tokens, SWA pages of the window) ``--repeat`` times through
:func:`harness.pd.transfer.transfer`: chunks of ``--chunk-pages`` pages, prefill actor → object
store → decode actor (numpy, read zero-copy), at most ``--inflight-mb`` unacknowledged. After
each transfer the same chunk sizes are copied in this process with ``torch.Tensor.copy_`` (the
reference). The content is verified on the decode side afterwards, and both sides release the
request.

Usage::

    .venv/bin/python bench/transfer.py [--pages 240] [--chunk-pages 64] [--inflight-mb 64] [--repeat 9]

Prints the bytes moved, both rates (median over the repeats) and the median of the per-repeat
ratios (goal ≥ 0.5). The machine's load moves both rates; each ratio compares a transfer with the
copy made right after it, so the median ratio is the number to compare across runs.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time

import torch

PAGE = 256


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/transfer.py", description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=240, help="prompt length in pages of 256 tokens (default 240)")
    p.add_argument("--chunk-pages", type=int, default=64, help="pages per transfer chunk (default 64)")
    p.add_argument("--inflight-mb", type=float, default=64.0, help="bound on unacknowledged MB (default 64)")
    p.add_argument("--repeat", type=int, default=9, help="transfers timed (default 9)")
    args = p.parse_args(argv)
    for name in ("pages", "chunk_pages", "repeat"):
        if getattr(args, name) < 1:
            print(f"bench/transfer.py: --{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}; "
                  "pass a positive integer", file=sys.stderr)
            sys.exit(2)
    if args.inflight_mb <= 0:
        print(f"bench/transfer.py: --inflight-mb must be > 0, got {args.inflight_mb}; pass e.g. 64", file=sys.stderr)
        sys.exit(2)
    return args


class TorchCopy:
    """``copy_`` of the same chunk sizes in this process; :meth:`once` times one pass (seconds).

    With one torch thread, as the rank workers run (Ray gives a fractional-CPU actor
    ``OMP_NUM_THREADS=1``): on a 2-core machine a two-thread ``copy_`` of a few MiB is slower by
    up to two orders of magnitude and swings with the load, which would make the ratio noise.
    """

    def __init__(self, sizes: list[int]):
        self.src = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
        self.dst = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        self.once()  # warm-up

    def once(self) -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            t0 = time.perf_counter()
            for s, d in zip(self.src, self.dst):
                d.copy_(s)
            return time.perf_counter() - t0
        finally:
            torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING)
    from harness import topology
    from harness.cluster import Cluster
    from harness.pd import deploy
    from harness.pd.spec import KVSpec
    from harness.pd.transfer import plan, transfer

    pages = args.pages
    spec = KVSpec(kind="dsv4", page_size=PAGE, window=128, full_tokens=(pages + 4) * PAGE, swa_tokens=8 * PAGE,
                  req_slots=2, max_context_len=(pages + 4) * PAGE)
    topo = topology.get("cpu")
    run_dir = tempfile.mkdtemp(prefix="pd-bench-")
    prompt = pages * PAGE - 1
    with Cluster.start(topo) as cluster:
        dep = deploy.start(cluster, topo, run_dir, spec, name_prefix="bench-")
        try:
            pair = dep.pair
            dst = pair.decode.all("admit", "bench", prompt, 1)
            src = pair.prefill.all("prefill", "bench", prompt)
            chunks = plan(src, dst, args.chunk_pages)
            sizes = [c.nbytes(pair.page_bytes) for c in chunks]
            bound = int(args.inflight_mb * 2**20)
            transfer(pair.prefill, pair.decode, "bench", chunks, pair.page_bytes, max_inflight_bytes=bound)  # warm-up
            local = TorchCopy(sizes)
            ray_s, local_s = [], []
            # Interleaved, so each transfer and its reference copy see the same machine load.
            for _ in range(args.repeat):
                st = transfer(pair.prefill, pair.decode, "bench", chunks, pair.page_bytes, max_inflight_bytes=bound)
                ray_s.append(st.seconds)
                local_s.append(local.once())
            full = [sorted(d["full"].values()) for d in dst]
            swa = [sorted(d["swa"].values()) for d in dst]
            pair.decode.get([pair.decode.submit(0, "commit", "bench", full[0], swa[0])])  # verifies every byte
            pair.prefill.all("release", "bench")
            pair.decode.all("abort", "bench")
        finally:
            dep.stop()
    shutil.rmtree(run_dir, ignore_errors=True)
    nbytes = sum(sizes)
    ray_rate = nbytes / statistics.median(ray_s) / 1e9
    local_rate = nbytes / statistics.median(local_s) / 1e9
    ratio = statistics.median(ls / rs for ls, rs in zip(local_s, ray_s))
    print(f"request: {prompt} tokens, {len(chunks)} chunks of ≤{args.chunk_pages} pages, "
          f"{nbytes / 2**20:.1f} MiB per transfer, in-flight bound {args.inflight_mb:g} MiB, {args.repeat} transfers")
    print(f"P→D through Ray:          {ray_rate:8.3f} GB/s (median)")
    print(f"in-process torch copy_:   {local_rate:8.3f} GB/s (median)")
    print(f"ratio (goal ≥ 0.5):       {ratio:8.3f} (median of per-transfer ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
