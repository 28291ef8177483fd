"""KV digests on a real server: what prefill sends, where its transfer engine writes it, and what decode commits.

Installed beside the accounting probe (same ledger, same ``seq``): a blake2b digest per (room, buffer, page) of
the pages prefill's sender is handed (``kv_sent``), the decode pages mooncake wrote (``kv_landed``), decode's
destination pages (``kv_dest``) and their bytes at the commit (``kv_commit``), read from each side's registered
KV buffers (the bytes the transfer engine moves). ``HARNESS_KV_CANARY=1`` fills each page decode frees with a
canary, so a write after the free shows. The rules: :mod:`harness.ledger.content`; hooks and costs: docs/modules.md.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from harness.ledger.content import digest_rows
from harness.engines.server import kv_heads
from harness.engines.server.hooks import after_import
from harness.engines.server.probe_read import ProbeReadError, unreadable

log = logging.getLogger(__name__)

#: ``0`` turns the digests off (they are on wherever the probe is).
DIGEST_ENV = "HARNESS_KV_DIGEST"
#: ``1``: decode fills every page it frees with :data:`CANARY_BYTE` (a debug mode: it writes freed memory).
CANARY_ENV = "HARNESS_KV_CANARY"
CANARY_BYTE = 0xA5


def _candidates(pool: Any, depth: int = 0) -> list[Any]:
    """The tensors of a KV pool the transfer may register: its own list when it has one, else its
    per-layer buffers, through nested pools (an SWA pool's full and SWA pools)."""
    import torch

    out: list[Any] = []
    getter = getattr(pool, "_pd_registerable_tensors", None)
    if callable(getter):
        try:
            out.extend(getter())
        except Exception:  # noqa: BLE001 - the per-layer buffers below are the fallback
            pass
    for name in ("k_buffer", "v_buffer", "kv_buffer"):
        value = getattr(pool, name, None)
        out.extend(value if isinstance(value, (list, tuple)) else [value])
    if depth < 2:
        for name in ("full_kv_pool", "swa_kv_pool"):
            sub = getattr(pool, name, None)
            if sub is not None:
                out.extend(_candidates(sub, depth + 1))
    return [t for t in out if isinstance(t, torch.Tensor)]


def page_views(pool: Any, ptrs: list[int], item_lens: list[int]) -> list[Any]:
    """``[pages, item_len]`` uint8 views of the buffers at ``ptrs`` (the transfer's registered buffers),
    page ``p`` of buffer ``i`` at byte ``p * item_lens[i]`` as the transfer engine addresses it.

    Raises:
        ProbeReadError: a buffer is not one of the pool's tensors, or not contiguous.
    """
    import torch

    by_ptr = {int(t.data_ptr()): t for t in _candidates(pool)}
    views = []
    for i, (ptr, item) in enumerate(zip(ptrs, item_lens)):
        t = by_ptr.get(int(ptr))
        if t is None or not t.is_contiguous():
            raise ProbeReadError(f"kv buffer {i} (ptr {ptr:#x})", "not a contiguous tensor of the KV pool")
        u8 = t.reshape(-1).view(torch.uint8)
        n = u8.numel() // int(item)
        views.append(u8[: n * int(item)].view(n, int(item)))
    return views


def digest_pages(views: list[Any], pages: list[int]) -> list[list[int]]:
    """Per buffer, the digest of each page (in the order given): a page read as one head slot of one row."""
    return [slots[0] for slots in kv_heads.slot_digests(views, pages, 1, 1)]


def _pages(indices: Any) -> list[int]:
    if hasattr(indices, "detach"):
        indices = indices.detach().cpu().numpy()
    return [int(p) for p in indices]


@dataclass
class _Side:
    """One server's digest state: its buffers (read once), the canary's pages and digests."""

    views: list[Any] | None = None
    key: tuple = ()
    allocator: Any = None  # decode: the allocator whose freed pages get the canary
    canary: bool = False
    canaried: set[int] = field(default_factory=set)
    expect: list[int] = field(default_factory=list)  # the canary's digest per buffer
    dests: dict[int, tuple[str, list[int]]] = field(default_factory=dict)  # room -> (rid, decode pages)
    failed: bool = False
    local: threading.local = field(default_factory=threading.local)
    heads: kv_heads.HeadsRecorder | None = None  # unequal TP: every rank's per-head digests (:mod:`.kv_heads`)
    rank: tuple[Any, Any, Any] | None = None  # decode with ``heads``: (kv_args, attn TP, head slots), read once

    def read(self, probe: Any, pool: Any, kv_args: Any, rid: str, page_size: int) -> list[Any] | None:
        """The buffer views (cached by pointers); None after a read that failed (written once, as
        ``probe-unreadable``)."""
        key = (id(pool), tuple(kv_args.kv_data_ptrs))
        if self.views is not None and key == self.key:
            return self.views
        if self.failed:
            return None
        try:
            self.views = page_views(pool, list(kv_args.kv_data_ptrs), list(kv_args.kv_item_lens))
        except ProbeReadError as e:
            self.failed = True
            probe.record("kv_commit" if probe.component == "decode" else "kv_sent", rid, page_size, note=unreadable(e))
            return None
        self.key = key
        self.expect = digest_rows([bytes([CANARY_BYTE]) * int(v.shape[1]) for v in self.views])
        return self.views


def _wrap_send_chunk(side: _Side, orig: Callable) -> Callable:
    """Prefill's ``_send_kv_chunk``: the scheduler and request a sender's ``send`` below belongs to."""

    @functools.wraps(orig)
    def wrapper(self, req, *args, **kwargs):
        side.local.scheduler, side.local.req = self, req
        try:
            return orig(self, req, *args, **kwargs)
        finally:
            side.local.req = None

    return wrapper


def _wrap_sender_send(probe: Any, side: _Side, orig: Callable) -> Callable:
    """``CommonKVSender.send``: the digests of the pages handed to the transfer, at the moment it is issued."""

    @functools.wraps(orig)
    def wrapper(self, kv_indices, *args, **kwargs):
        scheduler = getattr(side.local, "scheduler", None)
        if scheduler is not None and getattr(self, "conclude_state", None) is None:
            pages = _pages(kv_indices)
            req = getattr(side.local, "req", None)
            rid = str(getattr(req, "rid", self.bootstrap_room))
            allocator = scheduler.token_to_kv_pool_allocator
            views = side.read(probe, allocator.get_kvcache(), self.kv_mgr.kv_args, rid, allocator.page_size)
            if pages and views is not None:
                content = {"room": int(self.bootstrap_room), "at": int(self.curr_idx), "src": pages}
                probe.record(
                    "kv_sent", rid, allocator.page_size, content={**content, "digests": digest_pages(views, pages)}
                )
                if side.heads is not None:
                    side.heads.record(
                        "prefill",
                        room=int(self.bootstrap_room),
                        kv_args=self.kv_mgr.kv_args,
                        tp=getattr(self.kv_mgr, "attn_tp_size", None),
                        views=views,
                        pages=pages,
                        slots=getattr(allocator.get_kvcache(), "head_num", None),
                        page_size=int(allocator.page_size),
                        at=int(self.curr_idx),
                    )
        return orig(self, kv_indices, *args, **kwargs)

    return wrapper


def _wrap_send_kvcache(probe: Any, orig: Callable) -> Callable:
    """``MooncakeKVManager.send_kvcache``: the decode pages one chunk's write went to, once it returned."""

    @functools.wraps(orig)
    def wrapper(self, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, *args, **kwargs):
        import time

        t0 = time.time()
        ret = orig(self, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, *args, **kwargs)
        if ret == 0:
            # The room is the transfer worker's chunk (a local of the caller: the call does not pass it).
            chunk = sys._getframe(1).f_locals.get("kv_chunk")
            room, at = getattr(chunk, "room", None), getattr(getattr(chunk, "index_slice", None), "start", None)
            src, dst = _pages(prefill_kv_indices), _pages(dst_kv_indices)
            page = int(getattr(self.kv_args, "page_size", 0) or 0)
            if room is None:
                probe.record("kv_landed", "?", page, note=unreadable(ProbeReadError("kv_chunk.room", "no chunk")))
            else:
                content = {"room": int(room), "at": int(at or 0), "src": src, "dst": dst[: len(src)], "t0": t0}
                probe.record("kv_landed", str(room), page, content=content)
        return ret

    return wrapper


def _fake(req: Any) -> bool:
    from sglang.srt.disaggregation.utils import _is_fake_transfer  # noqa: PLC0415

    return bool(_is_fake_transfer(req))


def _wrap_send_metadata(probe: Any, side: _Side, orig: Callable) -> Callable:
    """``DecodePreallocQueue._send_kv_metadata``: the room's destination pages, before prefill may write them
    (with the canary on: the digests of those that were freed with it)."""

    @functools.wraps(orig)
    def wrapper(self, decode_req, kv_indices, page_size, *args, **kwargs):
        req = decode_req.req
        host = str(kwargs.get("destination", "")).lower().endswith("host")
        if not host and not _fake(req):
            dst = _pages(self._transfer_page_indices(decode_req, kv_indices, page_size))
            rid, room = str(req.rid), int(req.bootstrap_room)
            side.allocator = self.token_to_kv_pool_allocator
            views = side.read(probe, self.token_to_kv_pool, self.kv_manager.kv_args, rid, page_size)
            content: dict[str, Any] = {"room": room, "dst": dst}
            if views is not None and side.canary:
                freed = [p for p in dst if p in side.canaried]
                content["canary"] = {"pages": freed, "digests": digest_pages(views, freed), "expect": side.expect}
                side.canaried.difference_update(dst)
            side.dests[room] = (rid, dst)
            if side.heads is not None and side.rank is None:
                side.rank = (
                    self.kv_manager.kv_args,
                    getattr(self.kv_manager, "attn_tp_size", None),
                    getattr(self.token_to_kv_pool, "head_num", None),
                )
            probe.record("kv_dest", rid, page_size, content=content)
        return orig(self, decode_req, kv_indices, page_size, *args, **kwargs)

    return wrapper


def _wrap_commit(probe: Any, side: _Side, orig: Callable) -> Callable:
    """``DecodeTransferQueue._commit_transfer_to_req``: the bytes of the room's pages as decode commits them."""

    @functools.wraps(orig)
    def wrapper(self, decode_req, *args, **kwargs):
        room = getattr(decode_req.req, "bootstrap_room", None)
        rid, dst = side.dests.pop(int(room), (None, None)) if room is not None else (None, None)
        if dst is not None and side.views is not None:
            page = int(self.scheduler.token_to_kv_pool_allocator.page_size)
            content: dict[str, Any] = {"room": int(room), "dst": dst, "digests": digest_pages(side.views, dst)}
            if side.canary:
                content["canary"] = side.expect
            probe.record("kv_commit", str(rid), page, content=content)
            if side.heads is not None and side.rank is not None:
                kv_args, tp, slots = side.rank
                side.heads.record(
                    "decode",
                    room=int(room),
                    kv_args=kv_args,
                    tp=tp,
                    views=side.views,
                    pages=dst,
                    slots=slots,
                    page_size=page,
                )
        return orig(self, decode_req, *args, **kwargs)

    return wrapper


def _wrap_release_pages(side: _Side, orig: Callable) -> Callable:
    """``PagedTokenToKVPoolAllocator._release_page_ids`` (canary mode): the freed pages of decode's allocator
    are filled with the canary before they go back to the free list."""

    @functools.wraps(orig)
    def wrapper(self, *page_ids, **kwargs):
        if self is side.allocator and side.views is not None:
            for ids in page_ids:
                pages = ids.detach().to("cpu").long()
                for v in side.views:
                    v[pages.to(v.device)] = CANARY_BYTE
                side.canaried.update(pages.tolist())
        return orig(self, *page_ids, **kwargs)

    return wrapper


def install(probe: Any, *, canary: bool = False) -> _Side:
    """Hook the digests into the server the accounting probe ``probe`` watches (its component picks the side).

    Returns:
        The side's state (tests read it).
    """
    side = _Side(canary=canary and probe.component == "decode", heads=kv_heads.from_env(probe.worker))
    if probe.component not in ("prefill", "decode"):
        return side  # a plain server moves no KV
    if probe.component == "prefill":

        def on_prefill(mod: ModuleType) -> None:
            mixin = mod.SchedulerDisaggregationPrefillMixin
            # The chunk send: ``_send_kv_chunk`` behind a checksum step from 0.5.21, ``send_kv_chunk`` itself before.
            name = "_send_kv_chunk" if hasattr(mixin, "_send_kv_chunk") else "send_kv_chunk"
            setattr(mixin, name, _wrap_send_chunk(side, getattr(mixin, name)))

        def on_common(mod: ModuleType) -> None:
            mod.CommonKVSender.send = _wrap_sender_send(probe, side, mod.CommonKVSender.send)

        def on_mooncake(mod: ModuleType) -> None:
            manager = mod.MooncakeKVManager
            manager.send_kvcache = _wrap_send_kvcache(probe, manager.send_kvcache)

        after_import("sglang.srt.disaggregation.prefill", on_prefill)
        after_import("sglang.srt.disaggregation.common.conn", on_common)
        after_import("sglang.srt.disaggregation.mooncake.conn", on_mooncake)
    else:

        def on_decode(mod: ModuleType) -> None:
            if hasattr(mod.DecodePreallocQueue, "_send_kv_metadata"):  # inline in pop_preallocated in 0.5.18:
                # there decode names no destination pages (kv_dest), and the rules judge what they have
                mod.DecodePreallocQueue._send_kv_metadata = _wrap_send_metadata(
                    probe, side, mod.DecodePreallocQueue._send_kv_metadata
                )
            queue = mod.DecodeTransferQueue
            queue._commit_transfer_to_req = _wrap_commit(probe, side, queue._commit_transfer_to_req)

        after_import("sglang.srt.disaggregation.decode", on_decode)
        if side.canary:

            def on_paged(mod: ModuleType) -> None:
                cls = mod.PagedTokenToKVPoolAllocator
                cls._release_page_ids = _wrap_release_pages(side, cls._release_page_ids)

            after_import("sglang.srt.mem_cache.allocator.paged", on_paged)
    log.info("kv digests on in pid %d (%s, canary %s)", os.getpid(), probe.component, side.canary)
    return side


def install_from_env(probe: Any, environ: dict | None = None) -> _Side | None:
    """Install in a server whose accounting probe is ``probe`` unless ``HARNESS_KV_DIGEST=0``."""
    env = os.environ if environ is None else environ
    if probe is None or env.get(DIGEST_ENV, "1").strip() == "0":
        return None
    return install(probe, canary=env.get(CANARY_ENV, "").strip() == "1")
