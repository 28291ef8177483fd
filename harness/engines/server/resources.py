"""What a real server holds besides KV pages, read from its scheduler at a cache flush: request rows,
metadata-buffer slots, radix-tree lock references, the KV manager's per-room state and hisparse host
slots (the names of :data:`harness.ledger.resources.RESOURCES`). The accounting probe puts the readings
into its ``reset`` event, beside the pools, with each one's baseline; a resource this sglang lacks is
named once in the event's note and logged once, never a failure. Rooms in prefill's KV manager that no
sender holds (sglang's update_status race, :mod:`harness.engines.server.races`) are named in the note and
not counted. Nothing here changes sglang's state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from harness.engines.server import races
from harness.targets.sglang.compat import pdstate

log = logging.getLogger(__name__)


@dataclass
class Readings:
    """One read of a scheduler: each resource's value and baseline, and what this sglang lacks."""

    values: dict[str, int] = field(default_factory=dict)
    baseline: dict[str, int] = field(default_factory=dict)
    lacking: list[str] = field(default_factory=list)
    #: Rooms in prefill's KV manager that no sender holds (sglang's race, :mod:`harness.engines.server.races`):
    #: named in the event's note, not counted as a leak.
    resurrected: list[int] = field(default_factory=list)

    def put(self, name: str, read: tuple[int, int]) -> None:
        self.values[name], self.baseline[name] = read


def read(scheduler: Any, component: str) -> Readings:
    """Read every resource of ``scheduler`` (a prefill or decode ``Scheduler``) from sglang's objects.

    Args:
        scheduler: the server's scheduler.
        component: ``prefill`` or ``decode`` (which side's KV manager state to read); any other (a plain
            server) reads no PD resource.

    Returns:
        The :class:`Readings`; a resource this release lacks is one line in ``lacking``.
    """
    out = Readings()

    def attempt(fn) -> None:
        try:
            fn()
        except pdstate.Lacking as e:
            out.lacking.append(str(e))
        except AttributeError as e:  # a release whose scheduler has no such object
            out.lacking.append(f"{e}")

    attempt(lambda: out.put("req_slots", pdstate.request_rows(scheduler.req_to_token_pool)))
    attempt(lambda: out.put("tree_locked", pdstate.tree_locked(scheduler.tree_cache)))
    if component in ("prefill", "decode"):  # a plain (non-PD) server has neither
        attempt(lambda: out.put("metadata_slots", pdstate.metadata_slots(pdstate.metadata_allocator(scheduler))))
        attempt(lambda: _rooms(out, pdstate.kv_manager(scheduler), component))
    if getattr(scheduler, "enable_hisparse", False):
        attempt(lambda: out.put("host", pdstate.host_slots(scheduler.hisparse_coordinator)))
    return out


def _rooms(out: Readings, manager: Any, component: str) -> None:
    apart = races.unowned(pdstate.room_keys(manager)) if component == "prefill" else frozenset()
    for name, value in pdstate.kv_rooms(manager, component, apart).items():
        out.put(name, value)
    out.resurrected = sorted(apart)


def note(readings: Readings) -> str:
    """The note for a reset event: what this sglang lacks, and the rooms a known race left."""
    return lacking_note(readings) + races.note(readings.resurrected)


_told: set[str] = set()


def lacking_note(readings: Readings) -> str:
    """The note for an event: the resources this sglang lacks, logged the first time each is seen."""
    for line in readings.lacking:
        if line not in _told:
            _told.add(line)
            log.warning("accounting probe: this sglang lacks %s; not counted", line)
    return "; lacks " + "; ".join(readings.lacking) if readings.lacking else ""
