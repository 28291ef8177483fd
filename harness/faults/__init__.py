"""Fault catalog: named, deliberate breakages of the code under test, used to prove suites catch bugs.

Two forms (``harness/faults/catalog.py`` lists them):

* **source patches** (every sglang fault): a small unified diff against sglang's source, what a bad
  PR would do (``harness/faults/patches/<name>.diff``), applied to a scratch copy of the target's
  sglang tree (:mod:`harness.faults.source`) put first on the import path of every process. Each
  patch adds a marker line, so a run proves the broken code ran (:data:`source.FIRED_ENV`).
* **runtime wrappers**, only where a patch cannot express the fault (the harness's own KV
  transfer): the ``module:Qual.name`` attribute is replaced in the running process by
  ``make(original)``.

Either way a fault is active only when asked for: by name in env ``HARNESS_FAULTS`` (comma-separated;
the adapter ``harness.targets.sglang`` applies runtime faults at import and checks that the sglang
it imports carries every named patch), and by the pytest option ``--inject-fault NAME``
(``harness/plugins/faults.py``), which builds the scratch copy, puts it on ``sys.path`` /
``PYTHONPATH`` and sets the env var, so Ray workers and server subprocesses run the same code.

Each :class:`Fault` names the *evidence* its catch must show — the ledger rules or general
invariants (``[swa-tail-short]``, ``KVCorruption``, ...) of which one must appear in a failing test's
report — and the suite selections that carry it (``suites``), which the kill matrix
(:mod:`harness.faultcheck.matrix`) runs.

Failure modes: an unknown name raises :class:`FaultError` naming it and the known names; a runtime
target missing from the engine, or a patch fault whose patch is not in the imported sglang, raises
:class:`FaultError`; the suites never run silently unbroken.
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
        evidence: what a catch must show: substrings of a failing test's report, each a ledger rule
            (``[rule]``) or a general invariant's exception; one of them must appear.
        suites: the smallest selections (rerun-test / pytest node ids or files, relative to the
            repository) whose tests carry the evidence; the kill matrix runs them.
        target: runtime faults only: ``"package.module:Attr"`` or ``"package.module:Class.attr"``.
        make: runtime faults only: ``make(original) -> replacement``.
        requires: names of faults applied before this one; undone with it only if named too.
    """

    name: str
    description: str
    upstream: str
    evidence: tuple[str, ...] = ()
    suites: tuple[str, ...] = ()
    target: str = ""
    make: Callable[[Any], Any] | None = None
    requires: tuple[str, ...] = ()

    @property
    def is_patch(self) -> bool:
        """A source-patch fault (no runtime target): ``harness/faults/patches/<name>.diff``."""
        return self.make is None


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
    _check_patched([f.name for f in faults if f.is_patch])
    done: list[str] = []
    try:
        for fault in faults:
            if fault.name in _APPLIED or fault.is_patch:
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
    from harness.faults import source

    try:
        package = source.imported_tree() / source.PACKAGE
    except source.PatchError as e:
        raise FaultError(str(e)) from None
    missing = [n for n in names if n not in source.applied_in(package)]
    if missing:
        raise FaultError(f"patch fault(s) {', '.join(missing)} named in {ENV_VAR} but the sglang imported from "
                         f"{package} does not carry them; inject them with --inject-fault (it builds the patched copy)")


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
    """Names of the runtime faults applied in this process, in application order."""
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
