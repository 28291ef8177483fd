"""Where each per-request resource of the PD path lives in sglang, one reader per capability (the names of
:data:`harness.ledger.resources.RESOURCES`). A reader returns ``(value, baseline)`` read from sglang's
objects, or raises :class:`Lacking` with one line naming what this release does not have.

Read against the source of 0.5.22 and 0.5.23, where every field below is (``disaggregation/utils.py``,
``disaggregation/common/conn.py``, ``mem_cache/memory_pool_host.py``). A release that moves one makes
the probe say so in one line, never fail.
"""

from __future__ import annotations

from typing import Any


class Lacking(Exception):
    """This sglang has no such resource where the reader looks (the message: one line, what is missing)."""


def _field(obj: Any, name: str, what: str) -> Any:
    value = getattr(obj, name, None)
    if value is None:
        raise Lacking(f"{what}: no {type(obj).__name__}.{name}")
    return value


def request_rows(req_to_token_pool: Any) -> tuple[int, int]:
    """Free request rows of ``ReqToTokenPool`` and its capacity (``size``: rows 1..size, row 0 is padding)."""
    return int(req_to_token_pool.available_size()), int(_field(req_to_token_pool, "size", "request rows"))


def metadata_slots(allocator: Any) -> tuple[int, int]:
    """Free slots of a ``ReqToMetadataIdxAllocator`` (the metadata buffers' index pool) and its ``size``."""
    return int(allocator.available_size()), int(_field(allocator, "size", "metadata-buffer slots"))


def metadata_allocator(scheduler: Any) -> Any:
    """The scheduler's ``ReqToMetadataIdxAllocator`` (PD prefill and decode only)."""
    return _field(scheduler, "req_to_metadata_buffer_idx_allocator", "metadata-buffer slots")


def tree_locked(tree_cache: Any) -> tuple[int, int]:
    """Tokens the tree cache holds under a lock reference (``protected_size()``, plus the SWA component's
    ``swa_protected_size()`` where the tree has one); baseline 0."""
    if not hasattr(tree_cache, "protected_size"):
        raise Lacking(f"radix-tree lock references: no {type(tree_cache).__name__}.protected_size")
    swa = getattr(tree_cache, "swa_protected_size", None)
    return int(tree_cache.protected_size()) + (int(swa()) if swa is not None else 0), 0


def kv_manager(scheduler: Any) -> Any:
    """The KV manager of a PD scheduler: decode's prealloc queue's, else prefill's bootstrap queue's."""
    for queue in ("disagg_decode_prealloc_queue", "disagg_prefill_bootstrap_queue"):
        manager = getattr(getattr(scheduler, queue, None), "kv_manager", None)
        if manager is not None:
            return manager
    raise Lacking("KV manager per-room state: no disagg_*_queue.kv_manager on the scheduler")


def kv_rooms(manager: Any, component: str, apart: frozenset[int] = frozenset()) -> dict[str, tuple[int, int]]:
    """The KV manager's per-room state as room counts (baseline 0): ``kv_request_status`` (both sides),
    ``kv_transfer_infos`` (prefill: decode's destinations per room) and ``kv_bootstrap_rooms`` (decode:
    the rooms it tracks per prefill address, awaits responses from or counts responses of). Rooms in
    ``apart`` (a known upstream race left them: ``harness/engines/server/races.py``) are not counted.

    ``list()`` and ``set.union`` of sglang's dicts run without releasing the GIL, so a bootstrap thread
    writing them meanwhile cannot break the read.
    """

    def count(rooms: Any) -> int:
        return sum(1 for room in list(rooms) if room not in apart)

    out = {"kv_request_status": (count(_field(manager, "request_status", "KV manager room status")), 0)}
    if component == "prefill":
        out["kv_transfer_infos"] = (count(_field(manager, "transfer_infos", "KV manager transfer infos")), 0)
    else:
        tracker = _field(manager, "addr_to_rooms_tracker", "KV manager bootstrap rooms")
        rooms: set[int] = set().union(*list(tracker.values()))
        for table in ("prefill_response_tracker", "required_prefill_response_num_table"):
            rooms |= set(list(getattr(manager, table, None) or ()))
        out["kv_bootstrap_rooms"] = (len(rooms), 0)
    return out


def room_keys(manager: Any) -> set[int]:
    """The rooms prefill's KV manager keeps state for (``request_status`` or ``transfer_infos``)."""
    status = _field(manager, "request_status", "KV manager room status")
    return set(list(status)) | set(list(getattr(manager, "transfer_infos", None) or ()))


def host_slots(coordinator: Any) -> tuple[int, int]:
    """Free slots of the hisparse host pool (``HiSparseCoordinator.mem_pool_host``) and its ``size``."""
    pool = _field(coordinator, "mem_pool_host", "hisparse host pages")
    return int(pool.available_size()), int(_field(pool, "size", "hisparse host pages"))
