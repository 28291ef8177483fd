"""What a simulated PD rank or a harness Python subprocess imports, imported ahead of time: the fork
servers' preloads.

Importing sglang's memory paths costs about six CPU seconds per rank. :func:`rank` imports exactly what rank
code imports, once, in a fork server, so each rank is a fork that already has them; :func:`python` does the
same for the harness's own pytest subprocesses. Nothing here changes sglang or touches a device. The cases
and their checks: docs/modules.md.
"""

from __future__ import annotations

import importlib
import sys
from typing import Mapping, Sequence

from harness import faults
from harness.targets.sglang.selection import ENV_VAR
from harness.engines.server import server_preload as server_preload
from harness.workers import forkserver

#: The fork server's ``preload`` for PD ranks.
RANK_PRELOAD = "harness.engines.fork_preload:rank"
#: The fork server's ``preload`` for the harness's Python subprocesses (:func:`python_command`).
PYTHON_PRELOAD = "harness.engines.fork_preload:python"
#: What a Python subprocess needs to be forked: the preload leaves one thread only with one OpenMP
#: and one OpenBLAS thread (numpy's OpenBLAS starts its pool when it loads).
ONE_THREAD_ENV: dict[str, str] = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}

#: The harness modules a rank runs (they import sglang's at module level).
HARNESS_MODULES = (
    "harness.workers",
    "harness.targets.sglang",
    "harness.engines.sim.decode_side",
    "harness.engines.sim.pd_decode_side",
    "harness.engines.sim.prefill_side",
    "harness.engines.sim.pools",
    "harness.engines.sim.requests",
    "harness.engines.sim.rank_runtime",
    "harness.engines.sim.snapshot",
    "harness.engines.sim.decode_rank",
    "harness.engines.sim.prefill_rank",
    "harness.engines.sim.hetero_rank",
    "harness.engines.sim.hetero_transfer",
)

#: sglang modules imported inside functions: by the adapter and the rank payloads, and by sglang.
SGLANG_MODULES = (
    "sglang.srt.runtime_context",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.disaggregation.mooncake.conn",
    "sglang.srt.managers.data_parallel_controller",  # 2.6 s to import: the DP-attention hetero ranks
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


def python() -> None:
    """The server preload, and pytest: still nothing of sglang, and no pytest plugin (pytest rewrites
    a plugin's asserts only when it imports the plugin itself); the harness's own modules imported
    here are imported afresh by each child (:func:`python_command`).

    Not Ray (0.1 CPU-s on top of this graph): its native core reads its settings from the environment
    once, when it loads (the auth mode among them), and a child that starts a cluster, or a rank fork
    server started as a child (:func:`after_python`), must read the ones its cluster set."""
    server_preload.server()
    importlib.import_module("pytest")
    if "ray._raylet" in sys.modules:
        raise RuntimeError("the Python preload loaded Ray's native core: its children would keep its settings")
    # A pytest plugin's distribution that sglang's graph imports (anyio) cannot be rewritten once
    # imported; pytest says so in every run unless the module declares it is not to be rewritten.
    # Say it: its asserts stay as imported here, which is all that changes for it.
    for name in _pytest_plugin_packages() & set(sys.modules):
        module = sys.modules[name]
        module.__doc__ = f"{module.__doc__ or ''}\n\nPYTEST_DONT_REWRITE (preloaded by the harness's fork server)"


def _pytest_plugin_packages() -> set[str]:
    """Top-level packages of the distributions that register pytest plugins: pytest marks them all
    for assertion rewriting. The harness's own is left out (its children import it afresh)."""
    from importlib.metadata import entry_points

    tops: set[str] = set()
    for ep in entry_points(group="pytest11"):
        for f in ep.dist.files or () if ep.dist is not None else ():
            first = f.parts[0]
            if first.endswith((".dist-info", ".egg-info", ".pth")) or first in ("..", "__pycache__"):
                continue
            tops.add(first[:-3] if first.endswith(".py") else first)
    return tops - {"harness"}


def after_python(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """How to start a fork server whose preload extends :func:`python`'s (:func:`rank`: sglang's
    memory paths on top of the same third-party graph): as a fork of a :func:`python` server that this
    process or an ancestor already runs (``rerun-test``'s, for its groups; the fault check's and the
    mutation run's, for their runs) when one serves ``env``, so it imports only what its preload adds
    (about 1.3 of 6.5 CPU-s here); otherwise unchanged, a fresh interpreter (no :func:`python` server is
    started for it). The ``launch`` of :meth:`harness.workers.forkserver.ForkServer.start`.

    A run's faults do not stop it: a rank applies them itself (its payload, from ``HARNESS_FAULTS``) and
    runs no ``sitecustomize``, and a fault's patched sglang copy comes first on the path the child
    rebuilds from its ``PYTHONPATH``, as a fresh interpreter would import it."""
    forked, forked_env = python_command(argv, env, start_server=False, faults_ok=True)
    return (forked, forked_env) if forked != list(argv) else (list(argv), env)


def python_command(
    argv: Sequence[str], env: Mapping[str, str], *, start_server: bool = True, faults_ok: bool = False
) -> tuple[list[str], dict[str, str]]:
    """``argv`` and ``env`` that run a harness Python subprocess (``[sys.executable, "-m", ...]``),
    with :data:`ONE_THREAD_ENV` where ``env`` sets no other value (the harness runs such subprocesses
    side by side, and beside its tests), as a fork of the :func:`python` preload
    (:func:`harness.workers.forkserver.python_command`) when it then has those values and names no fault
    (a real server's ``sitecustomize`` applies them when the interpreter starts, which a fork skips;
    ``faults_ok``: the command applies its own, as a rank does); otherwise a fresh one.

    The server is started ``free_path``: a command whose ``PYTHONPATH`` or overlay
    (``HARNESS_SGLANG_OVERLAY``) puts a directory first that holds none of what the preload imported (a
    fault's or a mutant's patched ``sglang/``: the preload imports no sglang) is forked from the same
    server, and its child rebuilds ``sys.path`` from its own ``PYTHONPATH``; one that would shadow a
    preloaded module gets a fresh interpreter. ``start_server`` False: only a server this process or an
    ancestor already runs (:func:`after_python`)."""
    return forkserver.python_command(
        argv,
        {**ONE_THREAD_ENV, **env},
        preload=PYTHON_PRELOAD,
        requires=ONE_THREAD_ENV,
        refuses=() if faults_ok else (faults.ENV_VAR,),
        must_match=(ENV_VAR,),
        start_server=start_server,
        free_path=True,
    )
