"""Pool snapshots: what the decode-side pools hold at one instant, as plain immutable values.

A snapshot is read-only (it never changes sglang state) and made of ints and tuples, so tests can
compare two of them, diff them to find leaked pages, or write them into the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReqState:
    """One live request's decode-side KV as sglang records it.

    Attributes:
        rid: request id.
        req_pool_idx: its request slot (row of ``req_to_token``), None once released.
        kv_committed_len: tokens whose KV prefill committed (the prealloc fill length).
        kv_allocated_len: tokens allocated in the full pool.
        swa_evicted_seqlen: leading tokens with no SWA KV (``req.kv`` SWA eviction cursor).
        full_indices: full-pool token slots of tokens ``0..kv_allocated_len-1`` (``req_to_token``).
        swa_indices: the full->SWA mapping of ``full_indices`` (0 = no SWA slot).
        host_indices: hisparse host slots of the request (empty off the hisparse path).
    """

    rid: str
    req_pool_idx: int | None
    kv_committed_len: int
    kv_allocated_len: int
    swa_evicted_seqlen: int
    full_indices: tuple[int, ...]
    swa_indices: tuple[int, ...]
    host_indices: tuple[int, ...] = ()


@dataclass(frozen=True)
class PoolSnapshot:
    """Free sizes of every decode-side pool (token slots; request slots for ``req_slots``) plus the
    state of the requests asked about.

    ``hisparse_device`` and ``host`` are None off the hisparse path. ``tree_full_evictable`` and
    ``tree_swa_evictable`` are what the radix cache holds evictable (0 with the cache off), ``tree_locked``
    the tokens it holds under a lock reference (:meth:`resources`).
    """

    full: int
    swa: int
    req_slots: int
    hisparse_device: int | None = None
    host: int | None = None
    tree_full_evictable: int = 0
    tree_swa_evictable: int = 0
    requests: tuple[ReqState, ...] = ()
    tree_locked: int = 0

    def free(self) -> dict[str, int]:
        """Free slots per pool name (pools absent on this path left out), for ledgers and diffs.

        Returns:
            Pool name -> free slots.
        """
        pools = {
            "full": self.full,
            "swa": self.swa,
            "req_slots": self.req_slots,
            "hisparse_device": self.hisparse_device,
            "host": self.host,
        }
        return {name: value for name, value in pools.items() if value is not None}

    def resources(self) -> dict[str, int]:
        """The resources besides KV pages this side holds, by ledger name
        (:data:`harness.ledger.resources.RESOURCES`): free request rows, tokens under a tree lock.

        Returns:
            Resource name -> value (its baseline: the built side's, :attr:`DecodeSide.baseline`).
        """
        return {"req_slots": self.req_slots, "tree_locked": self.tree_locked}

    def taken_since(self, before: PoolSnapshot) -> dict[str, int]:
        """Slots taken (positive) or returned (negative) per pool between ``before`` and this one.

        Args:
            before: the earlier snapshot.

        Returns:
            Pool name -> ``before.free - self.free``, only the pools that changed.
        """
        now, then = self.free(), before.free()
        return {name: then[name] - now[name] for name in now if then.get(name) != now[name]}

    def request(self, rid: str) -> ReqState:
        """The state of one request in this snapshot.

        Args:
            rid: request id.

        Returns:
            Its :class:`ReqState`.

        Raises:
            KeyError: the snapshot holds no such request.
        """
        for state in self.requests:
            if state.rid == rid:
                return state
        raise KeyError(rid)


def req_state(req: Any, req_to_token_pool: Any, allocator: Any, coordinator: Any | None) -> ReqState:
    """Read one request's KV state from sglang objects (no state changes).

    Args:
        req: the sglang ``Req``.
        req_to_token_pool: its ``ReqToTokenPool``.
        allocator: the token allocator (has ``full_to_swa_index_mapping``).
        coordinator: the ``HiSparseCoordinator`` or None.

    Returns:
        The :class:`ReqState`.
    """
    from harness.targets.sglang import compat

    kv = compat.req_kv(req)
    idx = kv.req_pool_idx
    allocated = int(kv.kv_allocated_len or 0)
    full: tuple[int, ...] = ()
    swa: tuple[int, ...] = ()
    host: tuple[int, ...] = ()
    if idx is not None and allocated > 0:
        row = req_to_token_pool.req_to_token[idx, :allocated].to("cpu", dtype=_int64())
        full = tuple(row.tolist())
        mapping = allocator.full_to_swa_index_mapping
        swa = tuple(mapping[row.to(mapping.device)].cpu().tolist())
    if coordinator is not None and idx is not None:
        n_host = int(coordinator.req_to_host_pool_allocated_len[idx])
        if n_host > 0:
            host = tuple(coordinator.req_to_host_pool[idx, :n_host].cpu().tolist())
    return ReqState(
        rid=req.rid,
        req_pool_idx=None if idx is None else int(idx),
        kv_committed_len=int(kv.kv_committed_len or 0),
        kv_allocated_len=allocated,
        swa_evicted_seqlen=compat.evicted_seqlen(kv),
        full_indices=full,
        swa_indices=swa,
        host_indices=host,
    )


def _int64() -> Any:
    import torch

    return torch.int64
