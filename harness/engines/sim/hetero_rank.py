"""The rank payload of heterogeneous PD: one prefill or decode rank holding its KV heads in sglang's real
``MHATokenToKVPool`` (pages from the real paged allocator), whose transfers sglang's own mooncake code
plans (:mod:`harness.engines.sim.hetero_transfer`).

Every KV element is :func:`content` of (request, layer, K/V, global head, position, element), so a byte
that lands on the wrong head, token or layer is seen. A write outside the memory a rank registered is
refused, as RDMA would refuse it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from harness import faults


class NotHeld(RuntimeError):
    """A prefill rank was asked for a request it does not hold (the decode bound it to the wrong rank:
    the real stack waits until its bootstrap timeout)."""


class Refused(ValueError):
    """A heterogeneous pair sglang cannot serve: one line naming both sides and the fix."""


@dataclass(frozen=True)
class HeteroModel:
    """The model shape both sides serve (an MHA/GQA model: every layer holds K and V per KV head)."""

    kv_heads: int = 2
    layers: int = 2
    head_dim: int = 2
    page_size: int = 4
    pool_tokens: int = 512
    kv_dtype: str = "auto"


def owned_heads(kv_heads: int, attn_tp: int, attn_tp_rank: int) -> tuple[int, ...]:
    """The KV heads one attention-TP rank holds, as the model's ``QKVParallelLinear`` shards them: a
    contiguous ``kv_heads // attn_tp`` when the heads go round, else one head shared by
    ``attn_tp // kv_heads`` consecutive ranks.

    Raises:
        Refused: the heads cannot be sliced to ``attn_tp`` (neither divides the other).
    """
    if attn_tp <= kv_heads:
        if kv_heads % attn_tp:
            raise Refused(f"{kv_heads} KV heads cannot be split over attention TP {attn_tp}: pick a TP dividing them")
        per = kv_heads // attn_tp
        return tuple(range(attn_tp_rank * per, (attn_tp_rank + 1) * per))
    if attn_tp % kv_heads:
        raise Refused(f"attention TP {attn_tp} cannot share {kv_heads} KV heads: pick a multiple of them")
    return (attn_tp_rank // (attn_tp // kv_heads),)


def content(rid: str, layer: int, kv: int, head: int, positions: np.ndarray, head_dim: int) -> np.ndarray:
    """The int32 KV elements of ``positions`` for one (request, layer, K=0/V=1, global head):
    ``[len(positions), head_dim]``, distinct for every tuple."""
    seed = zlib.crc32(rid.encode()) & 0xFFFF
    base = (seed * 1_000_003 + layer * 7_919 + kv * 104_729 + head * 15_485_863) & 0x3FFFFFFF
    pos = np.asarray(positions, dtype=np.int64)[:, None]
    return ((base + pos * 131 + np.arange(head_dim)[None, :]) & 0x3FFFFFFF).astype(np.int32)


@dataclass
class _Held:
    req: Any
    tokens: torch.Tensor  # the request's token slots in this rank's pool
    prompt_len: int
    bound: list[int] = field(default_factory=list)  # prefill DP ranks its receiver was bound to, in order


class HeteroRank:
    """One prefill or decode rank.

    Args:
        name: worker name.
        role: ``prefill`` or ``decode``.
        rank: the rank within its role (attention DP rank × attention TP + attention TP rank).
        tp: the role's TP size.
        dp: the role's DP size (attention DP when ``dp_attention``; else 1 here).
        peer_attn_tp / peer_dp: the other role's attention TP and DP sizes.
        model: the model shape.

    Raises:
        Refused: the model's KV heads cannot be sliced to this role's attention TP.
    """

    def __init__(
        self,
        name: str,
        role: str,
        rank: int,
        tp: int,
        dp: int,
        peer_attn_tp: int,
        peer_dp: int,
        model: HeteroModel,
    ):
        faults.activate_from_env()
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        self.name, self.role, self.model = name, role, model
        self.attn_tp = tp // dp
        self.attn_tp_rank, self.dp_rank, self.dp = rank % self.attn_tp, rank // self.attn_tp, dp
        self.peer_attn_tp, self.peer_dp = peer_attn_tp, peer_dp
        self.heads = owned_heads(model.kv_heads, self.attn_tp, self.attn_tp_rank)
        self.pool = MHATokenToKVPool(
            size=model.pool_tokens,
            page_size=model.page_size,
            dtype=torch.float32,
            head_num=len(self.heads),
            head_dim=model.head_dim,
            layer_num=model.layers,
            device="cpu",
            enable_memory_saver=False,
        )
        self.allocator = PagedTokenToKVPoolAllocator(
            size=model.pool_tokens,
            page_size=model.page_size,
            dtype=torch.float32,
            device="cpu",
            kvcache=self.pool,
            need_sort=True,
        )
        ptrs, lens, items = self.pool.get_contiguous_buf_infos()
        self.ptrs, self.lens, self.items = list(ptrs), list(lens), list(items)
        self.buffers = [*self.pool.k_buffer, *self.pool.v_buffer]  # the order of ptrs: K layers, then V
        self.held: dict[str, _Held] = {}

    # ------------------------------------------------------------------ both sides

    def _alloc(self, rid: str, req: Any, prompt_len: int) -> _Held:
        tokens = self.allocator.alloc(-(-prompt_len // self.model.page_size) * self.model.page_size)
        if tokens is None:
            raise MemoryError(f"{self.name}: no room for {rid} ({prompt_len} tokens)")
        held = _Held(req, tokens, prompt_len)
        self.held[rid] = held
        return held

    def pages(self, rid: str) -> list[int]:
        """The request's pages in this rank's pool."""
        return (self.held[rid].tokens[:: self.model.page_size] // self.model.page_size).tolist()

    def readback(self, rid: str) -> dict[str, Any]:
        """This rank's KV of the request: ``{"heads": the heads this rank holds, "kv": int32
        [layers, 2, prompt tokens, local heads, head_dim]}``."""
        held = self.held[rid]
        idx = held.tokens[: held.prompt_len]
        out = np.stack(
            [
                np.stack([self.pool.k_buffer[i][idx].view(torch.int32).numpy() for i in range(self.model.layers)]),
                np.stack([self.pool.v_buffer[i][idx].view(torch.int32).numpy() for i in range(self.model.layers)]),
            ],
            axis=1,
        )
        return {"heads": list(self.heads), "kv": out}

    def release(self, rid: str) -> None:
        held = self.held.pop(rid, None)
        if held is not None:
            self.allocator.free(held.tokens)

    def idle(self) -> dict[str, Any]:
        return {"held": sorted(self.held), "free": int(self.allocator.available_size())}

    def _region(self, addr: np.ndarray, length: np.ndarray, ptrs: list[int], lens: list[int]) -> np.ndarray:
        """Which registered buffer each ``[addr, addr + length)`` lies in; -1 where none holds it whole."""
        which: np.ndarray = np.full(len(addr), -1, dtype=np.int64)
        for i, (p, n) in enumerate(zip(ptrs, lens)):
            inside = (addr >= p) & (addr + length <= p + n)
            which[inside & (which < 0)] = i
        return which

    # ------------------------------------------------------------------ prefill

    def prefill(self, rid: str, prompt_len: int, room: int, routed_dp_rank: int | None) -> int:
        """Dispatch the request as the DP controller does; the ranks of the chosen DP rank allocate it and
        write its KV. Returns the chosen prefill DP rank."""
        from harness.engines.sim.hetero_transfer import make_request, place_on_dp_rank

        req = make_request(rid, prompt_len, room, "prefill", routed_dp_rank)
        chosen = place_on_dp_rank(req, self.dp) if self.dp > 1 else 0
        if chosen != self.dp_rank:
            return chosen
        held = self._alloc(rid, req, prompt_len)
        idx = held.tokens[:prompt_len]
        pos = np.arange(prompt_len)
        for layer in range(self.model.layers):
            for kv, bufs in enumerate((self.pool.k_buffer, self.pool.v_buffer)):
                view = bufs[layer].view(torch.int32)
                for slot, head in enumerate(self.heads):
                    data = content(rid, layer, kv, head, pos, self.model.head_dim)
                    view[idx, slot] = torch.from_numpy(data)
        return chosen

    def send(self, rid: str, dst: Any, dst_pages: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The writes sglang's mooncake manager issues for ``rid`` to one decode rank, with their bytes.

        Returns:
            ``(dst addresses, lengths, bytes)``: int64, int64 and the uint8 payload, write after write.

        Raises:
            NotHeld: this rank does not hold the request.
            RuntimeError: sglang read outside this rank's registered memory.
        """
        from harness.engines.sim.hetero_transfer import kv_writes

        if rid not in self.held:
            raise NotHeld(
                f"{self.name} (prefill DP rank {self.dp_rank}) was asked for {rid}, which it does not hold: "
                "the decode receiver is bound to the wrong prefill DP rank"
            )
        writes = kv_writes(
            engine_rank=self.attn_tp_rank,
            attn_tp=self.attn_tp,
            kv_head_num=len(self.heads),
            total_kv_heads=self.model.kv_heads,
            page_size=self.model.page_size,
            kv_data_ptrs=self.ptrs,
            kv_item_lens=self.items,
            prefill_pages=self.pages(rid)[: len(dst_pages)],
            dst=dst,
            dst_pages=dst_pages,
        )
        src, dst_addr, length = np.array(writes, dtype=np.int64).reshape(-1, 3).T
        region = self._region(src, length, self.ptrs, self.lens)
        if (region < 0).any():
            raise RuntimeError(f"{self.name}: sglang read {int((region < 0).sum())} range(s) outside its KV buffers")
        raw = [b.view(torch.uint8).reshape(-1).numpy() for b in self.buffers]
        parts = [raw[r][s - self.ptrs[r] : s - self.ptrs[r] + n] for r, s, n in zip(region, src, length)]
        blob = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
        return dst_addr, length, blob

    # ------------------------------------------------------------------ decode

    def admit(self, rid: str, prompt_len: int, room: int, prefill_dp_rank: int | None) -> dict[str, Any] | None:
        """Dispatch the request to a decode DP rank as the DP controller does; on its ranks, allocate
        pages, bind the receiver to a prefill DP rank and resolve the prefill TP ranks to pull from,
        all through sglang. None on the ranks of other DP ranks."""
        from harness.engines.sim.hetero_transfer import make_request, place_on_dp_rank

        req = make_request(rid, prompt_len, room, "decode", prefill_dp_rank)
        if (place_on_dp_rank(req, self.dp) if self.dp > 1 else 0) != self.dp_rank:
            return None
        self._alloc(rid, req, prompt_len)
        return self._bootstrap(rid)

    def _bootstrap(self, rid: str) -> dict[str, Any]:
        from harness.engines.sim.hetero_transfer import Registration, bind_prefill_dp_rank, rank_map

        held = self.held[rid]
        bound = bind_prefill_dp_rank(held.req, self.peer_attn_tp, self.peer_dp, self.model.page_size)
        if bound is None:
            raise RuntimeError(f"{self.name}: sglang could not bind {rid} to a prefill DP rank without a query")
        held.bound.append(int(bound))
        mapping = rank_map(self.attn_tp, self.attn_tp_rank, self.peer_attn_tp)
        return {
            "prefill_dp_rank": int(bound),
            "target_tp_ranks": list(mapping.target_tp_ranks),
            "registration": Registration(tuple(self.ptrs), self.items[0], self.attn_tp_rank, self.attn_tp),
            "pages": self.pages(rid),
        }

    def write(self, rid: str, dst_addr: np.ndarray, length: np.ndarray, blob: np.ndarray) -> int:
        """Apply one prefill rank's writes to this rank's buffers.

        Raises:
            RuntimeError: a write falls outside the memory this rank registered.
        """
        region = self._region(dst_addr, length, self.ptrs, self.lens)
        if (region < 0).any():
            raise RuntimeError(f"{self.name}: {int((region < 0).sum())} write(s) for {rid} outside its KV buffers")
        raw = [b.view(torch.uint8).reshape(-1) for b in self.buffers]
        data = torch.from_numpy(np.ascontiguousarray(blob))
        at = 0
        for r, d, n in zip(region.tolist(), dst_addr.tolist(), length.tolist()):
            off = d - self.ptrs[r]
            raw[r][off : off + n] = data[at : at + n]
            at += n
        return at

    def retract(self, rid: str) -> None:
        """Retract the request under decode pool pressure: its pages go back and are wiped (the KV must come
        again from prefill, as a PD rebootstrap recomputes it)."""
        held = self.held[rid]
        for b in self.buffers:
            b[held.tokens] = 0
        self.allocator.free(held.tokens)

    def rebootstrap(self, rid: str) -> dict[str, Any]:
        """Bring a retracted request back: new pages, and its receiver bound again through sglang."""
        held = self.held[rid]
        tokens = self.allocator.alloc(len(held.tokens))
        if tokens is None:
            raise MemoryError(f"{self.name}: no room to rebootstrap {rid}")
        held.tokens = tokens
        return self._bootstrap(rid)
