"""sglang's own test hooks switched on and off in a RUNNING server: a file ``<ledger>/env/[SIDE:]VAR`` holding
a value sets ``VAR`` in the server's processes while it exists, so a test turns a hook on for the window
it scripts (after the stack's warm-up, whose requests poll through the same hooks) and off again.

The server side wraps sglang's ``EnvField.get`` (every read of a hook variable looks at its file first),
re-reads the scheduler's import-time copies of ``SGLANG_TEST_RETRACT*`` at each decode step, and decode's KV
manager's copy of ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` at each poll of a receiver (a test gives one
transfer a short timeout without a stack of its own, and the stack's other transfers keep sglang's). Only the
variables of :data:`SWITCHABLE`. Installed by the servers' ``sitecustomize`` beside the phase points.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType

from harness.engines import phases
from harness.engines.server.hooks import after_import

#: The variables a switch may set: sglang's test hooks (harness.targets.sglang.compat.testhooks).
SWITCHABLE = (
    "SGLANG_TEST_DISAGG_FAILURE_PROB",
    "SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB",
    "SGLANG_TEST_DISAGG_KV_CORRUPT_PROB",
    "SGLANG_TEST_RETRACT",
    "SGLANG_TEST_RETRACT_INTERVAL",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
)
#: The KV manager's copy of the waiting timeout (read once, at its start): attribute -> variable.
_TIMEOUT_COPY = ("waiting_timeout", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT")
#: The scheduler module's copies of its retraction hook, read once at its import.
_RETRACT_COPIES = {
    "TEST_RETRACT": "SGLANG_TEST_RETRACT",
    "TEST_RETRACT_INTERVAL": "SGLANG_TEST_RETRACT_INTERVAL",
}


class SwitchError(ValueError):
    """A variable no switch may set, or a side that does not exist: one line naming it."""


def switch_dir(ledger_dir: str | os.PathLike) -> Path:
    """Where a run's switches live: the ledger directory's ``env/``."""
    return Path(ledger_dir) / "env"


class EnvSwitch:
    """One switch: ``var`` is ``value`` in the servers (of ``side`` only, or the one ``server``, a worker name, if
    given) until :meth:`off`; usable as a context manager (off on leaving)."""

    def __init__(
        self,
        ledger_dir: str | os.PathLike,
        var: str,
        value: str,
        *,
        side: str | None = None,
        server: str | None = None,
    ) -> None:
        if var not in SWITCHABLE:
            raise SwitchError(f"{var}: not one of the switchable hooks {', '.join(SWITCHABLE)}")
        if side is not None and side not in phases.SIDES:
            raise SwitchError(f"side {side!r}: not one of {', '.join(phases.SIDES)}")
        if side is not None and server is not None:
            raise SwitchError("a switch names a side or a server, not both: a server is of one side already")
        if server is not None and (not server or "/" in server or ":" in server):
            raise SwitchError(f"server {server!r}: a worker name (no '/' or ':')")
        name = f"@{server}:{var}" if server else (f"{side}:{var}" if side else var)
        self.path = switch_dir(ledger_dir) / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(str(value), encoding="utf-8")
        tmp.replace(self.path)

    def off(self) -> None:
        """The variable goes back to what the server started with (idempotent)."""
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "EnvSwitch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.off()


class Switches:
    """The server side: each read of a switchable variable sets or restores it from its file."""

    def __init__(self, ledger_path: str, side: str | None) -> None:
        self.dir = switch_dir(Path(ledger_path).parent)
        self.server = Path(ledger_path).stem  # the worker: its ledger is <ledger>/<worker>.jsonl
        self.side = side if side in phases.SIDES else None
        self.started: dict[str, str | None] = {}  # each variable as it was at its first read

    def sync(self, var: str) -> None:
        """Set ``var`` from its switch (this server's first, then this side's), or back to its value at its first
        read."""
        if var not in self.started:
            self.started[var] = os.environ.get(var)
        for name in [f"@{self.server}:{var}"] + ([f"{self.side}:{var}"] if self.side else []) + [var]:
            try:
                os.environ[var] = (self.dir / name).read_text(encoding="utf-8").strip()
                return
            except OSError:
                continue
        before = self.started[var]
        if before is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = before


def _install_environ(switches: Switches, mod: ModuleType) -> None:
    field = mod.EnvField
    orig = field.get

    @functools.wraps(orig)
    def get(self):
        if getattr(self, "name", None) in SWITCHABLE:
            switches.sync(self.name)
        return orig(self)

    field.get = get


def _install_scheduler(switches: Switches, mod: ModuleType) -> None:
    from sglang.srt.environ import envs  # noqa: PLC0415 - the scheduler imported it already

    scheduler = mod.Scheduler
    orig = scheduler.update_running_batch

    @functools.wraps(orig)
    def update_running_batch(self, *args, **kwargs):
        for copy, var in _RETRACT_COPIES.items():
            if hasattr(mod, copy):
                setattr(mod, copy, getattr(envs, var).get())
        return orig(self, *args, **kwargs)

    scheduler.update_running_batch = update_running_batch


def _install_receiver(mod: ModuleType) -> None:
    """Each poll of a receiver first sets its KV manager's waiting timeout from the variable (switched, or as
    the server started). A release without the receiver, the copy or the variable keeps its own."""
    from sglang.srt.environ import envs  # noqa: PLC0415 - the conn module imported it already

    attr, var = _TIMEOUT_COPY
    receiver = getattr(mod, "CommonKVReceiver", None)
    field = getattr(envs, var, None)
    if receiver is None or field is None or not hasattr(receiver, "poll"):
        return
    orig = receiver.poll

    @functools.wraps(orig)
    def poll(self, *args, **kwargs):
        manager = getattr(self, "kv_mgr", None)
        if manager is not None and hasattr(manager, attr):
            setattr(manager, attr, field.get())
        return orig(self, *args, **kwargs)

    receiver.poll = poll


def install(ledger_path: str, component: str) -> Switches:
    """Install the switches in this server process (``component``: prefill or decode)."""
    switches = Switches(ledger_path, component)
    after_import("sglang.srt.environ", lambda m: _install_environ(switches, m))
    after_import("sglang.srt.managers.scheduler", lambda m: _install_scheduler(switches, m))
    if component == "decode":
        after_import("sglang.srt.disaggregation.common.conn", _install_receiver)
    return switches


def install_from_env(environ: dict | None = None) -> bool:
    """Install in a server started with the probe; True when installed."""
    from harness.engines.server.accounting_probe import COMPONENT_ENV, LEDGER_ENV

    env = os.environ if environ is None else environ
    if not env.get(LEDGER_ENV) or env.get(COMPONENT_ENV) not in phases.SIDES:
        return False
    install(env[LEDGER_ENV], env[COMPONENT_ENV])
    return True
