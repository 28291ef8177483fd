"""Faults of the PD end-to-end path: a decode step that keeps out-of-window SWA pages, and a
prefill that ships one corrupted KV page. Registered in :mod:`harness.faults.catalog`."""

from __future__ import annotations

from typing import Any, Callable

from harness.faults import Fault


def _no_swa_window_eviction(original: Callable[..., None]) -> Callable[..., None]:
    """``free_swa_out_of_window_slots`` that frees nothing: decode steps keep every SWA page."""

    def free_swa_out_of_window_slots(req: Any, pre_len: int, **kwargs: Any) -> None:
        del req, pre_len, kwargs  # the fault: the window slides but nothing is freed

    return free_swa_out_of_window_slots


def _corrupt_first_page(original: Callable[..., Any]) -> Callable[..., Any]:
    """``pack_pages`` that flips one byte of the first page it ever packs (one corrupted page)."""
    state = {"done": False}

    def pack_pages(views: list, page_ids: list) -> Any:
        arrays = original(views, page_ids)
        if not state["done"] and arrays and arrays[0].size:
            state["done"] = True
            arrays[0] = arrays[0].copy()  # the shipped copy only: the prefill's own page stays intact
            arrays[0].reshape(-1)[0] ^= 0xFF
        return arrays

    return pack_pages


FAULTS: tuple[Fault, ...] = (
    Fault(
        name="decode-skips-swa-evict",
        description="decode steps never free SWA pages that slid out of the window",
        upstream="sglang#27789 class (SWA pool growth during decode)",
        target="sglang.srt.mem_cache.common:free_swa_out_of_window_slots",
        make=_no_swa_window_eviction,
    ),
    Fault(
        name="corrupt-kv-page",
        description="the prefill ships one KV page with a flipped byte",
        upstream="transfer-engine corruption class (e.g. mooncake partial writes)",
        target="harness.pd.kvfill:pack_pages",
        make=_corrupt_first_page,
    ),
)
