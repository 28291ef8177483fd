"""Shims: the few sglang calls whose shape changed between the supported releases, each a few lines
that say why it exists (the release or PR that changed it) and when it can go.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from harness.targets.sglang.compat.capabilities import missing


def dsv4_pool_kwargs(pool_class: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``DeepSeekV4TokenToKVPool`` arguments the target's constructor takes: ``full_size`` (the
    hisparse pool's full logical size) arrived in 0.5.21; before it the pool sized itself from
    ``c4_size``. Remove with 0.5.20.

    Args:
        pool_class: ``DeepSeekV4TokenToKVPool``.
        kwargs: the 0.5.23 arguments.

    Returns:
        ``kwargs`` without the ones the constructor does not take.
    """
    accepted = inspect.signature(pool_class.__init__).parameters
    return {k: v for k, v in kwargs.items() if k in accepted}


def decode_prealloc_kwargs(prealloc: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``alloc_for_decode_prealloc`` arguments the target's function takes: ``req_to_token_pool``
    (which the DeepSeek-V4 prealloc hooks write through) arrived in 0.5.17; 0.5.16 takes none.
    Remove with 0.5.16.

    Args:
        prealloc: ``alloc_for_decode_prealloc``.
        kwargs: the 0.5.23 arguments.

    Returns:
        ``kwargs`` without the ones the function does not take.
    """
    accepted = inspect.signature(prealloc).parameters
    return {k: v for k, v in kwargs.items() if k in accepted}


def component_type() -> Any:
    """sglang's ``ComponentType`` (the radix tree's FULL / SWA components): in
    ``mem_cache.unified_cache.components`` since 0.5.17, ``mem_cache.unified_cache_components`` in
    0.5.16. Remove with 0.5.16.

    Returns:
        The enum.
    """
    try:
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
    except ModuleNotFoundError:  # 0.5.16
        from sglang.srt.mem_cache.unified_cache_components import ComponentType
    return ComponentType


def commits_after_alloc(prepare_for_decode_source: str) -> bool:
    """Whether ``ScheduleBatch.prepare_for_decode``'s source commits the new token itself after
    ``alloc_for_decode`` (``req.kv_committed_len += 1``: up to 0.5.18)."""
    return "req.kv_committed_len += 1" in prepare_for_decode_source


def commit_decode_tokens(reqs: Any, token_per_req: int) -> None:
    """What ``ScheduleBatch.prepare_for_decode`` does to each request right after ``alloc_for_decode``
    in the target's release: ``decode_batch_idx += 1`` always, and up to 0.5.18 also
    ``kv_committed_len += 1`` (from 0.5.19 ``alloc_for_decode`` commits the new tokens itself). Read
    from the release's own ``prepare_for_decode``. Remove the commit with 0.5.18.

    Args:
        reqs: the batch's requests.
        token_per_req: tokens ``alloc_for_decode`` allocated per request.
    """
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    commits = _commits_after_alloc(ScheduleBatch.prepare_for_decode)
    for req in reqs:
        req.decode_batch_idx += 1
        if commits:
            req.kv_committed_len += token_per_req


@functools.lru_cache(maxsize=8)
def _commits_after_alloc(prepare_for_decode: Any) -> bool:
    # Read once per function object (a patched copy's is another object): the source read costs a
    # decode step more than the step itself.
    return commits_after_alloc(inspect.getsource(prepare_for_decode))


def release_kv_cache(req: Any, tree_cache: Any, *, checkpoint: bool) -> None:
    """``mem_cache.common.release_kv_cache``: its insert flag is ``checkpoint`` (keyword-only) since
    0.5.22, ``is_insert`` before. Remove with 0.5.21.

    Args:
        req: the request.
        tree_cache: its tree cache.
        checkpoint: keep what the tree can key (a finished request) or not (aborted, transferred).
    """
    from sglang.srt.mem_cache import common

    params = inspect.signature(common.release_kv_cache).parameters
    flag = "checkpoint" if "checkpoint" in params else "is_insert"
    common.release_kv_cache(req, tree_cache, **{flag: checkpoint})


def decode_prefix_match(queue: Any, req: Any) -> tuple[Any, int, int]:
    """What ``pop_preallocated`` does with the decode radix cache on, between the prefix match and
    ``_pre_alloc``, in the target's release.

    * Match and lock (``_match_prefix_and_lock``). Since 0.5.22 it caps the match at the SWA window
      start itself (``max_prefix_len``: "the entire SWA tail must be freshly allocated"); up to 0.5.21
      the *caller* capped ``prefix_len`` (and ``total_prefix_len``) at ``fill - _swa_tail_len(fill)``.
      Without the cap a prefix hit inside the tail trips ``alloc_extend_swa_tail``'s
      ``swa_tail_len <= extend_num_tokens`` assertion. Remove the caller cap with 0.5.21.
    * Keep only the full-attention lock of the prefix: ``tree_cache.release_swa(req.lock)`` since 0.5.22,
      ``dec_swa_lock_only(req.last_node, receipt)`` before (receipt ``req.lock_receipt`` in 0.5.21,
      ``req.swa_uuid_for_lock`` in 0.5.19 / 0.5.20), each only where the tree has it, as the release checks.
    * Before 0.5.19 (capability ``decode-radix-swa-prefix`` missing) ``pop_preallocated`` did neither:
      the match is passed on as it is, with its SWA lock, and ``_pre_alloc`` itself leaves the SWA-tail
      path for a request with a prefix hit (``uses_swa_tail and prefix_len == 0``). Remove with 0.5.18.

    Args:
        queue: the ``DecodePreallocQueue``.
        req: the request.

    Returns:
        ``(prefix_indices, prefix_len, total_prefix_len)`` for ``_pre_alloc``.
    """
    match = queue._match_prefix_and_lock(req)
    prefix_indices, prefix_len, total_prefix_len = match.prefix_indices, match.l1_prefix_len, match.decode_prefix_len
    if missing("decode-radix-swa-prefix"):
        return prefix_indices, prefix_len, total_prefix_len
    uses_swa_tail = queue._uses_swa_tail_prealloc()
    capped_by_match = "max_prefix_len" in inspect.getsource(type(queue)._match_prefix_and_lock)
    if uses_swa_tail and prefix_len > 0 and not capped_by_match:
        fill_len = queue._pre_alloc_fill_len(req)
        cap = fill_len - queue._swa_tail_len(fill_len)
        if prefix_len > cap:
            prefix_len, total_prefix_len = cap, cap
            prefix_indices = prefix_indices[:cap]
    tree = queue.tree_cache
    if uses_swa_tail and match.l1_prefix_len > 0:
        if hasattr(tree, "release_swa"):
            tree.release_swa(req.lock)
        elif hasattr(tree, "dec_swa_lock_only"):
            receipt = getattr(req, "lock_receipt", None) or getattr(req, "swa_uuid_for_lock", None)
            tree.dec_swa_lock_only(req.last_node, receipt)
            req.swa_prefix_lock_released = True
    return prefix_indices, prefix_len, total_prefix_len


def prefix_swa_in_tree() -> bool:
    """Whether a decode radix prefix hit keeps its SWA slots in the tree while the request decodes, the
    request's SWA floor raised to the prefix end, for the ledger's ``LedgerConfig.prefix_swa_in_tree``.

    Before 0.5.19 (capability ``decode-radix-swa-prefix`` missing) ``pop_preallocated`` keeps the match's
    SWA lock and ``free_swa_out_of_window_slots`` raises ``swa_evicted_seqlen`` to ``cache_protected_len``
    without freeing below it: a floor past the window start there loses no position of the window, the
    tree holds them. From 0.5.19 the prefix is capped at the window start and keeps only its
    full-attention lock (:func:`decode_prefix_match`), so a floor past the window start is a real loss.
    Remove with 0.5.18.
    """
    return missing("decode-radix-swa-prefix") is not None


def caller_swa_reclaim(queue: Any, req: Any) -> str | None:
    """The SWA reclaim ``pop_preallocated`` ran right before ``_pre_alloc`` in 0.5.19 and 0.5.20:
    ``_reclaim_swa_tail_capacity(swa_tail_len, rid)`` evicts radix-cached SWA pages until the tail
    fits. From 0.5.21 ``_pre_alloc`` reclaims itself (sglang#40309, capability
    ``decode-radix-swa-reclaim``), so nothing is done here; before 0.5.19 the queue has no such
    method and nothing reclaimed SWA pages for the tail. Remove with 0.5.20.

    Args:
        queue: the ``DecodePreallocQueue``.
        req: the request about to be preallocated.

    Returns:
        sglang's shortfall message when the reclaim could not free enough (the release then aborted
        the request; ``_pre_alloc`` will fail the same way here), else None.
    """
    if (
        not queue._uses_swa_tail_prealloc()
        or missing("decode-radix-swa-reclaim") is None
        or not hasattr(queue, "_reclaim_swa_tail_capacity")
    ):
        return None
    _, swa_len = queue._prealloc_kv_lens(req)
    return queue._reclaim_swa_tail_capacity(swa_len, req.rid)


def dsv4_compressed_pools(kv_pool: Any) -> dict[int, tuple[Any, Any]]:
    """A ``DeepSeekV4TokenToKVPool``'s compressed KV and indexer pools by compression ratio:
    ``kv_pools`` / ``index_pools`` dicts since 0.5.20; 0.5.19 held them as ``c4_kv_pool``,
    ``c128_kv_pool`` and ``c4_indexer_kv_pool``. Remove with 0.5.19.

    Args:
        kv_pool: the DeepSeek-V4 pool.

    Returns:
        ratio -> ``(kv pool or None, indexer pool or None)``.
    """
    kv = getattr(kv_pool, "kv_pools", None)
    if kv is not None:
        index = getattr(kv_pool, "index_pools", {}) or {}
        return {ratio: (kv[ratio], index.get(ratio)) for ratio in kv}
    return {
        4: (getattr(kv_pool, "c4_kv_pool", None), getattr(kv_pool, "c4_indexer_kv_pool", None)),
        128: (getattr(kv_pool, "c128_kv_pool", None), None),
    }


def index_page_rows(index_pool: Any) -> list[Any]:
    """An indexer pool's buffers as 2-D page rows: ``contiguous_page_row_buffers()`` since 0.5.20; in
    0.5.19 the fused key+scale buffer per layer (``index_k_with_scale_buffer``). Remove with 0.5.19."""
    rows = getattr(index_pool, "contiguous_page_row_buffers", None)
    return list(rows()) if rows is not None else list(index_pool.index_k_with_scale_buffer)


def all_free_pages(page_allocator: Any) -> Any:
    """Every free page id of a paged allocator (free and staged): ``get_all_free_pages()`` since 0.5.20;
    0.5.19 keeps frees routed by ``need_sort`` in ``release_pages``. Remove with 0.5.19.

    Args:
        page_allocator: a ``PagedTokenToKVPoolAllocator``.

    Returns:
        A 1-D tensor of page ids.
    """
    getter = getattr(page_allocator, "get_all_free_pages", None)
    if getter is not None:
        return getter()
    import torch

    return torch.cat((page_allocator.free_pages, page_allocator.release_pages))


def evicted_seqlen(kv: Any) -> int:
    """A request's SWA eviction cursor (``req.kv``): ``get_evicted_seqlen(ComponentType.SWA)`` since
    the per-component cursors (0.5.21), the ``swa_evicted_seqlen`` attribute before. Remove with 0.5.20.

    Args:
        kv: ``req.kv``.

    Returns:
        Leading tokens with no SWA KV.
    """
    getter = getattr(kv, "get_evicted_seqlen", None)
    if getter is not None:
        from sglang.srt.mem_cache.unified_cache.components import ComponentType

        return int(getter(ComponentType.SWA))
    return int(getattr(kv, "swa_evicted_seqlen", 0) or 0)


def server_setting(scheduler: Any, group: str, name: str) -> Any:
    """A running server's setting ``name`` as its release's decode queue reads it.

    From 0.5.17 the runtime context publishes the effective settings per group (``get_disagg()``,
    ``get_memory()``; a PD decode server's ``disable_radix_cache`` is set there, not in the arguments the
    scheduler was given); 0.5.16's runtime context has no per-group getters, and its queue reads
    ``scheduler.server_args``. Remove the fallback with 0.5.16.
    """
    from sglang.srt import runtime_context  # noqa: PLC0415

    getter = getattr(runtime_context, f"get_{group}", None)
    return getattr(getter() if getter is not None else scheduler.server_args, name)


def scheduler_fields(radix_cache: bool) -> dict[str, Any]:
    """Scheduler fields the decode prealloc queue reads that moved between releases.

    Up to 0.5.19 ``DecodePreallocQueue`` read ``--disaggregation-decode-enable-radix-cache`` from
    ``scheduler.server_args`` (and, up to 0.5.18, ``--disable-radix-cache`` there too, for the SWA
    decode reserve of ``_prealloc_required_tokens``); from 0.5.20 it reads the published runtime
    context (``get_disagg()``), which :mod:`runtime` publishes. The runtime context itself is older
    than either: ``runtime_context`` ships from 0.5.15, ``override_server_args`` (what :mod:`runtime`
    publishes through) from 0.5.16 and ``get_disagg()`` from 0.5.17, where one of the queue's reads
    already goes through it. Both are given so every release sees the same setting
    (``disable_radix_cache`` is sglang's default, False, as the ledger's reserve assumes). Remove
    ``server_args`` with 0.5.19.

    Args:
        radix_cache: whether the decode radix cache is on.

    Returns:
        Extra attributes for the scheduler namespace.
    """
    import types

    return {
        "server_args": types.SimpleNamespace(
            disaggregation_decode_enable_radix_cache=radix_cache,
            disaggregation_mode="decode",
            disable_radix_cache=False,
        )
    }
