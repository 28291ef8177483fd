"""Loaded by every sglang server process the harness starts (this directory is on its PYTHONPATH).

It changes nothing unless asked by env var (``HARNESS_COMPAT_PATCHES``, ``HARNESS_IB_NODE_GPUS``,
``HARNESS_ALLOC_ORDER``, ``HARNESS_PROBE_LEDGER``, ``HARNESS_FAULTS``). A failure here stops the server
rather than let it run without what the harness asked for. A forked server runs it again with its own
environment. What each variable turns on: docs/modules.md.
"""

import os
import sys

if (
    os.environ.get("HARNESS_COMPAT_PATCHES")
    or os.environ.get("HARNESS_PROBE_LEDGER")
    or os.environ.get("HARNESS_FAULTS")
    or os.environ.get("HARNESS_IB_NODE_GPUS")
    or os.environ.get("HARNESS_ALLOC_ORDER")
):
    try:
        import logging

        # Our own handler on our own logger: configuring the root logger would change sglang's logging.
        _log = logging.getLogger("harness.engines.server")
        if not _log.handlers:
            _handler = logging.StreamHandler(sys.stderr)
            _handler.setFormatter(logging.Formatter("%(asctime)s harness %(levelname)s %(message)s"))
            _log.addHandler(_handler)
            _log.setLevel(logging.INFO)
            _log.propagate = False
        if os.environ.get("HARNESS_IB_NODE_GPUS"):
            from harness.engines.server import rdma

            rdma.install_from_env()
        if os.environ.get("HARNESS_COMPAT_PATCHES"):
            from harness.engines.server import patches as compat

            compat.install_from_env()
        if os.environ.get("HARNESS_ALLOC_ORDER"):
            from harness.engines.server import alloc_patch

            alloc_patch.install_from_env()
        if os.environ.get("HARNESS_PROBE_LEDGER"):
            from harness.engines.server import hold, accounting_probe, env_switch, kv_digest

            # The phase points first: their wrappers are then the inner ones, and the probe's see
            # sglang's own callers (the KV digest reads the transfer worker's chunk from its caller).
            hold.install_from_env()
            env_switch.install_from_env()
            kv_digest.install_from_env(accounting_probe.install_from_env())
        if os.environ.get("HARNESS_FAULTS"):
            from harness import faults as _faults
            from harness.targets.sglang import selection as _target

            # The selected target first, then check that the sglang it imports carries every named
            # patch (and apply runtime faults). A server forked from harness.workers.forkserver runs
            # this file again with its own environment: both are idempotent.
            _target.current()
            _faults.activate_from_env()
    except Exception as e:  # noqa: BLE001 - any failure must stop the server, loudly
        import traceback

        traceback.print_exc()
        print(f"harness sitecustomize: {type(e).__name__}: {e}; refusing to start", file=sys.stderr, flush=True)
        os._exit(3)
