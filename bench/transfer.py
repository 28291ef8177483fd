"""P→D KV transfer rate of both transports, each as a ratio to an in-process torch copy of the same bytes.

One long request's pages move ``--repeat`` times over the object store and store-free (Mooncake), each
transfer followed by a reference copy; the median ratio (goal ≥ 0.5) is the number to compare. It also
measures what bounds the ratio (message cost, store floor, two-copy ceiling, loopback TCP): docs/modules.md.

Usage: ``.venv/bin/python bench/transfer.py [--pages 240] [--chunk-pages 64] [--inflight-mb 64] [--repeat 9]``
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
            print(
                f"bench/transfer.py: --{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}; "
                "pass a positive integer",
                file=sys.stderr,
            )
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


class TcpFloor:
    """The same chunk sizes over one loopback TCP connection in this process (a sender thread,
    ``recv_into`` preallocated buffers here): the floor of any store-free path over TCP, which copies
    into the kernel and out again; :meth:`once` times one pass (seconds)."""

    def __init__(self, sizes: list[int]):
        import socket
        import threading

        self.src = [np.random.randint(0, 256, n, dtype=np.uint8) for n in sizes]
        self.dst = [np.empty(n, dtype=np.uint8) for n in sizes]
        with socket.create_server(("127.0.0.1", 0)) as server:
            send = socket.create_connection(server.getsockname())
            self.recv = server.accept()[0]
        self.go = threading.Semaphore(0)

        def sender() -> None:
            with send:
                while self.go.acquire() and self.src:
                    for a in self.src:
                        send.sendall(memoryview(a))

        self.thread = threading.Thread(target=sender, daemon=True)
        self.thread.start()
        self.once()  # warm-up

    def once(self) -> float:
        t0 = time.perf_counter()
        self.go.release()
        for d in self.dst:
            view, got = memoryview(d), 0
            while got < len(d):
                got += self.recv.recv_into(view[got:])
        return time.perf_counter() - t0

    def close(self) -> None:
        self.src = []
        self.go.release()
        self.thread.join(10)
        self.recv.close()


def message_cost(pair, rid: str, n: int, link=None) -> list[float]:
    """Seconds of ``n`` empty messages (no pages), one at a time, as :func:`harness.engines.sim.kv_transfer.transfer`
    pays them per message: through both actors and one object (store), or one prefill call (``link``)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        if link is None:
            data = pair.prefill.submit(0, "read_chunk", rid, [])
            pair.decode.get([pair.decode.submit(0, "write_chunk", rid, [], data)])
        else:
            pair.prefill.get([pair.prefill.submit(0, "send_pages", rid, [], [], link.targets[0])])
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
    from harness.engines.sim import deploy
    from harness.engines.sim.workload import KVSpec
    from harness.engines.sim.kv_transfer import plan, transfer

    pages = args.pages
    spec = KVSpec(
        kind="dsv4",
        page_size=PAGE,
        window=128,
        full_tokens=(pages + 4) * PAGE,
        swa_tokens=8 * PAGE,
        req_slots=2,
        max_context_len=(pages + 4) * PAGE,
    )
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
            link = pair.link
            full = [sorted(d["full"].values()) for d in dst]
            swa = [sorted(d["swa"].values()) for d in dst]
            if link is not None:  # into pages nothing wrote yet: the decode side verifies what arrived
                transfer(
                    pair.prefill, pair.decode, "bench", chunks, pair.page_bytes, max_inflight_bytes=bound, link=link
                )
                pair.decode.get([pair.decode.submit(0, "commit", "bench", full[0], swa[0])])
                message_cost(pair, "bench", 3, link)  # warm-up
            transfer(pair.prefill, pair.decode, "bench", chunks, pair.page_bytes, max_inflight_bytes=bound)  # warm-up
            message_cost(pair, "bench", 3)  # warm-up
            local, floor, store, tcp = TorchCopy(sizes), TwoCopies(sizes), StoreFloor(sizes), TcpFloor(sizes)
            ray_s, peer_s, local_s, floor_s, store_s, tcp_s, msg_s, peer_msg_s = [], [], [], [], [], [], [], []
            # Interleaved, so each transfer and its reference copy see the same machine load.
            for _ in range(args.repeat):
                st = transfer(pair.prefill, pair.decode, "bench", chunks, pair.page_bytes, max_inflight_bytes=bound)
                ray_s.append(st.seconds)
                if link is not None:
                    peer_s.append(
                        transfer(
                            pair.prefill,
                            pair.decode,
                            "bench",
                            chunks,
                            pair.page_bytes,
                            max_inflight_bytes=bound,
                            link=link,
                        ).seconds
                    )
                    peer_msg_s.extend(message_cost(pair, "bench", 5, link))
                local_s.append(local.once())
                floor_s.append(floor.once())
                store_s.append(store.once())
                tcp_s.append(tcp.once())
                msg_s.extend(message_cost(pair, "bench", 5))
            tcp.close()
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
    print(
        f"request: {prompt} tokens, {len(chunks)} chunks of ≤{args.chunk_pages} pages in {st.messages} message(s), "
        f"{nbytes / 2**20:.1f} MiB per transfer, in-flight bound {args.inflight_mb:g} MiB, {args.repeat} transfers"
    )
    print(f"P→D through Ray's store:  {ray_rate:8.3f} GB/s (median)")
    if peer_s:
        print(f"P→D store-free (mooncake):{nbytes / statistics.median(peer_s) / 1e9:8.3f} GB/s (median)")
    print(f"in-process torch copy_:   {local_rate:8.3f} GB/s (median)")
    print(f"ratio, store (goal ≥ 0.5):{ratio:8.3f} (median of per-transfer ratios)")
    if peer_s:
        peer_ratio = statistics.median(ls / ps for ls, ps in zip(local_s, peer_s))
        print(f"ratio, store-free:        {peer_ratio:8.3f} (median of per-transfer ratios)")
    else:
        print("ratio, store-free:             n/a (no store-free transport: see the log line above)")
    print(f"one message, no pages:    {msg * 1e3:8.3f} ms (median of {len(msg_s)}: two actor calls + one object)")
    if peer_msg_s:
        print(
            f"  store-free:             {statistics.median(peer_msg_s) * 1e3:8.3f} ms "
            f"(median of {len(peer_msg_s)}: one actor call)"
        )
    print(
        f"two copies in process:    {nbytes / two / 1e9:8.3f} GB/s "
        f"→ ratio ceiling {one / two:.3f} for any store-and-forward path"
    )
    print(
        f"object-store floor:       {nbytes / floor_store / 1e9:8.3f} GB/s (put + get + copy out, no actor hop) "
        f"→ ratio ceiling {one / floor_store:.3f}"
    )
    print(
        f"loopback TCP floor:       {nbytes / statistics.median(tcp_s) / 1e9:8.3f} GB/s (one connection, no actor hop) "
        f"→ ratio ceiling {one / statistics.median(tcp_s):.3f} for any path over TCP (the store-free one here)"
    )
    print(
        f"model (store + messages): ratio ≤ {one / (floor_store + st.messages * msg):.3f} "
        f"({floor_store * 1e3:.2f} ms store + {st.messages} × {msg * 1e3:.2f} ms "
        f"vs {statistics.median(ray_s) * 1e3:.2f} ms measured)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
