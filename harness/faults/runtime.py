"""Faults applied in a running process: runtime wrappers put in place (and undone), and the check
that a process running with source-patch faults named in ``HARNESS_FAULTS`` really imports a sglang
copy carrying them, so a suite never runs silently unbroken.

The processes that run engine code apply the faults named for the run: the pytest plugin
(:mod:`harness.plugins.faults`), a PD rank's payload (:class:`harness.engines.sim.payload.RankPayload`) and a
real server's ``sitecustomize``.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from harness.faults import source
from harness.faults.fault import ENV_VAR, Fault, FaultError
from harness.faults.names import get, parse_names

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Applied:
    """Undo record of one applied fault: where the attribute lives and what was there before."""

    fault: Fault
    owner: Any
    attr: str
    original: Any


_APPLIED: dict[str, _Applied] = {}
#: Test-hook faults applied here: name -> (each variable's value before, the log watcher).
_HOOKS: dict[str, tuple[dict[str, str | None], logging.Handler | None]] = {}


class _FiredWatch(logging.Handler):
    """Writes a hook fault's name to the fired file once sglang logs the line that shows it took effect."""

    def __init__(self, fault: Fault) -> None:
        super().__init__(logging.DEBUG)
        self.fault, self.pattern = fault, re.compile(fault.fired_log)

    def emit(self, record: logging.LogRecord) -> None:
        path = os.environ.get(source.FIRED_ENV)
        try:
            if path and self.pattern.search(record.getMessage()):
                with open(path, "a", encoding="utf-8") as fh:
                    fh.write(self.fault.name + "\n")
        except Exception:  # noqa: BLE001 - a log handler must never raise into sglang
            pass


def _apply_hook(fault: Fault) -> None:
    before = {k: os.environ.get(k) for k, _ in fault.env}
    os.environ.update(dict(fault.env))
    watch = _FiredWatch(fault) if fault.fired_log else None
    if watch is not None:
        logging.getLogger("sglang").addHandler(watch)
    _HOOKS[fault.name] = (before, watch)
    logger.warning("fault %s active: %s (%s)", fault.name, fault.description, fault.upstream)


def _undo_hook(name: str) -> None:
    before, watch = _HOOKS.pop(name)
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if watch is not None:
        logging.getLogger("sglang").removeHandler(watch)
    logger.warning("fault %s undone", name)


def _resolve(target: str) -> tuple[Any, str]:
    module_name, _, qualname = target.partition(":")
    try:
        owner: Any = importlib.import_module(module_name)
        *path, attr = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        # getattr on the owner's __dict__ (not inherited) so undo restores exactly what was there.
        if attr not in vars(owner):
            raise AttributeError(attr)
    except (ImportError, AttributeError) as exc:
        raise FaultError(
            f"fault target {target!r} not found in the running engine ({exc!r}); "
            "the catalog entry needs updating for this engine version"
        ) from exc
    return owner, attr


def activate(names: list[str] | tuple[str, ...]) -> list[str]:
    """Apply the named faults to the running engine code (idempotent per name).

    Args:
        names: fault names from the catalog.

    Returns:
        The names now active (all of them, including ones applied before).

    Raises:
        FaultError: an unknown name or a missing target; nothing from this call stays applied.
    """
    faults = [get(name) for name in _with_required(names)]
    _check_patched([f.name for f in faults if f.is_patch])
    done: list[str] = []
    try:
        for fault in faults:
            if fault.name in _APPLIED or fault.name in _HOOKS or fault.is_patch:
                continue
            if fault.env:
                _apply_hook(fault)
                done.append(fault.name)
                continue
            owner, attr = _resolve(fault.target)
            original = vars(owner)[attr]
            replacement = fault.make(original)
            setattr(owner, attr, replacement)
            _APPLIED[fault.name] = _Applied(fault, owner, attr, original)
            done.append(fault.name)
            logger.warning("fault %s active: %s (%s)", fault.name, fault.description, fault.upstream)
    except BaseException:
        deactivate(done)
        raise
    return active()


def _check_patched(names: list[str]) -> None:
    """Raise unless the sglang this process imports is a scratch copy carrying every named patch."""
    if not names:
        return
    try:
        package = source.imported_tree() / source.PACKAGE
    except source.PatchError as e:
        raise FaultError(str(e)) from None
    missing = [n for n in names if n not in source.applied_in(package)]
    if missing:
        raise FaultError(
            f"patch fault(s) {', '.join(missing)} named in {ENV_VAR} but the sglang imported from "
            f"{package} does not carry them; inject them with --inject-fault (it builds the patched copy)"
        )


def _with_required(names: list[str] | tuple[str, ...]) -> list[str]:
    # Required faults first, depth first, each name once.
    out: list[str] = []

    def add(name: str) -> None:
        if name not in out:
            for dep in get(name).requires:
                add(dep)
            out.append(name)

    for name in names:
        add(name)
    return out


def deactivate(names: list[str] | tuple[str, ...] | None = None) -> None:
    """Undo applied faults, in reverse order of application.

    Args:
        names: the faults to undo; None undoes all of them. Names not applied are ignored.
    """
    for name in [n for n in reversed(list(_HOOKS)) if names is None or n in names]:
        _undo_hook(name)
    chosen = list(_APPLIED) if names is None else [n for n in _APPLIED if n in names]
    for name in reversed(chosen):
        applied = _APPLIED.pop(name)
        setattr(applied.owner, applied.attr, applied.original)
        logger.warning("fault %s undone", name)


def active() -> list[str]:
    """Names of the runtime and test-hook faults applied in this process, in application order."""
    return [*_APPLIED, *_HOOKS]


def activate_from_env(environ: dict[str, str] | None = None) -> list[str]:
    """Apply the faults named in ``HARNESS_FAULTS``.

    Args:
        environ: the environment to read; ``os.environ`` when None.

    Returns:
        The names now active.

    Raises:
        FaultError: the variable names an unknown fault or one whose target is missing.
    """
    value = (os.environ if environ is None else environ).get(ENV_VAR)
    names = parse_names(value)
    return activate(names) if names else active()
