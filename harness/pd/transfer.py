"""Chunked P→D page transfer with a bound on bytes in flight.

For each TP rank, the pages a request needs (full pages past any cached prefix, SWA pages of the
window) go from prefill rank r to decode rank r in chunks of at most ``chunk_pages`` pages, full
pages first; a chunk may carry pages of both pools (a short prompt moves in one chunk). The prefill
returns a chunk as numpy arrays (``read_chunk``: views of its buffers where the pages are one run),
which Ray copies once into its object store; the decode actor receives the ObjectRef, reads the
arrays zero-copy and writes them at the pages sglang allocated (``write_chunk``). At most
``max_inflight_bytes`` are unacknowledged at once.
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


@dataclass(frozen=True)
class Chunk:
    """Pages one rank sends in one message: ``parts`` are ``(pool, prefill page ids, decode page ids)``."""

    rank: int
    parts: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]

    def src(self) -> list[tuple[str, list[int]]]:
        """``(pool, prefill page ids)`` per part: the prefill's ``read_chunk`` argument."""
        return [(pool, list(s)) for pool, s, _ in self.parts]

    def dst(self) -> list[tuple[str, list[int]]]:
        """``(pool, decode page ids)`` per part: the decode's ``write_chunk`` argument."""
        return [(pool, list(d)) for pool, _, d in self.parts]

    def nbytes(self, page_bytes: dict[str, int]) -> int:
        """Bytes of the chunk, given the bytes of one page over all buffers of each pool."""
        return sum(len(s) * page_bytes[pool] for pool, s, _ in self.parts)


def plan(src: list[dict[str, list[int]]], dst: list[dict[str, Any]], chunk_pages: int) -> list[Chunk]:
    """The chunks of one request for every rank, full pages first, then SWA pages.

    Args:
        src: per rank, the prefill's page ids by request page (``PrefillWorker.prefill``).
        dst: per rank, ``{"full": {j: page}, "swa": {j: page}}`` from ``DecodeWorker.admit``.
        chunk_pages: most pages per chunk.

    Returns:
        The chunks in send order (ranks interleaved so all links carry traffic).
    """
    per_rank = []
    for rank, (s, d) in enumerate(zip(src, dst)):
        pages = [(pool, s[pool][j], d[pool][j]) for pool in ("full", "swa") for j in sorted(d[pool])]
        chunks = []
        for i in range(0, len(pages), chunk_pages):
            part: dict[str, tuple[list[int], list[int]]] = {}
            for pool, sp, dp in pages[i:i + chunk_pages]:
                part.setdefault(pool, ([], []))
                part[pool][0].append(sp)
                part[pool][1].append(dp)
            chunks.append(Chunk(rank, tuple((pool, tuple(a), tuple(b)) for pool, (a, b) in part.items())))
        per_rank.append(chunks)
    out = []
    for i in range(max((len(c) for c in per_rank), default=0)):
        for chunks in per_rank:
            if i < len(chunks):
                out.append(chunks[i])
    return out


def transfer(prefill: Ranks, decode: Ranks, rid: str, chunks: list[Chunk],
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

    for chunk in chunks:
        if abort_after is not None and sent >= abort_after:
            aborted = True
            break
        size = chunk.nbytes(page_bytes)
        drain(max(0, max_inflight_bytes - size))
        data = prefill.submit(chunk.rank, "read_chunk", rid, chunk.src())
        inflight.append((decode.submit(chunk.rank, "write_chunk", rid, chunk.dst(), data), size, chunk.rank))
        sent += 1
    drain(0)
    return TransferStats(moved, sent, time.perf_counter() - t0, aborted)
