"""The simulated ranks' KV-content events: the same ``kv_sent`` / ``kv_landed`` / ``kv_dest`` / ``kv_commit`` a real
server's probe writes (:mod:`harness.engines.server.kv_digest`), so :mod:`harness.ledger.content` judges both engines.

A simulated request has no bootstrap room: its room is ``rid:pool:shard`` (each pool's pages and each TP rank
pair move apart), and a page's ordinal is its request page ``j``. Off with ``HARNESS_KV_DIGEST=0``.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

from harness.ledger import LedgerWriter
from harness.ledger.content import digest_rows

#: ``0`` turns the digests off on both engines.
DIGEST_ENV = "HARNESS_KV_DIGEST"


def enabled() -> bool:
    return os.environ.get(DIGEST_ENV, "1").strip() != "0"


def room(rid: str, pool: str, shard: int) -> str:
    return f"{rid}:{pool}:{shard}"


def digests(views: Iterable[Any], pages: list[int]) -> list[list[int]]:
    """Per buffer (a ``[pages, page_bytes]`` uint8 view), the digest of each page."""
    import torch

    idx = torch.as_tensor(pages, dtype=torch.int64)
    return [digest_rows(v.index_select(0, idx.to(v.device)).cpu().numpy()) for v in views]


def _runs(pages: list[int], ordinal: Mapping[int, int]) -> list[tuple[int, list[int]]]:
    """``(first ordinal, pages)`` per run of consecutive ordinals."""
    out: list[tuple[int, list[int]]] = []
    for p in pages:
        j = ordinal[p]
        if out and out[-1][0] + len(out[-1][1]) == j:
            out[-1][1].append(p)
        else:
            out.append((j, [p]))
    return out


def dest(ledger: LedgerWriter, rid: str, page_size: int, shard: int, maps: Mapping[str, Mapping[int, int]]) -> None:
    """Decode's destination pages (``maps``: pool -> {request page j: page}), as admit hands them out."""
    for pool, m in maps.items():
        if m and enabled():
            content = {"room": room(rid, pool, shard), "pool": pool, "at": min(m), "dst": [m[j] for j in sorted(m)]}
            ledger.record("kv_dest", rid, page_size, content=content)


def sent(
    ledger: LedgerWriter, rid: str, page_size: int, shard: int, pool: str, views: list, pages: list[int], ordinal
) -> None:
    """Prefill hands ``pages`` of ``pool`` to the transfer (``ordinal``: page -> request page j)."""
    if not enabled():
        return
    for at, run in _runs(pages, ordinal):
        content = {"room": room(rid, pool, shard), "at": at, "src": run, "digests": digests(views, run)}
        ledger.record("kv_sent", rid, page_size, content=content)


def landed(
    ledger: LedgerWriter, rid: str, page_size: int, shard: int, pool: str, dst: list[int], ords: list[int]
) -> None:
    """The transfer wrote ``dst`` (decode pages of ``pool``; ``ords``: each one's request page j)."""
    if not enabled():
        return
    runs: list[tuple[int, list[int]]] = []
    for page, j in zip(dst, ords):
        if runs and runs[-1][0] + len(runs[-1][1]) == j:
            runs[-1][1].append(page)
        else:
            runs.append((j, [page]))
    for at, run in runs:
        ledger.record("kv_landed", rid, page_size, content={"room": room(rid, pool, shard), "at": at, "dst": run})


def commit(
    ledger: LedgerWriter, rid: str, page_size: int, shard: int, maps: Mapping[str, Mapping[int, int]], buffers
) -> None:
    """Decode commits the request: the bytes of its destination pages, pool by pool."""
    for pool, m in maps.items():
        if m and enabled():
            dst = [m[j] for j in sorted(m)]
            content = {
                "room": room(rid, pool, shard),
                "pool": pool,
                "at": min(m),
                "dst": dst,
                "digests": digests(getattr(buffers, pool), dst),
            }
            ledger.record("kv_commit", rid, page_size, content=content)
