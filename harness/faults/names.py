"""The fault catalog by name: every sglang source-patch fault (:mod:`.sglang`) and the harness's own
runtime fault of its PD transfer (:mod:`.pd`), looked up and validated."""

from __future__ import annotations

from harness.faults import sglang_hooks, sim_faults, sglang
from harness.faults.fault import Fault, FaultError


def catalog() -> dict[str, Fault]:
    """All known faults by name.

    Returns:
        A new dict name -> :class:`Fault`, in catalog order.
    """
    return {fault.name: fault for fault in (*sglang.FAULTS, *sim_faults.FAULTS)}


def sources() -> dict[str, Fault]:
    """Every fault a run may name: the catalog, then sglang's own test hooks (:mod:`.sglang_hooks`), which
    the fault check does not run (they name no suite)."""
    return {**catalog(), **{fault.name: fault for fault in sglang_hooks.FAULTS}}


def get(name: str) -> Fault:
    """Look a fault up by name.

    Args:
        name: the fault's name.

    Returns:
        The :class:`Fault`.

    Raises:
        FaultError: no fault has that name (the message lists the known ones).
    """
    known = sources()
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
