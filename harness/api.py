"""The one surface the suites import from (as ``pytest`` re-exports ``_pytest``): every name a suite
needs of the harness, so the modules behind it can move without breaking a suite.

Importing it is cheap and changes nothing (no sglang, Ray or torch, no fault): each name is loaded on first
use from the module that defines it (:data:`NAMES`). ``tests/test_api.py`` checks both, and that
``suites/`` imports nothing else of ``harness``. The names by what they are for: docs/modules.md.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each name of the surface -> ``module:attribute`` it is (``module:`` alone: the module itself).
NAMES: dict[str, str] = {
    # the simulated PD engine over Ray
    "run": "harness.engines.sim.driver:run",
    "KVSpec": "harness.engines.sim.workload:KVSpec",
    "PDRequest": "harness.engines.sim.workload:PDRequest",
    "workload": "harness.engines.sim.workload:workload",
    "soak": "harness.engines.sim.sim_soak:soak",
    # checks and evidence
    "ledger": "harness.ledger:",
    "expect": "harness.expect:expect",
    "wait_for": "harness.clock:wait_for",
    "KVCorruption": "harness.engines.sim.errors:KVCorruption",
    "WindowLost": "harness.engines.sim.errors:WindowLost",
    "PreallocError": "harness.engines.sim.errors:PreallocError",
    "PDError": "harness.engines.sim.errors:PDError",
    # heterogeneous PD on the simulated engine: unequal TP, DP attention, sglang's mooncake code deciding
    "HeteroModel": "harness.engines.sim.hetero_rank:HeteroModel",
    "HeteroRequest": "harness.engines.sim.hetero:HeteroRequest",
    "HeteroRefused": "harness.engines.sim.hetero_rank:Refused",
    "HeteroShape": "harness.engines.sim.hetero:Shape",
    "NotHeld": "harness.engines.sim.hetero_rank:NotHeld",
    "hetero_check": "harness.engines.sim.hetero:check",
    "hetero_content": "harness.engines.sim.hetero_rank:content",
    "hetero_start": "harness.engines.sim.hetero:start",
    "hetero_transfer": "harness.engines.sim.hetero:transfer",
    # heterogeneous PD on real servers: whose KV head each decode rank holds (every rank's per-head digests)
    "head_slices": "harness.ledger.head_slices:",
    # topologies
    "topology": "harness.topology:",
    # workers
    "InProcess": "harness.workers.spec:InProcess",
    "WorkerDied": "harness.workers.spec:WorkerDied",
    "SuiteRunner": "harness.workers.suiterun:SuiteRunner",
    "DEVICE_ENV": "harness.workers.suiterun:DEVICE_ENV",
    # the sglang adapter, in process
    "DecodeConfig": "harness.engines.sim.decode_types:DecodeConfig",
    "DecodeSide": "harness.engines.sim.decode_side:DecodeSide",
    "PreallocResult": "harness.engines.sim.decode_types:PreallocResult",
    "PreallocFailed": "harness.engines.sim.decode_types:PreallocFailed",
    "PoolSizes": "harness.engines.sim.pools:PoolSizes",
    "SWA_PAGE_SIZES": "harness.engines.sim.pools:SWA_PAGE_SIZES",
    "make_req": "harness.engines.sim.requests:make_req",
    "require_capability": "harness.targets.sglang.compat.capabilities:require",
    "device_missing": "harness.targets.sglang.compat.capabilities:device_missing",
    # real sglang servers
    "ServerClient": "harness.engines.server.http_client:ServerClient",
    "ServerHTTPError": "harness.engines.server.http_client:ServerHTTPError",
    "prompt_ids": "harness.engines.server.requests_kit:prompt_ids",
    "new_rid": "harness.engines.server.requests_kit:new_rid",
    "answer_of": "harness.engines.server.requests_kit:answer_of",
    "finish_reason": "harness.engines.server.requests_kit:finish_reason",
    "aborted": "harness.engines.server.requests_kit:aborted",
    "start_pd_stack": "harness.engines.server.stack:start_pd_stack",
    "reset_server": "harness.engines.server.reset:reset_server",
    "soak_stack": "harness.engines.server.server_soak:soak_stack",
    "ResetError": "harness.engines.server.reset:ResetError",
    "rooms_kept_by_race": "harness.engines.server.races:kept",
    "phases": "harness.engines.phases:",
    "stalls": "harness.plugins.stackwatch:stalls",
    "EnvSwitch": "harness.engines.server.env_switch:EnvSwitch",
    "testhooks": "harness.targets.sglang.compat.testhooks:",
    "leftover_processes": "harness.engines.server.stack:leftover_processes",
    "HISPARSE_DECODE_ARGS": "harness.engines.server.launcher:HISPARSE_DECODE_ARGS",
    "CPU_COMPAT_PATCHES": "harness.engines.server.launcher:CPU_COMPAT_PATCHES",
    # exploration (harness explore): the stateful machine, its pair of sides, a replay, and the command line
    "ExploreSession": "harness.explore.machine:Session",
    "explore_replay": "harness.explore.machine:replay",
    "ExplorePair": "harness.explore.pair:Pair",
    "ExplorePairConfig": "harness.explore.pair:PairConfig",
    "interleave": "harness.explore.interleave:",
    "harness_main": "harness.cli:main",
    "rerun_test_main": "harness.commands.rerun:main",
    "ExploreFinding": "harness.explore.machine:Finding",
    "ExploreStep": "harness.explore.pair:Step",
    "explore_shrink_by_replay": "harness.explore.machine:shrink_by_replay",
}

__all__ = sorted(NAMES)


def __getattr__(name: str) -> Any:
    where = NAMES.get(name)
    if where is None:
        raise AttributeError(
            f"harness.api has no {name!r}; a suite needs of the harness only the names of "
            f"harness.api.NAMES (add one there for a new need)"
        )
    module_name, _, attr = where.partition(":")
    if module_name.startswith(("harness.targets.sglang", "harness.engines")):
        from harness.targets.sglang import selection

        selection.current()  # the selected sglang first on the import path, before the adapter runs
    module = importlib.import_module(module_name)
    value = getattr(module, attr) if attr else module
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *NAMES])
