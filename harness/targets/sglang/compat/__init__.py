"""Every difference between the sglang releases the adapter supports, in one place (pytest's
``_pytest/compat.py`` shape): the rest of the harness asks these functions and never compares
``sglang.__version__`` itself.

Supported: sglang 0.5.16 … 0.5.23 and a source tree of any of them. Each entry is named by its capability,
cites the release or PR that changed it and says when it can go. Four kinds, one module each (static,
capability probes, sglang's own checks, shims), all re-exported here; the lists: docs/modules.md.
"""

from harness.targets.sglang.compat.capabilities import (
    CAPABILITIES,
    Capability,
    CapabilityMissing,
    device_missing,
    missing,
    mooncake_host_tensor_send,
    require,
    require_device,
)
from harness.targets.sglang.compat.reqkv import LegacyReqKv, req_kv
from harness.targets.sglang.compat.shims import (
    all_free_pages,
    caller_swa_reclaim,
    commit_decode_tokens,
    component_type,
    decode_prealloc_kwargs,
    decode_prefix_match,
    dsv4_compressed_pools,
    dsv4_pool_kwargs,
    evicted_seqlen,
    index_page_rows,
    prefix_swa_in_tree,
    release_kv_cache,
    scheduler_fields,
    server_setting,
)
from harness.targets.sglang.releases import (
    NEWEST_CHECKED,
    OLDEST_RELEASE,
    RELEASE_DEPS,
    SUPPORTED_RANGE,
    core_missing,
    process_env,
    release_deps,
    release_refused,
    server_option,
)

__all__ = [
    "CAPABILITIES",
    "Capability",
    "CapabilityMissing",
    "device_missing",
    "missing",
    "mooncake_host_tensor_send",
    "require",
    "require_device",
    "all_free_pages",
    "caller_swa_reclaim",
    "commit_decode_tokens",
    "component_type",
    "decode_prealloc_kwargs",
    "decode_prefix_match",
    "dsv4_compressed_pools",
    "dsv4_pool_kwargs",
    "evicted_seqlen",
    "index_page_rows",
    "prefix_swa_in_tree",
    "release_kv_cache",
    "scheduler_fields",
    "server_setting",
    "LegacyReqKv",
    "req_kv",
    "NEWEST_CHECKED",
    "OLDEST_RELEASE",
    "RELEASE_DEPS",
    "SUPPORTED_RANGE",
    "core_missing",
    "process_env",
    "release_deps",
    "release_refused",
    "server_option",
]
