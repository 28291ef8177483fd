"""Chunked P→D page transfer with a bound on bytes in flight, batched into few messages.

A request's pages go from prefill rank r to decode rank r in chunks (the unit of the plan and of an abort),
merged into as few messages as ``max_inflight_bytes`` allows, since each message costs one object-store
round trip. Given a :class:`harness.engines.sim.peer.Link`, a message skips the store (Mooncake). Chunks,
messages, copies and the transport choice: docs/modules.md.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from harness.engines.sim.peer import Link
from harness.engines.sim.ranks import Ranks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferStats:
    """What one request's transfer moved: ``chunks`` of the plan in ``messages`` messages, ``peer``
    when they skipped the object store."""

    bytes: int
    chunks: int
    seconds: float
    aborted: bool
    messages: int = 0
    peer: bool = False


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
            for pool, sp, dp in pages[i : i + chunk_pages]:
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


def merge(chunks: list[Chunk]) -> Chunk:
    """One message from consecutive chunks of one rank: the pages of each pool in one part.

    Raises:
        ValueError: the chunks belong to different ranks (or there are none).
    """
    if not chunks or any(c.rank != chunks[0].rank for c in chunks):
        raise ValueError(f"a message carries chunks of one rank, got ranks {[c.rank for c in chunks]}")
    parts: dict[str, tuple[list[int], list[int]]] = {}
    for c in chunks:
        for pool, s, d in c.parts:
            src, dst = parts.setdefault(pool, ([], []))
            src.extend(s)
            dst.extend(d)
    return Chunk(chunks[0].rank, tuple((pool, tuple(s), tuple(d)) for pool, (s, d) in parts.items()))


def messages(chunks: list[Chunk], page_bytes: dict[str, int], max_inflight_bytes: int) -> list[tuple[Chunk, int]]:
    """Group the chunks into messages, in send order (ranks interleaved).

    Each rank gets an equal share of ``max_inflight_bytes`` so every rank can have a message in
    flight at once; consecutive chunks of a rank join one message while it stays within that share.

    Args:
        chunks: from :func:`plan` (possibly cut short by an abort).
        page_bytes: bytes of one page over all buffers of a pool.
        max_inflight_bytes: the transfer's bound on unacknowledged bytes.

    Returns:
        ``(merged chunk, how many chunks it carries)`` per message.
    """
    ranks = sorted({c.rank for c in chunks})
    share = max(1, max_inflight_bytes // max(1, len(ranks)))
    per_rank: dict[int, list[list[Chunk]]] = {r: [] for r in ranks}
    size: dict[int, int] = {}
    for c in chunks:
        n = c.nbytes(page_bytes)
        groups = per_rank[c.rank]
        if groups and size[c.rank] + n <= share:
            groups[-1].append(c)
            size[c.rank] += n
        else:
            groups.append([c])
            size[c.rank] = n
    out = []
    for i in range(max((len(g) for g in per_rank.values()), default=0)):
        for r in ranks:
            if i < len(per_rank[r]):
                group = per_rank[r][i]
                out.append((merge(group), len(group)))
    return out


def transfer(
    prefill: Ranks,
    decode: Ranks,
    rid: str,
    chunks: list[Chunk],
    page_bytes: dict[str, int],
    *,
    max_inflight_bytes: int,
    abort_after: int | None = None,
    link: Link | None = None,
) -> TransferStats:
    """Move the chunks of one request.

    Args:
        prefill: the prefill ranks.
        decode: the decode ranks.
        rid: the request.
        chunks: from :func:`plan`.
        page_bytes: bytes of one page over all buffers of a pool (``full``/``swa``).
        max_inflight_bytes: most bytes sent but not yet written on the decode side.
        abort_after: stop after this many chunks (an abort mid-transfer).
        link: the decode ranks' endpoints for the store-free path (None: through the object store).

    Returns:
        The :class:`TransferStats`.
    """
    t0 = time.perf_counter()
    aborted = abort_after is not None and abort_after < len(chunks)
    if aborted:
        chunks = chunks[:abort_after]
    moved = 0
    inflight: list[tuple[Any, int, int]] = []  # (write handle, bytes, rank)
    writer = decode if link is None else prefill  # whose call answers with the bytes written

    def drain(limit: int) -> None:
        nonlocal moved
        while inflight and sum(b for _, b, _ in inflight) > limit:
            handle, _, rank = inflight.pop(0)
            moved += writer.get([handle], [rank])[0]

    sent = 0
    batches = messages(chunks, page_bytes, max_inflight_bytes)
    try:
        for msg, _ in batches:
            size = msg.nbytes(page_bytes)
            drain(max(0, max_inflight_bytes - size))
            if link is None:
                data = prefill.submit(msg.rank, "read_chunk", rid, msg.src())
                handle = decode.submit(msg.rank, "write_chunk", rid, msg.dst(), data)
            else:
                handle = prefill.submit(msg.rank, "send_pages", rid, msg.src(), msg.dst(), link.targets[msg.rank])
            inflight.append((handle, size, msg.rank))
            sent += 1
        drain(0)
    except Exception:
        if link is not None:  # a write into a dead decode rank fails on the prefill side: name the
            decode.check()  # dead worker (WorkerDied, with its log tail) rather than the failed write
        raise
    return TransferStats(moved, len(chunks), time.perf_counter() - t0, aborted, messages=sent, peer=link is not None)
