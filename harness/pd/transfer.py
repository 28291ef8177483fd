"""Chunked P→D page transfer with a bound on bytes in flight.

For each TP rank, the pages a request needs (full pages past any cached prefix, SWA pages of the
window) go from prefill rank r to decode rank r in chunks of ``chunk_pages`` pages: the prefill
packs a chunk into one numpy array (``read_chunk``), the decode unpacks it at the pages sglang
allocated (``write_chunk``). Through Ray the decode actor receives the ObjectRef and reads the
array zero-copy from the object store; at most ``max_inflight_bytes`` are unacknowledged at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from harness.pd.ranks import Ranks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferStats:
    """What one request's transfer moved."""

    bytes: int
    chunks: int
    seconds: float
    aborted: bool


def plan(src: list[dict[str, list[int]]], dst: list[dict[str, Any]], chunk_pages: int) -> list[tuple[int, str, list[int], list[int]]]:
    """Chunks ``(rank, pool, prefill page ids, decode page ids)`` for every rank, full pool first.

    Args:
        src: per rank, the prefill's page ids by request page (``PrefillWorker.prefill``).
        dst: per rank, ``{"full": {j: page}, "swa": {j: page}}`` from ``DecodeWorker.admit``.
        chunk_pages: pages per chunk.

    Returns:
        The chunks in send order (ranks interleaved so all links carry traffic).
    """
    per_rank = []
    for s, d in zip(src, dst):
        chunks = []
        for pool in ("full", "swa"):
            js = sorted(d[pool])
            for i in range(0, len(js), chunk_pages):
                part = js[i:i + chunk_pages]
                chunks.append((pool, [s[pool][j] for j in part], [d[pool][j] for j in part]))
        per_rank.append(chunks)
    out = []
    for i in range(max((len(c) for c in per_rank), default=0)):
        for rank, chunks in enumerate(per_rank):
            if i < len(chunks):
                out.append((rank, *chunks[i]))
    return out


def transfer(prefill: Ranks, decode: Ranks, rid: str, chunks: list[tuple[int, str, list[int], list[int]]],
             page_bytes: dict[str, int], *, max_inflight_bytes: int, abort_after: int | None = None) -> TransferStats:
    """Move the chunks of one request.

    Args:
        prefill: the prefill ranks.
        decode: the decode ranks.
        rid: the request.
        chunks: from :func:`plan`.
        page_bytes: bytes of one page over all buffers of a pool (``full``/``swa``).
        max_inflight_bytes: most bytes sent but not yet written on the decode side.
        abort_after: stop after this many chunks (an abort mid-transfer).

    Returns:
        The :class:`TransferStats`.
    """
    t0 = time.perf_counter()
    sent = moved = 0
    inflight: list[tuple[Any, int, int]] = []  # (write handle, bytes, rank)
    aborted = False

    def drain(limit: int) -> None:
        nonlocal moved
        while inflight and sum(b for _, b, _ in inflight) > limit:
            handle, _, rank = inflight.pop(0)
            moved += decode.get([handle], [rank])[0]

    for rank, pool, src_pages, dst_pages in chunks:
        if abort_after is not None and sent >= abort_after:
            aborted = True
            break
        size = len(src_pages) * page_bytes[pool]
        drain(max(0, max_inflight_bytes - size))
        data = prefill.submit(rank, "read_chunk", rid, pool, src_pages)
        inflight.append((decode.submit(rank, "write_chunk", rid, pool, dst_pages, data), size, rank))
        sent += 1
    drain(0)
    return TransferStats(moved, sent, time.perf_counter() - t0, aborted)
