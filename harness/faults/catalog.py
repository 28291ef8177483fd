"""The fault catalog: one :class:`~harness.faults.Fault` entry per deliberate breakage.

Add a fault by appending one entry to ``FAULTS``: a factory that takes the original attribute and
returns the broken one. Factories reach engine helpers through the original function's own
globals (``original.__globals__``) so this module imports nothing from the engine; the adapter
``harness.targets.sglang`` stays the only package importing sglang.
"""

from __future__ import annotations

from typing import Any, Callable

from harness.faults import Fault

_DECODE = "sglang.srt.disaggregation.decode"
_COMMON = "sglang.srt.mem_cache.common"


def _swa_tail_len_without_page_floor(original: Callable[..., int]) -> Callable[..., int]:
    """``DecodePreallocQueue._swa_tail_len`` as before #35286/#35396: the window start is not
    floored to a page, so ``fill_len - swa_tail_len`` can be unaligned."""
    get_disagg = original.__globals__["get_disagg"]

    def _swa_tail_len(self: Any, seq_len: int) -> int:
        if not self._uses_swa_tail_prealloc() or seq_len <= 0:
            return max(seq_len, 0)
        window_size = self.scheduler.sliding_window_size
        if window_size is None or window_size <= 0:
            return seq_len
        page_size = self.token_to_kv_pool_allocator.page_size
        if get_disagg().disaggregation_decode_enable_radix_cache:
            window_start = max(0, seq_len - 1 - max(window_size, page_size))
        else:
            window_start = max(0, seq_len - window_size)
        # The fault: no `window_start = window_start // page_size * page_size` here.
        return seq_len - window_start

    return _swa_tail_len


def _free_kv_row_full_side_only(original: Callable[..., None]) -> Callable[..., None]:
    """``free_kv_row_segments`` that gives every segment back on the full side only, so the
    request's live SWA pages are never returned (and stay mapped)."""

    def free_kv_row_segments(allocator: Any, segments: list, *, swa_evicted_seqlen: int,
                             swa_dead_lo: int = 0) -> None:
        del swa_evicted_seqlen, swa_dead_lo  # the fault ignores which part was SWA-live
        allocator.free_full_segments(segments)

    return free_kv_row_segments


FAULTS: tuple[Fault, ...] = (
    Fault(
        name="swa-tail-unaligned",
        description="_swa_tail_len without the floor of the window start to a page boundary",
        upstream="sglang#35286 / sglang#35396",
        target=f"{_DECODE}:DecodePreallocQueue._swa_tail_len",
        make=_swa_tail_len_without_page_floor,
    ),
    Fault(
        name="release-leaks-swa",
        description="release frees a request's KV row on the full side only, leaking its SWA pages",
        upstream="sglang#27789 / sglang#36081 (SWA pool page leaks)",
        target=f"{_COMMON}:free_kv_row_segments",
        make=_free_kv_row_full_side_only,
    ),
)

from harness.faults.upstream import FAULTS as _UPSTREAM_FAULTS  # noqa: E402  (needs Fault defined first)

FAULTS = FAULTS + _UPSTREAM_FAULTS
from harness.faults.pd import FAULTS as _PD_FAULTS  # noqa: E402
FAULTS = FAULTS + _PD_FAULTS
