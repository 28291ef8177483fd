"""Holding a request at one phase of the PD path on a real server, so a test reaches that phase
deterministically (no sleeps, no luck): the prefill server stops before it sends a held request's KV.

A test creates the hold file (:func:`hold_file`) before it sends the request, acts, and removes it
(:func:`release`); a hold never outlives :data:`MAX_HOLD_S`. Own code, not a library: the wait sits inside
sglang's scheduler loop. The steps and their cost: docs/modules.md.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Callable

from harness.clock import Deadline
from harness.engines.server.hooks import after_import

log = logging.getLogger(__name__)

#: The longest a send waits for its hold file to go (seconds).
MAX_HOLD_S = 300.0
_POLL_S = 0.02


def hold_dir(ledger_path: str | os.PathLike) -> Path:
    """The hold directory of the server whose ledger is ``ledger_path``: the run's ``ledger/hold``."""
    return Path(ledger_path).parent / "hold"


def hold_file(ledger_dir: str | os.PathLike, rid: str) -> Path:
    """Create the hold of request ``rid`` in the run's ledger directory; returns the file (remove it
    to release, :func:`release`)."""
    d = Path(ledger_dir) / "hold"
    d.mkdir(parents=True, exist_ok=True)
    path = d / rid
    path.touch()
    return path


def held(hold: Path) -> bool:
    """True once the prefill server is holding the request of ``hold`` (its send is waiting)."""
    return hold.with_name(hold.name + ".held").exists()


def release(hold: Path) -> None:
    """Let the held send go on (idempotent)."""
    hold.unlink(missing_ok=True)


def _wrap_send(directory: Path, orig: Callable) -> Callable:
    @functools.wraps(orig)
    def wrapper(self, req, *args, **kwargs):
        gate = directory / str(getattr(req, "rid", ""))
        if gate.exists():
            gate.with_name(gate.name + ".held").touch()
            log.info("holding request %s before its KV send (remove %s to release)", req.rid, gate)
            deadline = Deadline(MAX_HOLD_S)
            while gate.exists() and not deadline.expired():
                deadline.sleep(_POLL_S)
            if gate.exists():
                log.warning("hold of %s outlived %g s: sending", req.rid, MAX_HOLD_S)
        return orig(self, req, *args, **kwargs)

    return wrapper


def install(ledger_path: str) -> None:
    """Wrap the prefill scheduler's KV send to wait on hold files next to ``ledger_path``."""
    directory = hold_dir(ledger_path)

    def on_prefill(mod: ModuleType) -> None:
        mixin = mod.SchedulerDisaggregationPrefillMixin
        mixin.send_kv_chunk = _wrap_send(directory, mixin.send_kv_chunk)

    after_import("sglang.srt.disaggregation.prefill", on_prefill)


def install_from_env(environ: dict | None = None) -> bool:
    """Install in a prefill server started with the probe; True when installed."""
    from harness.engines.server.accounting_probe import COMPONENT_ENV, LEDGER_ENV

    env = os.environ if environ is None else environ
    if not env.get(LEDGER_ENV) or env.get(COMPONENT_ENV) != "prefill":
        return False
    install(env[LEDGER_ENV])
    return True
