"""Shim: a request's KV state (its request slot, committed / allocated lengths, SWA cursor), which
moved into ``Req.kv`` over three releases.

:func:`req_kv` returns 0.5.19's ``req.kv`` as it is, and for older releases a :class:`LegacyReqKv` view with
0.5.19's names over the request's own fields, so the adapter is written once. Nothing is computed here.
Remove with 0.5.18. The three shapes: docs/modules.md.
"""

from __future__ import annotations

from typing import Any


class LegacyReqKv:
    """0.5.19's ``ReqKvInfo`` names over a 0.5.15 … 0.5.18 request's own fields.

    Args:
        req: the sglang ``Req``.
    """

    def __init__(self, req: Any):
        self._req = req

    def _info(self, create: bool) -> Any:
        # 0.5.16 … 0.5.18: the optional ReqKvInfo, created (as alloc_for_decode_prealloc does) on first write.
        req = self._req
        if req.kv is None and create:
            from sglang.srt.managers.schedule_batch import ReqKvInfo

            req.kv = ReqKvInfo(kv_allocated_len=0, swa_evicted_seqlen=0)
        return req.kv

    @property
    def _flat(self) -> bool:
        return "kv" not in vars(self._req)  # 0.5.15

    def _get(self, name: str) -> int:
        if self._flat:
            return int(getattr(self._req, name, 0) or 0)
        info = self._info(create=False)
        return 0 if info is None else int(getattr(info, name) or 0)

    def _set(self, name: str, value: int) -> None:
        setattr(self._req if self._flat else self._info(create=True), name, value)

    @property
    def req_pool_idx(self) -> int | None:
        """The request's ``req_to_token`` row (``req.req_pool_idx``)."""
        return self._req.req_pool_idx

    @property
    def kv_committed_len(self) -> int:
        """``req.kv_committed_len``."""
        return int(self._req.kv_committed_len or 0)

    @kv_committed_len.setter
    def kv_committed_len(self, value: int) -> None:
        self._req.kv_committed_len = value

    @property
    def cache_protected_len(self) -> int:
        """``req.cache_protected_len``."""
        return int(getattr(self._req, "cache_protected_len", 0) or 0)

    @cache_protected_len.setter
    def cache_protected_len(self, value: int) -> None:
        self._req.cache_protected_len = value

    @property
    def kv_allocated_len(self) -> int:
        """``req.kv.kv_allocated_len`` (0.5.16 … 0.5.18; 0 while ``req.kv`` is None),
        ``req.kv_allocated_len`` (0.5.15)."""
        return self._get("kv_allocated_len")

    @kv_allocated_len.setter
    def kv_allocated_len(self, value: int) -> None:
        self._set("kv_allocated_len", value)

    @property
    def swa_evicted_seqlen(self) -> int:
        """The SWA eviction cursor, where :attr:`kv_allocated_len` is."""
        return self._get("swa_evicted_seqlen")

    @property
    def holds_kv(self) -> bool:
        """Whether the request holds a slot (0.5.19's ``holds_kv``: ``req_pool_idx is not None``)."""
        return self._req.req_pool_idx is not None

    def mark_kv_released(self) -> None:
        """What ``release_kv_cache`` leaves: ``req.kv = None`` (0.5.16 … 0.5.18), zero lengths (0.5.15)."""
        if self._flat:
            self._req.kv_allocated_len = 0
            self._req.swa_evicted_seqlen = 0
        else:
            self._req.kv = None


def req_kv(req: Any) -> Any:
    """The request's KV state with 0.5.19's ``ReqKvInfo`` names: ``req.kv`` where it owns the slot
    (0.5.19 on), else a :class:`LegacyReqKv` view of the request's own fields.

    Args:
        req: the sglang ``Req``.

    Returns:
        ``req.kv`` or a :class:`LegacyReqKv`.
    """
    kv = vars(req).get("kv")
    if kv is not None and hasattr(kv, "req_pool_idx"):
        return kv
    return LegacyReqKv(req)
