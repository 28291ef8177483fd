"""P→D KV transfer rate through Ray, as a ratio to an in-process torch copy of the same bytes.

Starts a local Ray (topology ``cpu``: one prefill and one decode worker on real sglang DeepSeek-V4
pools), preallocates one long request on decode (the real ``_pre_alloc``), prefills it, then moves
its pages (full pages for all tokens, SWA pages of the window) ``--repeat`` times through
:func:`harness.pd.transfer.transfer`: chunks of ``--chunk-pages`` pages batched into messages of
up to ``--inflight-mb`` (one object-store round trip each), prefill actor → object store → decode
actor (numpy, read zero-copy). After each transfer the same chunk sizes are copied in this process
with ``torch.Tensor.copy_`` (the reference). The content is verified on the decode side afterwards,
and both sides release the request.

In the same run, what bounds the ratio: the fixed cost of one message (an empty one through both
actors: two actor calls and one small object, ``--repeat`` × 5 times); the object-store floor (the
same arrays ``ray.put`` and ``ray.get`` in this process, then copied out: the per-byte cost of any
path through the store, with no actor hop); and the two-copy ceiling (the same bytes copied twice
in this process: a store-and-forward path copies into the store and out of it, so even with a free
store and no per-message cost it reaches about half the one-copy rate).

Usage::

    .venv/bin/python bench/transfer.py [--pages 240] [--chunk-pages 64] [--inflight-mb 64] [--repeat 9]

Prints the bytes moved, both rates (median over the repeats), the median of the per-repeat ratios
(goal ≥ 0.5), chunks and messages per transfer, the per-message cost and the ceiling those allow.
The machine's load moves every rate; each ratio compares a transfer with the copy made right after
it, so the median ratio is the number to compare across runs.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
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


class TwoCopies:
    """The store-and-forward floor: the same chunk sizes copied twice (source → staging → destination)
    in this process with one torch thread; :meth:`once` times one pass (seconds)."""

    def __init__(self, sizes: list[int]):
        self.src = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
        self.mid = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        self.dst = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        self.once()  # warm-up

    def once(self) -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            t0 = time.perf_counter()
            for s, m, d in zip(self.src, self.mid, self.dst):
                m.copy_(s)
                d.copy_(m)
            return time.perf_counter() - t0
        finally:
            torch.set_num_threads(threads)


class StoreFloor:
    """The same chunk sizes through Ray's object store in this process: ``ray.put`` of the arrays,
    ``ray.get`` (zero-copy), then ``copy_`` out with one torch thread; :meth:`once` times one pass."""

    def __init__(self, sizes: list[int]):
        self.src = [np.random.randint(0, 256, n, dtype=np.uint8) for n in sizes]
        self.dst = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        self.once()  # warm-up

    def once(self) -> float:
        import ray

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            t0 = time.perf_counter()
            ref = ray.put(self.src)
            with warnings.catch_warnings():
                # ray.get hands back read-only arrays (zero-copy); they are only read here.
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                for a, d in zip(ray.get(ref, timeout=60), self.dst):
                    d.copy_(torch.from_numpy(a))
            seconds = time.perf_counter() - t0
            del ref
            return seconds
        finally:
            torch.set_num_threads(threads)


def message_cost(pair, rid: str, n: int) -> list[float]:
    """Seconds of ``n`` empty messages (no pages) through both actors, one at a time: the fixed cost
    of one object-store round trip, as :func:`harness.pd.transfer.transfer` pays it per message."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        data = pair.prefill.submit(0, "read_chunk", rid, [])
        pair.decode.get([pair.decode.submit(0, "write_chunk", rid, [], data)])
        out.append(time.perf_counter() - t0)
    return out


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
            message_cost(pair, "bench", 3)  # warm-up
            local, floor, store = TorchCopy(sizes), TwoCopies(sizes), StoreFloor(sizes)
            ray_s, local_s, floor_s, store_s, msg_s = [], [], [], [], []
            # Interleaved, so each transfer and its reference copy see the same machine load.
            for _ in range(args.repeat):
                st = transfer(pair.prefill, pair.decode, "bench", chunks, pair.page_bytes, max_inflight_bytes=bound)
                ray_s.append(st.seconds)
                local_s.append(local.once())
                floor_s.append(floor.once())
                store_s.append(store.once())
                msg_s.extend(message_cost(pair, "bench", 5))
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
    msg = statistics.median(msg_s)
    two = statistics.median(floor_s)
    floor_store = statistics.median(store_s)
    one = statistics.median(local_s)
    print(f"request: {prompt} tokens, {len(chunks)} chunks of ≤{args.chunk_pages} pages in {st.messages} message(s), "
          f"{nbytes / 2**20:.1f} MiB per transfer, in-flight bound {args.inflight_mb:g} MiB, {args.repeat} transfers")
    print(f"P→D through Ray:          {ray_rate:8.3f} GB/s (median)")
    print(f"in-process torch copy_:   {local_rate:8.3f} GB/s (median)")
    print(f"ratio (goal ≥ 0.5):       {ratio:8.3f} (median of per-transfer ratios)")
    print(f"one message, no pages:    {msg * 1e3:8.3f} ms (median of {len(msg_s)}: two actor calls + one object)")
    print(f"two copies in process:    {nbytes / two / 1e9:8.3f} GB/s → ratio ceiling {one / two:.3f} for any store-and-forward path")
    print(f"object-store floor:       {nbytes / floor_store / 1e9:8.3f} GB/s (put + get + copy out, no actor hop) "
          f"→ ratio ceiling {one / floor_store:.3f}")
    print(f"model (store + messages): ratio ≤ {one / (floor_store + st.messages * msg):.3f} "
          f"({floor_store * 1e3:.2f} ms store + {st.messages} × {msg * 1e3:.2f} ms vs {statistics.median(ray_s) * 1e3:.2f} ms measured)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
