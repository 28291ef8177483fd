"""What the accounting probe (:mod:`.accounting_probe`) reads of a real sglang server's state: the pages a
request holds, the positions an eviction freed, the SWA floor, each pool's free size, and the configuration.

Each reader returns what it read or raises :class:`ProbeReadError` naming the field (never a silent None).
Nothing here changes sglang's state. Split from the probe (which wraps sglang's calls and writes the events)
so that each stays one concern.
"""

from __future__ import annotations

from typing import Any, Callable

from harness.targets.sglang.compat.reqkv import req_kv
from harness.targets.sglang.compat.shims import prefix_swa_in_tree, server_setting

FULL, SWA = "full", "swa"


class ProbeReadError(Exception):
    """The probe could not read a field of sglang's state (named in the message)."""

    def __init__(self, field: str, cause: BaseException | str):
        super().__init__(f"{field} ({cause!r})" if isinstance(cause, BaseException) else f"{field} ({cause})")
        self.field = field


def unreadable(error: ProbeReadError) -> str:
    """The ``note`` of an event a field of which could not be read."""
    from harness.ledger import UNREADABLE

    return f"{UNREADABLE} {error}"


def free_sizes(allocator) -> dict[str, int]:
    if hasattr(allocator, "full_available_size") and hasattr(allocator, "swa_available_size"):
        return {FULL: int(allocator.full_available_size()), SWA: int(allocator.swa_available_size())}
    return {FULL: int(allocator.available_size())}


def pages_of(allocator, full_slots) -> dict[str, set[int]]:
    """Page ids per pool behind ``full_slots`` (slot 0 is sglang's padding slot, never a real page)."""
    page = allocator.page_size
    slots = full_slots.to("cpu").long()
    out = {FULL: {int(p) for p in (slots[slots > 0] // page).unique().tolist()}}
    mapping = getattr(allocator, "full_to_swa_index_mapping", None)
    if mapping is not None:
        swa = mapping[slots.to(mapping.device)].to("cpu").long()
        out[SWA] = {int(p) for p in (swa[swa > 0] // page).unique().tolist()}
    return out


def held(req, allocator, req_to_token_pool) -> dict[str, set[int]]:
    """Pages the request holds now: its ``req_to_token`` row up to its allocated length."""
    kv = req_kv(req)
    idx = getattr(kv, "req_pool_idx", None)
    n = int(getattr(kv, "kv_allocated_len", 0) or 0)
    if idx is None or n <= 0 or req_to_token_pool is None:
        return {}
    return pages_of(allocator, req_to_token_pool.req_to_token[idx, :n])


def swa_page_row(req, allocator, req_to_token_pool) -> Any:
    """The SWA page of each position of the request's row (0: none), or None without a full→SWA mapping."""
    import torch

    kv = req_kv(req)
    idx = getattr(kv, "req_pool_idx", None)
    n = int(getattr(kv, "kv_allocated_len", 0) or 0)
    mapping = getattr(allocator, "full_to_swa_index_mapping", None)
    if mapping is None or idx is None or req_to_token_pool is None:
        return None
    swa = mapping[req_to_token_pool.req_to_token[idx, :n].to(mapping.device).long()].to("cpu").long()
    return torch.where(swa > 0, swa // allocator.page_size, torch.zeros_like(swa))


def freed_spans(before, after, released: list[Any]) -> tuple[tuple[int, int], ...]:
    """Positions that held an SWA page before the call and lost it (mapping cleared) or whose page the
    call handed to the free list (``released``: page-id tensors), as spans."""
    import torch

    from harness.ledger import spans

    if before is None:
        return ()
    lost = torch.zeros_like(before, dtype=torch.bool)
    m = min(len(before), len(after)) if after is not None else 0
    lost[:m] = after[:m] == 0
    if released:
        lost |= torch.isin(before, torch.cat([r.reshape(-1) for r in released]))
    return spans((lost & (before > 0)).nonzero().reshape(-1).tolist())


def evicted_seqlen(req) -> int:
    """The request's SWA floor, as sglang recorded it: ``req.kv.get_evicted_seqlen(SWA)`` since the
    per-component cursors (0.5.21), the ``swa_evicted_seqlen`` field before (on ``req.kv``, which up to
    0.5.18 is read through :func:`~harness.targets.sglang.compat.req_kv`).

    Raises:
        ProbeReadError: the floor cannot be read (never a silent None).
    """
    try:
        kv = req_kv(req)
        if not hasattr(kv, "get_evicted_seqlen"):
            return int(kv.swa_evicted_seqlen)
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: PLC0415

        return int(kv.get_evicted_seqlen(ComponentType.SWA))
    except Exception as e:  # noqa: BLE001 - named in the event, reported by the ledger
        raise ProbeReadError(
            "evicted_seqlen (req.kv.get_evicted_seqlen(SWA) or req.kv.swa_evicted_seqlen)", e
        ) from None


def config_of(queue) -> Any:
    """The :class:`harness.ledger.LedgerConfig` of a decode prealloc queue's server configuration.

    Raises:
        ProbeReadError: a configuration field cannot be read.
    """
    from harness.ledger import LedgerConfig

    def read(field: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - named in the event, reported by the ledger
            raise ProbeReadError(field, e) from None

    allocator = queue.token_to_kv_pool_allocator
    page = int(read("page_size", lambda: allocator.page_size))
    window = read("scheduler.sliding_window_size", lambda: queue.scheduler.sliding_window_size) or None
    radix = bool(
        read(
            "disaggregation_decode_enable_radix_cache",
            lambda: server_setting(queue.scheduler, "disagg", "disaggregation_decode_enable_radix_cache"),
        )
    )
    # The SWA-tail pool is configuration (hybrid-SWA / DeepSeek-V4 pools with pages > 1).
    swa_tail = bool(read("_uses_swa_tail_prealloc", queue._uses_swa_tail_prealloc)) and bool(window)
    interval = int(read("SGLANG_SWA_EVICTION_INTERVAL", eviction_interval))
    reserve = int(read("num_reserved_decode_tokens", lambda: queue.num_reserved_decode_tokens))
    # Admission charges the SWA pool no decode reserve when the radix cache is off (--disable-radix-cache).
    swa_reserve = (
        0
        if read("disable_radix_cache", lambda: bool(server_setting(queue.scheduler, "memory", "disable_radix_cache")))
        else reserve
    )
    host_page = compression = None
    if read("scheduler.enable_hisparse", lambda: bool(getattr(queue.scheduler, "enable_hisparse", False))):
        host_page = int(read("hisparse_page_size", lambda: allocator.hisparse_page_size))
        coordinator = read("scheduler.hisparse_coordinator", lambda: queue.scheduler.hisparse_coordinator)
        compression = int(
            read("hisparse compress_ratio", lambda: coordinator.compress_ratio if coordinator.is_dsv4_hisparse else 1)
        )
    # Before 0.5.19 a radix prefix hit keeps its SWA slots in the tree, the request's floor at its end.
    in_tree = radix and bool(read("capability decode-radix-swa-prefix", prefix_swa_in_tree))
    return LedgerConfig(
        page_size=page,
        window=window,
        radix_cache=radix,
        swa_tail=swa_tail,
        eviction_interval=max(1, interval),
        decode_reserve=reserve,
        swa_decode_reserve=swa_reserve,
        host_page=host_page,
        compression=compression,
        prefix_swa_in_tree=in_tree,
    )


def eviction_interval() -> int:
    from sglang.srt.environ import envs  # noqa: PLC0415

    return envs.SGLANG_SWA_EVICTION_INTERVAL.get()


def as_pages(sets: dict[str, set[int]]) -> dict[str, tuple[int, ...]]:
    return {pool: tuple(sorted(p)) for pool, p in sets.items() if p}


def diff(a: dict[str, set[int]], b: dict[str, set[int]]) -> dict[str, set[int]]:
    return {pool: a.get(pool, set()) - b.get(pool, set()) for pool in a}


# --------------------------------------------------------------------------------------------
# wrappers (each calls the original with the same arguments and returns its result)
# --------------------------------------------------------------------------------------------
