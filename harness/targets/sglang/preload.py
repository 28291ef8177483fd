"""What a simulated PD rank imports, imported ahead of time: the fork server's preload for PD ranks.

A rank (:class:`harness.pd.prefill.PrefillWorker`, :class:`harness.pd.decode.DecodeWorker`) runs
sglang's real memory paths: pools, allocators, the radix cache, the decode prealloc queue, request
objects. Importing them pulls a large part of sglang's import graph (quantization, model loading,
transformers, torch's compiler stack), about six CPU seconds on a small machine, and every rank
paid it. :func:`rank` imports exactly the modules the rank code imports (at module level and inside
its functions) in a :mod:`harness.forkserver` process, so each rank is a fork that already has
them: the same modules, executed the same way, once.

Nothing here changes sglang: the modules are imported, not stubbed or patched (the adapter's own
import still applies ``HARNESS_FAULTS`` from the server's environment, as in any rank). Nothing here
touches a device either: no tensor is created, no process group, no CUDA call, so the process
forks safely. ``tests/test_forkserver.py`` checks that a rank built after :func:`rank` imports no
further sglang module (the list below covers what ranks run).
"""

from __future__ import annotations

import importlib

#: The fork server's ``preload`` for PD ranks.
RANK_PRELOAD = "harness.targets.sglang.preload:rank"

#: The harness modules a rank runs (they import sglang's at module level).
HARNESS_MODULES = (
    "harness.worker",
    "harness.targets.sglang",
    "harness.targets.sglang.decode",
    "harness.targets.sglang.pd_decode",
    "harness.targets.sglang.prefill",
    "harness.targets.sglang.pools",
    "harness.targets.sglang.requests",
    "harness.targets.sglang.runtime",
    "harness.targets.sglang.snapshot",
    "harness.pd.decode",
    "harness.pd.prefill",
)

#: sglang modules imported inside functions: by the adapter and the rank payloads, and by sglang.
SGLANG_MODULES = (
    "sglang.srt.runtime_context",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.managers.hisparse_coordinator",
    "sglang.srt.mem_cache.allocation",
    "sglang.srt.mem_cache.allocator.hisparse",
    "sglang.srt.mem_cache.allocator.swa",
    "sglang.srt.mem_cache.base_prefix_cache",
    "sglang.srt.mem_cache.cache_init_params",
    "sglang.srt.mem_cache.common",
    "sglang.srt.mem_cache.deepseek_v4_memory_pool",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.pool_host.base",
    "sglang.srt.mem_cache.pool_host.common",
    "sglang.srt.mem_cache.swa_memory_pool",
    "sglang.srt.mem_cache.unified_cache.component_type",
    "sglang.srt.mem_cache.unified_cache.components",
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.model_executor.forward_batch_info",
    "sglang.srt.sampling.sampling_params",
    # ... and what sglang itself imports inside the functions ranks call (pool construction,
    # argument resolution hooks of the runtime context, the radix tree core).
    "sglang.kernels.ops.kvcache.copy_pages",
    "sglang.kernels.ops.kvcache.zero_pages",
    "sglang.kernels.ops.memory.virtual_slot",
    "sglang.srt.arg_groups.boundary_reduction",
    "sglang.srt.arg_groups.cp_tp_group_sharing_hook",
    "sglang.srt.arg_groups.hicache_hook",
    "sglang.srt.arg_groups.kv_shard_hook",
    "sglang.srt.arg_groups.mega_moe_hook",
    "sglang.srt.arg_groups.memory_hook",
    "sglang.srt.arg_groups.parallel_hook",
    "sglang.srt.arg_groups.pipeline",
    "sglang.srt.arg_groups.platform_hook",
    "sglang.srt.arg_groups.resolution_hooks",
    "sglang.srt.arg_groups.serving_hook",
    "sglang.srt.layers.attention.dsv4.unified_kv_gate",
    "sglang.srt.mem_cache.allocator.unified_hybrid_swa",
    "sglang.srt.mem_cache.allocator.unified_sub_pool",
    "sglang.srt.mem_cache.layout.fused_draft",
    "sglang.srt.mem_cache.rust_tree_core.adapter",
    "sglang.srt.mem_cache.unified_memory_pool",
    "sglang.srt.rust_extensions.loader",
    "sglang.srt.rust_extensions.torch_build",
)


def rank() -> None:
    """Import every module a simulated PD rank runs (see the module docstring).

    The sglang list is 0.5.23's. Another target release (``--sglang``) may lack a module or refuse to
    import one here (0.5.21's Rust tree core raises on the venv's torch; sglang itself falls back to
    the Python core): such a module is not preloaded, and the rank does what that release does
    without the fork server.
    """
    for name in HARNESS_MODULES:
        importlib.import_module(name)
    for name in SGLANG_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional preload; the rank imports (or not) as the release does
            continue
