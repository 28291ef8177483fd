"""Fault catalog: named, deliberate breakages of the code under test, used to prove suites catch bugs.

A fault replaces one attribute of the running engine code in *this* process (a function in a
module, a method on a class) with a broken version that mirrors a real upstream bug. Faults are
the only place the harness replaces engine code, and they are never active unless asked for:

* by name in the env var ``HARNESS_FAULTS`` (comma-separated), applied when the engine adapter
  (``harness.targets.sglang``) is imported: the same mechanism therefore works in-process, in Ray
  workers (env passed through ``runtime_env``) and in server subprocesses;
* by the pytest option ``--inject-fault NAME`` (``harness/plugins/faults.py``), which sets the env
  var for the session so every process the tests start inherits it.

Each catalog entry (``harness/faults/catalog.py``) is one :class:`Fault`: a name, a one-line
description, the upstream issue it mirrors, the ``module:Qual.name`` of the attribute it replaces
and a factory that takes the original and returns the broken replacement. Targets are strings, so
listing or validating faults imports nothing from the engine; only :func:`activate` does.

Failure modes: an unknown name raises :class:`FaultError` naming it and the known names; a target
that no longer exists in the engine (an upgrade moved it) raises :class:`FaultError` naming the
target, never silently runs the suites unbroken.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger(__name__)

#: Env var holding the comma-separated names of the faults to activate at adapter import.
ENV_VAR = "HARNESS_FAULTS"


class FaultError(ValueError):
    """An unknown fault name, or a fault target that does not exist in the running engine."""


@dataclass(frozen=True)
class Fault:
    """One named breakage of engine code.

    Attributes:
        name: kebab-case name used on the command line and in ``HARNESS_FAULTS``.
        description: one line saying what is broken.
        upstream: the upstream issue / PR the fault mirrors (e.g. ``"sglang#35286"``).
        target: ``"package.module:Attr"`` or ``"package.module:Class.attr"``, the attribute replaced.
        make: factory ``make(original) -> replacement``; the original is passed so a fault can
            wrap it (call through and then misbehave) rather than copy it.
        requires: names of faults applied before this one (a bug spanning two functions, e.g. an
            unaligned tail *and* its assert bypassed); they are undone with it only if named too.
    """

    name: str
    description: str
    upstream: str
    target: str
    make: Callable[[Any], Any]
    requires: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Applied:
    """Undo record of one applied fault: where the attribute lives and what was there before."""

    fault: Fault
    owner: Any
    attr: str
    original: Any


_APPLIED: dict[str, _Applied] = {}


def catalog() -> dict[str, Fault]:
    """All known faults by name.

    Returns:
        A new dict name -> :class:`Fault`, in catalog order.
    """
    from harness.faults.catalog import FAULTS

    # Importing the submodule ``harness.faults.catalog`` binds it as this package's attribute
    # ``catalog``, shadowing this function for every later call: bind the function back.
    globals()["catalog"] = _catalog_function
    return {fault.name: fault for fault in FAULTS}


_catalog_function = catalog


def get(name: str) -> Fault:
    """Look a fault up by name.

    Args:
        name: the fault's name.

    Returns:
        The :class:`Fault`.

    Raises:
        FaultError: no fault has that name (the message lists the known ones).
    """
    known = catalog()
    if name not in known:
        raise FaultError(f"unknown fault {name!r}; known faults: {', '.join(known)}")
    return known[name]


def parse_names(value: str | None) -> list[str]:
    """Split a ``HARNESS_FAULTS``-style value into validated names.

    Args:
        value: comma-separated names; empty, blank or None means none.

    Returns:
        The names in order, duplicates dropped.

    Raises:
        FaultError: a name is not in the catalog.
    """
    names: list[str] = []
    for raw in (value or "").split(","):
        name = raw.strip()
        if name and name not in names:
            get(name)
            names.append(name)
    return names


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
        raise FaultError(f"fault target {target!r} not found in the running engine ({exc!r}); "
                         "the catalog entry needs updating for this engine version") from exc
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
    done: list[str] = []
    try:
        for fault in faults:
            if fault.name in _APPLIED:
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
    chosen = list(_APPLIED) if names is None else [n for n in _APPLIED if n in names]
    for name in reversed(chosen):
        applied = _APPLIED.pop(name)
        setattr(applied.owner, applied.attr, applied.original)
        logger.warning("fault %s undone", name)


def active() -> list[str]:
    """Names of the faults applied in this process, in application order."""
    return list(_APPLIED)


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
