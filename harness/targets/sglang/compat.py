"""Every difference between the sglang releases the adapter supports, in one place (pytest's
``_pytest/compat.py`` shape): the rest of the harness asks these functions and never compares
``sglang.__version__`` itself.

Supported: sglang 0.5.19 … 0.5.23 and a source tree of any of them. Entries are named by the
capability they provide and cite the release or upstream PR that changed it; each says when it can
go (when the oldest supported release has the newer shape).

Three kinds of entries:

* **Static** (read source, import nothing; used while resolving a target): :func:`core_missing`
  (what the adapter cannot run without: a tree lacking it is refused up front),
  :func:`release_refused` (the oldest release) and :data:`RELEASE_DEPS` (module-level dependency
  pins a release needs where the venv's differ).
* **Capability probes** (:data:`CAPABILITIES`; import sglang): what a suite needs; a suite whose
  capability the target lacks is skipped (:func:`require`, :func:`require_device` raise
  :class:`CapabilityMissing`, a pytest skip) with one line naming the capability and the target.
* **Shims**: the few calls whose shape changed (:func:`evicted_seqlen`, :func:`scheduler_fields`,
  :func:`dsv4_pool_kwargs`, :func:`release_kv_cache`, :func:`decode_prefix_match`, :func:`caller_swa_reclaim`,
  :func:`all_free_pages`, :func:`dsv4_compressed_pools`, :func:`index_page_rows`)
  and the environment a release needs on this
  machine (:func:`process_env`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)

#: The supported releases, as shown in messages.
SUPPORTED_RANGE = "0.5.19 … 0.5.23"
#: The oldest release the adapter drives: 0.5.19 is the first with the page-floored SWA tail on
#: both decode prealloc paths (sglang#35286 / #35396) and ``runtime_context``; older ones lack the core.
OLDEST_RELEASE = (0, 5, 19)
#: The newest release checked against; newer ones are tried (capabilities decide what runs).
NEWEST_CHECKED = (0, 5, 23)

# ------------------------------------------------------------------------------------- static

#: Module-level dependency pins a release needs where the venv's (sglang 0.5.23's set) differ,
#: found by importing each release on the venv. Installed with the release into its cache.
RELEASE_DEPS: dict[str, tuple[str, ...]] = {
    # 0.5.19 registers its own ``qwen3_asr`` config, which transformers >= 5.13 also defines
    # ("'qwen3_asr' is already used by a Transformers config" at import); its own pin 5.12.1
    # needs huggingface_hub 1.x (httpx-based) and tokenizers <= 0.23.0. 0.5.20 renamed the config.
    "0.5.19": ("transformers==5.12.1", "huggingface_hub==1.33.0", "httpx==0.28.1", "httpcore==1.0.9",
               "h11==0.16.0", "tokenizers==0.22.2"),
}

# (file under sglang/srt, source pattern, what it is) the adapter cannot run without.
_CORE: tuple[tuple[str, str, str], ...] = (
    ("disaggregation/decode.py", r"^class DecodePreallocQueue\b", "PD decode DecodePreallocQueue"),
    ("disaggregation/decode.py", r"^\s+def _swa_tail_len\(", "DecodePreallocQueue._swa_tail_len"),
    ("disaggregation/decode.py", r"^def alloc_for_decode_prealloc\(", "alloc_for_decode_prealloc"),
    ("mem_cache/allocator/swa.py", r"^class SWATokenToKVPoolAllocator\b", "SWATokenToKVPoolAllocator"),
    ("runtime_context.py", r"^def get_context\(", "runtime_context.get_context"),
)


def core_missing(root: Path) -> str | None:
    """What of the adapter's core the tree at ``root`` lacks (reads source; imports nothing).

    Args:
        root: the directory holding ``sglang/``.

    Returns:
        A short description of the first missing piece, or None when the core is there.
    """
    srt = Path(root) / "sglang" / "srt"
    texts: dict[str, str | None] = {}
    for rel, pattern, what in _CORE:
        if rel not in texts:
            path = srt / rel
            texts[rel] = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None
        text = texts[rel]
        if text is None:
            return f"no sglang/srt/{rel}"
        if not re.search(pattern, text, re.MULTILINE):
            return f"no {what} in sglang/srt/{rel}"
    return None


def release_refused(version: str) -> str | None:
    """Why a release cannot be a target (before anything is downloaded), or None.

    Args:
        version: a release like ``0.5.21``.

    Returns:
        One line, or None when the release is in (or above) the supported range.
    """
    found = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    if found and tuple(int(p) for p in found.groups()) < OLDEST_RELEASE:
        return (f"sglang {version} is older than the supported range {SUPPORTED_RANGE}: it lacks the core the "
                "harness drives (the page-floored SWA tail on PD decode prealloc); pass 0.5.19 or newer")
    return None


def release_deps(version: str) -> tuple[str, ...]:
    """The pinned module-level dependencies to install next to a release (see :data:`RELEASE_DEPS`).

    Args:
        version: the release.

    Returns:
        pip requirement strings (empty when the venv's serve).
    """
    return RELEASE_DEPS.get(version, ())


# ------------------------------------------------------------------------------------- capabilities


@dataclass(frozen=True)
class Capability:
    """One thing a suite needs from the target.

    Attributes:
        name: what suites ask for.
        description: what it is, and the release/PR that brought it.
        probe: returns None when present, else a short reason (imports sglang).
    """

    name: str
    description: str
    probe: Callable[[], str | None]


def _module(name: str) -> Any:
    import importlib

    return importlib.import_module(name)


def _has(module: str, qualname: str) -> str | None:
    try:
        owner: Any = _module(module)
    except ImportError as exc:
        return f"{module} does not import ({exc})"
    for part in qualname.split("."):
        if not hasattr(owner, part):
            return f"no {module}:{qualname}"
        owner = getattr(owner, part)
    return None


def _first(*reasons: Callable[[], str | None]) -> str | None:
    for reason in reasons:
        found = reason()
        if found:
            return found
    return None


_DECODE = "sglang.srt.disaggregation.decode"

CAPABILITIES: dict[str, Capability] = {cap.name: cap for cap in (
    Capability(
        "decode-prealloc-swa-tail",
        "PD decode prealloc with an SWA tail: DecodePreallocQueue._pre_alloc / _swa_tail_len / "
        "_uses_swa_tail_prealloc and alloc_for_decode_prealloc (sglang#24036, page floor #35286/#35396)",
        lambda: _first(lambda: _has(_DECODE, "DecodePreallocQueue._pre_alloc"),
                       lambda: _has(_DECODE, "DecodePreallocQueue._swa_tail_len"),
                       lambda: _has(_DECODE, "DecodePreallocQueue._uses_swa_tail_prealloc"),
                       lambda: _has(_DECODE, "alloc_for_decode_prealloc"),
                       lambda: _has("sglang.srt.mem_cache.allocator.swa",
                                    "SWATokenToKVPoolAllocator.alloc_extend_swa_tail")),
    ),
    Capability(
        "hisparse-prealloc",
        "the DeepSeek-V4 hisparse decode prealloc: alloc_for_decode_prealloc_hisparse, "
        "DeepSeekV4HiSparseTokenToKVPoolAllocator and HiSparseCoordinator",
        lambda: _first(lambda: _has(_DECODE, "alloc_for_decode_prealloc_hisparse"),
                       lambda: _has("sglang.srt.mem_cache.allocator.hisparse",
                                    "DeepSeekV4HiSparseTokenToKVPoolAllocator"),
                       lambda: _has("sglang.srt.managers.hisparse_coordinator", "HiSparseCoordinator")),
    ),
    Capability(
        "hisparse-device",
        "the hisparse graph can be built on this machine's device (see device_missing: up to 0.5.21 the "
        "coordinator needs CUDA streams on the venv's torch even with no GPU)",
        lambda: _hisparse_device(),
    ),
    Capability(
        "decode-admission-budgets",
        "the idle decode scheduler's admission budgets: DecodePreallocQueue._allocatable_token_budgets "
        "and _swa_aware_allocatable_token_budgets",
        lambda: _first(lambda: _has(_DECODE, "DecodePreallocQueue._allocatable_token_budgets"),
                       lambda: _has(_DECODE, "DecodePreallocQueue._swa_aware_allocatable_token_budgets")),
    ),
    Capability(
        "decode-reservation",
        "page-rounded decode prealloc reservation: DecodePreallocQueue._prealloc_required_tokens (sglang#35265)",
        lambda: _has(_DECODE, "DecodePreallocQueue._prealloc_required_tokens"),
    ),
    Capability(
        "decode-radix-swa-reclaim",
        "_pre_alloc itself reclaims evictable SWA pages of the decode radix cache before allocating "
        "(sglang#40309, first in 0.5.21; before it only pop_preallocated's caller-side reclaim did)",
        lambda: _pre_alloc_reclaims_swa(),
    ),
    Capability(
        "decode-prealloc-async-h2d",
        "alloc_for_decode_prealloc of 0.5.23: length tensors through async_h2d and the SWA floor recorded "
        "with req.kv.set_evicted_seqlen (a fault rebuilt from that code needs both)",
        lambda: _first(lambda: None if "async_h2d" in vars(_module(_DECODE)) else f"no async_h2d in {_DECODE}",
                       lambda: _has("sglang.srt.mem_cache.unified_cache.components", "ComponentType")),
    ),
    Capability(
        "decode-swa-reservation",
        "DecodePreallocQueue._uses_swa_reservation: admission reserves full capacity separately from the "
        "SWA tail (0.5.21)",
        lambda: _has(_DECODE, "DecodePreallocQueue._uses_swa_reservation"),
    ),
    Capability(
        "free-swa-out-of-window-slots",
        "decode-step SWA window eviction through mem_cache.common.free_swa_out_of_window_slots",
        lambda: _has("sglang.srt.mem_cache.common", "free_swa_out_of_window_slots"),
    ),
    Capability(
        "free-kv-row-segments",
        "release through mem_cache.common.free_kv_row_segments (the SWA-aware row free)",
        lambda: _has("sglang.srt.mem_cache.common", "free_kv_row_segments"),
    ),
)}


def _hisparse_device() -> str | None:
    device = "cuda:0" if Path("/dev/nvidiactl").exists() else "cpu"
    lacking = device_missing(device, page_size=256, hisparse=True)
    return None if lacking is None else f"{lacking[0]}: {lacking[1]}"


def _pre_alloc_reclaims_swa() -> str | None:
    # Where the reclaim lives is a property of the release (#40309 moved it into _pre_alloc in
    # 0.5.21), decided by the version once: a 0.5.21+ tree whose _pre_alloc lost the call is a
    # regression the suites must see, not a reason for the caller-side shim to reclaim on its behalf.
    from harness.targets.sglang import selection as target
    from harness.targets.sglang.version import release_tuple

    release = release_tuple(target.current().version)
    if release is not None:
        return None if release >= (0, 5, 21) else f"sglang {'.'.join(map(str, release))} predates #40309 (0.5.21)"
    # A tree without a version: judge by the code.
    queue = _module(_DECODE).DecodePreallocQueue
    if "_reclaim_swa_tail_capacity" not in inspect.getsource(queue._pre_alloc):
        return "DecodePreallocQueue._pre_alloc does not call _reclaim_swa_tail_capacity"
    return None


@functools.cache
def mooncake_host_tensor_send() -> bool:
    """Whether prefill's Mooncake sender should have the pinned-host-tensor send path
    (``supports_host_tensor_indices``: pinned memory and a ``torch.cuda.Event``, first in 0.5.23)
    that the CPU compat patch ``mooncake-host-tensor-indices`` turns off.

    Releases before 0.5.23 have no such path (the patch has nothing to do); from 0.5.23 on the
    attribute must be there, and a tree without it is a change the patch must follow. A tree
    without a version counts as a current one.
    """
    from harness.targets.sglang import selection as target
    from harness.targets.sglang.version import release_tuple

    release = release_tuple(target.current().version)
    return release is None or release >= (0, 5, 23)


def missing(name: str) -> str | None:
    """Why the running target lacks a capability, or None when it has it.

    Args:
        name: a key of :data:`CAPABILITIES`.

    Returns:
        A short reason, or None.

    Raises:
        KeyError: an unknown capability name.
    """
    return CAPABILITIES[name].probe()


# ------------------------------------------------------------------------------------- device


def _skip_base() -> type[BaseException]:
    try:
        import pytest
    except ImportError:  # the bot side (rerun-test --dry-run) runs on a bare interpreter: no test to skip
        return Exception
    return pytest.skip.Exception


class CapabilityMissing(_skip_base()):  # type: ignore[misc]
    """The target lacks a capability a test needs: under pytest this *is* a skip (pytest's own skip
    exception, so a Hypothesis test or a fixture skips too), with one line naming the capability
    and the target."""

    def __init__(self, name: str, reason: str):
        from harness.targets.sglang import selection as target

        super().__init__(f"{target.current().label()} lacks capability {name!r}: {reason}", allow_module_level=True)
        self.capability = name
        self.reason = reason

    def __reduce__(self) -> tuple:
        # Raised in a Ray worker, it must reach the driver intact.
        return (type(self), (self.capability, self.reason))


def _source(root: Path, rel: str) -> str:
    path = root / "sglang" / "srt" / rel
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""


def device_missing(device: str, *, page_size: int, hisparse: bool, root: Path | None = None) -> tuple[str, str] | None:
    """The first capability the target lacks to build decode/prefill pools on ``device``, read from
    its source (imports nothing, so a PD driver can ask before starting ranks).

    * ``paged-allocator-without-triton`` (page size > 1 on a CPU device): up to 0.5.21
      ``PagedTokenToKVPoolAllocator.alloc_extend`` / ``alloc_decode`` launch only their Triton
      kernels, which need a GPU driver ("0 active drivers"); 0.5.22 added ``use_triton_kernels``
      (``current_platform.capabilities.supports_triton``) and the native torch path. On a machine
      without a GPU driver :func:`process_env` runs those kernels in Triton's interpreter, which
      provides the capability; without it the pools cannot be built on CPU. Remove with 0.5.21.
    * ``device-module-without-accelerator`` (hisparse on a CPU device): up to 0.5.21
      ``get_device_module()`` falls back to ``torch.get_device_module()``, which from torch 2.14 (the
      venv's) is ``torch.cuda`` on a CUDA wheel with no GPU, so ``HiSparseCoordinator`` creates CUDA
      streams; 0.5.22 asks ``torch.accelerator.current_accelerator(check_available=True)``. Those
      releases pin torch 2.13, where this held. Remove with 0.5.21.

    Args:
        device: "cpu" or "cuda:N".
        page_size: tokens per page of the pools.
        hisparse: whether the hisparse coordinator is built.
        root: the target's root (default: the running target's).

    Returns:
        ``(capability, reason)``, or None when the target can build them here.
    """
    if not device.startswith("cpu"):
        return None
    if root is None:
        from harness.targets.sglang import selection as target

        root = Path(target.current().root)
    if (page_size > 1 and "use_triton_kernels" not in _source(root, "mem_cache/allocator/paged.py")
            and os.environ.get("TRITON_INTERPRET") != "1"):
        return ("paged-allocator-without-triton",
                "its paged allocator runs only Triton kernels, which need a GPU (a native path came in 0.5.22)")
    if hisparse and "current_accelerator" not in _source(root, "utils/common.py"):
        return ("device-module-without-accelerator",
                "its get_device_module() is torch.cuda on this torch with no GPU, so HiSparseCoordinator "
                "needs CUDA streams (fixed in 0.5.22)")
    return None


def process_env(root: Path, *, gpu_driver: bool | None = None) -> dict[str, str]:
    """Environment a process needs, set before it imports the target at ``root`` (read from its source).

    ``TRITON_INTERPRET=1`` for releases whose paged allocator runs only Triton kernels (up to
    0.5.21; see :func:`device_missing`) on a machine with no GPU driver: Triton decorates sglang's
    kernels at import time, and in interpreter mode runs the real kernels on CPU tensors, so the
    suites drive sglang's own allocation code there. Never set where a GPU driver is present.
    Remove with 0.5.21.

    Args:
        root: the target's root.
        gpu_driver: whether this machine has an NVIDIA driver (default: ``/dev/nvidiactl`` exists).

    Returns:
        Variables to set (empty when none is needed).
    """
    if gpu_driver is None:
        gpu_driver = Path("/dev/nvidiactl").exists()
    if gpu_driver or "use_triton_kernels" in _source(root, "mem_cache/allocator/paged.py"):
        return {}
    return {"TRITON_INTERPRET": "1"}


def require_device(device: str, *, page_size: int, hisparse: bool = False) -> None:
    """Raise :class:`CapabilityMissing` when the target cannot build the pools on ``device``
    (see :func:`device_missing`).

    Args:
        device: "cpu" or "cuda:N".
        page_size: tokens per page.
        hisparse: whether the hisparse coordinator is built.

    Raises:
        CapabilityMissing: one line naming the capability and the target.
    """
    lacking = device_missing(device, page_size=page_size, hisparse=hisparse)
    if lacking:
        raise CapabilityMissing(*lacking)


def require(name: str) -> None:
    """Raise :class:`CapabilityMissing` when the target lacks capability ``name`` (a key of
    :data:`CAPABILITIES`).

    Raises:
        CapabilityMissing: one line naming the capability and the target.
    """
    reason = missing(name)
    if reason:
        raise CapabilityMissing(name, reason)


# ------------------------------------------------------------------------------------- shims


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
      ``req.swa_uuid_for_lock`` in 0.5.20), each only where the tree has it, as the release checks.

    Args:
        queue: the ``DecodePreallocQueue``.
        req: the request.

    Returns:
        ``(prefix_indices, prefix_len, total_prefix_len)`` for ``_pre_alloc``.
    """
    match = queue._match_prefix_and_lock(req)
    prefix_indices, prefix_len, total_prefix_len = match.prefix_indices, match.l1_prefix_len, match.decode_prefix_len
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


def caller_swa_reclaim(queue: Any, req: Any) -> str | None:
    """The SWA reclaim ``pop_preallocated`` ran right before ``_pre_alloc`` up to 0.5.20:
    ``_reclaim_swa_tail_capacity(swa_tail_len, rid)`` evicts radix-cached SWA pages until the tail
    fits. From 0.5.21 ``_pre_alloc`` reclaims itself (sglang#40309, capability
    ``decode-radix-swa-reclaim``), so nothing is done here. Remove with 0.5.20.

    Args:
        queue: the ``DecodePreallocQueue``.
        req: the request about to be preallocated.

    Returns:
        sglang's shortfall message when the reclaim could not free enough (the release then aborted
        the request; ``_pre_alloc`` will fail the same way here), else None.
    """
    if not queue._uses_swa_tail_prealloc() or missing("decode-radix-swa-reclaim") is None:
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
    return {4: (getattr(kv_pool, "c4_kv_pool", None), getattr(kv_pool, "c4_indexer_kv_pool", None)),
            128: (getattr(kv_pool, "c128_kv_pool", None), None)}


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


def scheduler_fields(radix_cache: bool) -> dict[str, Any]:
    """Scheduler fields the decode prealloc queue reads that moved between releases.

    0.5.19 read ``--disaggregation-decode-enable-radix-cache`` from ``scheduler.server_args``; 0.5.20
    reads the published runtime context (``get_disagg()``), which :mod:`runtime` publishes. Both are
    given so either release sees the same setting. Remove ``server_args`` with 0.5.19.

    Args:
        radix_cache: whether the decode radix cache is on.

    Returns:
        Extra attributes for the scheduler namespace.
    """
    import types

    return {"server_args": types.SimpleNamespace(disaggregation_decode_enable_radix_cache=radix_cache,
                                                 disaggregation_mode="decode")}
