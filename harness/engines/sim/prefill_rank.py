"""The prefill worker payload: one per prefill TP rank, holding that rank's real sglang pools.

For each request it allocates the prompt through the real allocator, writes deterministic KV for
every prompt token into every page-indexed buffer (this rank's head shard: the content seed mixes
in the shard, so a rank→rank mix-up is caught), hands out pages for the transfer and frees through
the real release path. Every allocation, transfer and release is a ledger event.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from harness.ledger import LedgerConfig
from harness.engines.sim import kv_content, kvfill
from harness.engines.sim.payload import RankPayload
from harness.engines.sim.workload import KVSpec
from harness.engines.sim.tokens import prompt_ids, seeds

logger = logging.getLogger(__name__)


def pick_device(wanted: str) -> str:
    """``cuda:0`` for ``auto``/``cuda`` when torch sees a GPU, else ``cpu``.

    Raises:
        RuntimeError: ``cuda`` asked for explicitly and no GPU is visible.
    """
    if wanted == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("KVSpec.device='cuda' but torch sees no GPU in this worker")
    if wanted in ("auto", "cuda") and torch.cuda.is_available():
        return "cuda:0"  # CUDA_VISIBLE_DEVICES already narrows the worker to its GPU
    return "cpu"


class PrefillWorker(RankPayload):
    """Prefill payload of one TP rank (arguments: :class:`RankPayload`'s; its component is ``prefill``)."""

    def __init__(self, name: str, shard: int, spec: KVSpec, run_dir: str, tp: int = 1):
        super().__init__(name, shard, tp, run_dir, "prefill", spec)

    def configure(self, spec: KVSpec, discard: bool = False) -> str:
        """(Re)build the pools for ``spec``; ledger events of this configuration get their own books.

        Args:
            spec: the pool configuration.
            discard: drop requests still held (a failed test left them) instead of refusing: the
                pools are rebuilt, so nothing of them survives.

        Returns:
            The device the pools are on.

        Raises:
            RuntimeError: requests are still held and ``discard`` is False.
        """
        from harness.engines.sim.prefill_side import PrefillSide

        if discard and self.side is not None and self.reqs:
            logger.warning(
                "%s: discarding %d request(s) a failed run left: %s", self.name, len(self.reqs), sorted(self.reqs)
            )
            self.reqs.clear()
        if self.side is not None and self.reqs:
            raise RuntimeError(f"{self.name}: configure() with {len(self.reqs)} request(s) still held")
        self.spec = spec
        self.device = pick_device(spec.device)
        sizes = self.pool_sizes(spec)
        self.side = PrefillSide(spec.kind, spec.page_size, spec.window, sizes, self.device, spec.alloc_order)
        self.buffers = self.side.buffers
        if spec.hisparse:  # decode keeps C4 on the host: ship only what both sides hold per page
            self.buffers = type(self.buffers)(
                tuple(b for b in self.buffers.full if b.shape[1] != _c4_bytes(self.side)), self.buffers.swa
            )
        self.reqs: dict[str, Any] = {}
        self.groups: dict[str, str] = {}
        self.shipped: dict[str, dict[str, set[int]]] = {}
        self.ordinals: dict[str, dict[str, dict[int, int]]] = {}  # rid -> pool -> page -> request page j
        self.ledger.worker = f"{self.name}/{spec.tag}"
        # Prefill allocates whole prompts on both pools: no SWA-tail prealloc, no decode window rules.
        self.record_config(LedgerConfig(page_size=spec.page_size, window=spec.window or None), self._free())
        return self.device

    def _free(self) -> dict[str, int]:
        return {**self.side.free_sizes(), **self.side.resources()}

    def layout(self) -> dict[str, list[int]]:
        """Bytes per page of each transferred buffer (the decode side checks it has the same)."""
        return {
            "full": [int(b.shape[1]) for b in self.buffers.full],
            "swa": [int(b.shape[1]) for b in self.buffers.swa],
        }

    def prefill(self, rid: str, prompt_len: int, group: str | None = None) -> dict[str, Any]:
        """Allocate the prompt, write its KV and return the page map.

        Args:
            rid: request id.
            prompt_len: prompt tokens.
            group: prefix group (same group = same prompt ids and KV); default the rid.

        Returns:
            ``{"full": [page id of request page j], "swa": [...]}`` (SWA page id 0 = no slot).

        Raises:
            MemoryError: the prefill pools cannot hold the prompt.
        """
        P = self.spec.page_size
        group = group or rid
        before, free_before = self.side.free_pages(), self._free()
        req = self.side.alloc(rid, prompt_len)
        req.origin_input_ids = prompt_ids(group, prompt_len)
        after, free_after = self.side.free_pages(), self._free()
        self.ledger.record(
            "prealloc",
            rid,
            P,
            fill_len=prompt_len,
            pages={k: tuple(sorted(before[k] - after[k])) for k in before},
            free_before=free_before,
            free_after=free_after,
        )
        full, swa = self.side.locs(req, 0, prompt_len)
        pos = torch.arange(prompt_len, dtype=torch.int64)
        seed, _ = seeds(group, rid, self.shard)
        kvfill.write(list(self.buffers.full), P, 0, seed, pos, full // P, full % P)
        kvfill.write(list(self.buffers.swa), P, len(self.buffers.full), seed, pos, swa // P, swa % P)
        self.reqs[rid], self.groups[rid] = req, group
        self.shipped[rid] = {"full": set(), "swa": set()}
        pages = {"full": (full[::P] // P).tolist(), "swa": (swa[::P] // P).tolist()}
        self.ordinals[rid] = {pool: {p: j for j, p in enumerate(ids) if p} for pool, ids in pages.items()}
        return pages

    def read_chunk(self, rid: str, parts: list[tuple[str, list[int]]]) -> list[np.ndarray]:
        """Whole pages (page ids of this side) of every buffer of each part's pool, for the transfer.

        Args:
            rid: the request the pages belong to.
            parts: ``(pool, page ids)`` with pool ``full`` or ``swa`` (:meth:`transfer.Chunk.src`).

        Returns:
            The arrays of :func:`harness.engines.sim.kvfill.pack_pages`, part after part.
        """
        out: list[np.ndarray] = []
        for pool, pages in parts:
            self.shipped[rid][pool].update(pages)
            views = list(getattr(self.buffers, pool))
            kv_content.sent(
                self.ledger, rid, self.spec.page_size, self.shard, pool, views, list(pages), self.ordinals[rid][pool]
            )
            out.extend(kvfill.pack_pages(list(getattr(self.buffers, pool)), list(pages)))
        return out

    def send_pages(
        self, rid: str, src: list[tuple[str, list[int]]], dst: list[tuple[str, list[int]]], target: dict[str, Any]
    ) -> int:
        """Write pages straight into a decode rank's buffers (the store-free path, :mod:`harness.engines.sim.peer`).

        Args:
            rid: the request the pages belong to.
            src: ``(pool, page ids)`` of this side (:meth:`transfer.Chunk.src`).
            dst: ``(pool, decode page ids)``, the same pages in order (:meth:`transfer.Chunk.dst`).
            target: the decode rank's endpoint (:class:`harness.engines.sim.peer.Link`).

        Returns:
            Bytes written.

        Raises:
            RuntimeError: this rank's endpoint is not open, or the write failed.
        """
        if self.peer is None:
            raise RuntimeError(f"{self.name}: send_pages before peer_open")
        written = self.peer.write(target, dst, self.read_chunk(rid, src))
        for (pool, pages), (_, to) in zip(src, dst):
            ords = [self.ordinals[rid][pool][p] for p in pages]
            kv_content.landed(self.ledger, rid, self.spec.page_size, self.shard, pool, list(to), ords)
        return written

    def release(self, rid: str) -> None:
        """Record what was shipped, then free the request through the real release path."""
        req = self.reqs.pop(rid)
        self.groups.pop(rid, None)
        shipped = self.shipped.pop(rid)
        self.ordinals.pop(rid, None)
        P = self.spec.page_size
        self.ledger.record("transfer", rid, P, pages={k: tuple(sorted(v)) for k, v in shipped.items()})
        before, free_before = self.side.free_pages(), self._free()
        self.side.release(req)
        after, free_after = self.side.free_pages(), self._free()
        self.ledger.record(
            "release",
            rid,
            P,
            pages={k: tuple(sorted(after[k] - before[k])) for k in before},
            free_before=free_before,
            free_after=free_after,
        )

    def held(self) -> list[str]:
        """Requests this rank still holds."""
        return sorted(self.reqs)


def _c4_bytes(side: Any) -> int:
    from harness.targets.sglang.compat import dsv4_compressed_pools

    c4 = dsv4_compressed_pools(side.kv_pool).get(4, (None, None))[0]  # None on SWAKVPool
    return int(c4.kv_buffer[0][0].nbytes) if c4 is not None else -1
