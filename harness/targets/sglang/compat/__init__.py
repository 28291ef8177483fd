"""Every difference between the sglang releases the adapter supports, in one place (pytest's
``_pytest/compat.py`` shape): the rest of the harness asks these functions and never compares
``sglang.__version__`` itself.

Supported: sglang 0.5.16 … 0.5.23 and a source tree of any of them (0.5.15 is refused: see
:data:`~harness.targets.sglang.releases.OLDEST_RELEASE`). Entries are named by the
capability they provide and cite the release or upstream PR that changed it; each says when it can
go (when the oldest supported release has the newer shape). Four kinds, one module each:

* **Static** (:mod:`harness.targets.sglang.releases`; read source, import nothing; what resolving a
  target reads before sglang is imported): :func:`core_missing` (what the adapter cannot run
  without: a tree lacking it is refused up front), :func:`release_refused` (the oldest release),
  :data:`RELEASE_DEPS` (module-level dependency pins a release needs where the venv's differ),
  :func:`server_option` (whether a server option exists) and
  :func:`process_env` (the environment a release needs on this machine).
* **Capability probes** (:mod:`.capabilities`, :data:`CAPABILITIES`; import sglang): what a suite
  needs; a suite whose capability the target lacks is skipped (:func:`require`,
  :func:`require_device` raise :class:`CapabilityMissing`, a pytest skip) with one line naming the
  capability and the target.
* **sglang's own checks** (:mod:`.checks`; read source, import nothing): the runtime checks every
  server and simulated rank runs with (:func:`checks.environment`), which ones a target has
  (:func:`checks.present`) and how a hit reads (:func:`checks.hit`).
* **Shims** (:mod:`.shims`): the few calls whose shape changed (:func:`evicted_seqlen`,
  :func:`scheduler_fields`, :func:`server_setting`, :func:`dsv4_pool_kwargs`, :func:`decode_prealloc_kwargs`, :func:`release_kv_cache`,
  :func:`decode_prefix_match`, :func:`prefix_swa_in_tree`, :func:`caller_swa_reclaim`, :func:`commit_decode_tokens`, :func:`component_type`, :func:`all_free_pages`,
  :func:`dsv4_compressed_pools`, :func:`index_page_rows`), and a request's KV state
  (:mod:`.reqkv`, :func:`req_kv`: ``req.kv`` owns it from 0.5.19, before that the request does).

Every name is re-exported here: ``compat.require(...)``, ``compat.release_kv_cache(...)``.
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
    "CAPABILITIES", "Capability", "CapabilityMissing", "device_missing", "missing", "mooncake_host_tensor_send",
    "require", "require_device",
    "all_free_pages", "caller_swa_reclaim", "commit_decode_tokens", "component_type", "decode_prealloc_kwargs", "decode_prefix_match", "dsv4_compressed_pools", "dsv4_pool_kwargs",
    "evicted_seqlen", "index_page_rows", "prefix_swa_in_tree", "release_kv_cache", "scheduler_fields", "server_setting", "LegacyReqKv", "req_kv",
    "NEWEST_CHECKED", "OLDEST_RELEASE", "RELEASE_DEPS", "SUPPORTED_RANGE", "core_missing", "process_env",
    "release_deps", "release_refused", "server_option",
]
