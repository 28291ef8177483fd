"""Compatibility patches: the documented, named changes the harness makes to sglang to run it on CPU.

Each :class:`CompatPatch` fixes one thing that breaks a *CPU* run of sglang 0.5.23 and says why. They are
enabled per server by ``HARNESS_COMPAT_PATCHES`` (set by the launcher only on the ``cpu`` topology) and
applied when their target module is first imported (:mod:`.hooks`). Each patch and its evidence:
docs/modules.md.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Iterable

from harness.engines.server.hooks import after_import

log = logging.getLogger(__name__)

ENV_VAR = "HARNESS_COMPAT_PATCHES"


class CompatError(ValueError):
    """An unknown patch name, or a patch whose target no longer exists in the engine."""


@dataclass(frozen=True)
class CompatPatch:
    """One named compat patch: the module it changes, why, and how."""

    name: str
    target: str
    why: str
    #: Changes the module; returns False where the release lacks what the patch changes.
    apply: Callable[[ModuleType], bool | None]


def _mooncake_host_tensor_indices(mod: ModuleType) -> bool | None:
    from harness.targets.sglang import compat as release_compat

    cls = mod.MooncakeKVSender
    if not hasattr(cls, "supports_host_tensor_indices") and not release_compat.mooncake_host_tensor_send():
        return False  # a release before the host-tensor path: nothing to turn off
    if not hasattr(cls, "supports_host_tensor_indices"):
        raise CompatError(
            "mooncake-host-tensor-indices: MooncakeKVSender.supports_host_tensor_indices is gone; "
            "drop or update the patch"
        )
    cls.supports_host_tensor_indices = False


class _SwaTranslatedRows:
    """``req_to_token`` seen through ``full_to_swa_index_mapping``: rows of SWA-pool slots."""

    def __init__(self, req_to_token, mapping) -> None:
        self._req_to_token = req_to_token
        self._mapping = mapping

    def __getitem__(self, key):
        return self._mapping[self._req_to_token[key]]


def _torch_native_swa_read(mod: ModuleType) -> None:
    backend = mod.TorchNativeAttnBackend
    for name in ("forward_extend", "forward_decode", "_run_sdpa_forward_extend", "_run_sdpa_forward_decode"):
        if not hasattr(backend, name):
            raise CompatError(f"torch-native-swa-read: TorchNativeAttnBackend.{name} is gone; drop or update the patch")

    def mark_swa_layer(orig):
        def forward(self, q, k, v, layer, forward_batch, *args, **kwargs):
            pool = self.token_to_kv_pool
            # layers_mapping[layer_id] = (index in its pool, is_swa); only hybrid pools have it.
            self._harness_swa_read = bool(
                getattr(self, "use_sliding_window_kv_pool", False) and pool.layers_mapping[layer.layer_id][1]
            )
            try:
                return orig(self, q, k, v, layer, forward_batch, *args, **kwargs)
            finally:
                self._harness_swa_read = False

        forward.__wrapped__ = orig
        return forward

    def translate_rows(orig):
        def run(self, query, output, k_cache, v_cache, req_to_token, *args, **kwargs):
            if getattr(self, "_harness_swa_read", False):
                req_to_token = _SwaTranslatedRows(req_to_token, self.token_to_kv_pool.full_to_swa_index_mapping)
            return orig(self, query, output, k_cache, v_cache, req_to_token, *args, **kwargs)

        run.__wrapped__ = orig
        return run

    for name in ("forward_extend", "forward_decode"):
        setattr(backend, name, mark_swa_layer(getattr(backend, name)))
    for name in ("_run_sdpa_forward_extend", "_run_sdpa_forward_decode"):
        setattr(backend, name, translate_rows(getattr(backend, name)))


class _ForkingMultiprocessing:
    """``multiprocessing`` as the engine module sees it, whose ``set_start_method`` keeps ``fork``."""

    def __init__(self, real: ModuleType) -> None:
        self._real = real

    def set_start_method(self, method: str, force: bool = False) -> None:
        self._real.set_start_method("fork", force=True)

    def __getattr__(self, name: str):
        return getattr(self._real, name)


def _cpu_fork_children(mod: ModuleType) -> None:
    if not hasattr(mod, "mp") or not hasattr(mod.mp, "set_start_method"):
        raise CompatError(
            "cpu-fork-children: the engine module no longer imports multiprocessing as mp; drop or update the patch"
        )
    mod.mp = _ForkingMultiprocessing(mod.mp)


def _cpu_tp_without_pynccl(mod: ModuleType) -> bool | None:
    cls = getattr(mod, "GroupCoordinator", None)
    if cls is None:
        raise CompatError("cpu-tp-without-pynccl: parallel_state has no GroupCoordinator; drop or update the patch")
    if not getattr(mod, "_is_cpu", False):
        return False  # not a CPU platform: PyNccl is what the group should build
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        kwargs["use_pynccl"] = False  # a CPU group all-reduces through torch.distributed (gloo) instead
        init(self, *args, **kwargs)

    cls.__init__ = __init__


PATCHES: dict[str, CompatPatch] = {
    p.name: p
    for p in (
        CompatPatch(
            "mooncake-host-tensor-indices",
            "sglang.srt.disaggregation.mooncake.conn",
            "prefill's host-tensor index path pins memory and records a torch.cuda.Event: no driver on CPU",
            _mooncake_host_tensor_indices,
        ),
        CompatPatch(
            "torch-native-swa-read",
            "sglang.srt.layers.attention.torch_native_backend",
            "upstream bug: torch-native backend reads SWA layers with full-pool indices",
            _torch_native_swa_read,
        ),
        CompatPatch(
            "cpu-tp-without-pynccl",
            "sglang.srt.distributed.parallel_state",
            "upstream bug: a TP group on CPU builds a PyNccl communicator ('Expected a cuda device, but got: "
            "cpu'); its CPU all-reduce falls back to torch.distributed without it",
            _cpu_tp_without_pynccl,
        ),
        CompatPatch(
            "cpu-fork-children",
            "sglang.srt.entrypoints.engine",
            "scheduler and detokenizer start as forks of the server process: no GPU context to protect "
            "on CPU, and each spawn would import torch and sglang again",
            _cpu_fork_children,
        ),
    )
}


def _applier(patch: CompatPatch) -> Callable[[ModuleType], None]:
    def run(module: ModuleType) -> None:
        # Also on stderr (the server log), so a run's log shows which patches it ran under.
        if patch.apply(module) is False:
            log.info(
                "compat patch %s not needed in pid %d: this release lacks what it changes", patch.name, os.getpid()
            )
            return
        log.info("compat patch %s applied in pid %d (%s)", patch.name, os.getpid(), patch.why)

    return run


def install(names: Iterable[str]) -> list[str]:
    """Arrange for the named patches to be applied when their target modules are imported.

    Args:
        names: patch names (keys of :data:`PATCHES`).

    Returns:
        The names installed, in order.

    Raises:
        CompatError: an unknown name (listing the known ones).
    """
    chosen = [n.strip() for n in names if n.strip()]
    unknown = [n for n in chosen if n not in PATCHES]
    if unknown:
        raise CompatError(f"unknown compat patch {unknown[0]!r}; known: {', '.join(PATCHES)}")
    for n in chosen:
        after_import(PATCHES[n].target, _applier(PATCHES[n]))
    return chosen


def install_from_env(environ: os._Environ | dict | None = None) -> list[str]:
    """Install the patches named in ``HARNESS_COMPAT_PATCHES`` (none when unset).

    Raises:
        CompatError: an unknown name.
    """
    env = os.environ if environ is None else environ
    return install(env.get(ENV_VAR, "").split(","))
