"""Root cause first: of a run's violations, which broke a rule on its own and which only followed from
an earlier one; and the error a broken ledger raises (:class:`LedgerBroken`, :func:`assert_clean`).

:func:`root_causes` returns the violations that are not *knock-ons* of an earlier one (by
:data:`~harness.ledger.rules.KNOCK_ONS`), earliest first, each with its knock-ons; reports and failure
headlines lead with the first root. The knock-on rule: docs/modules.md.

>>> from harness.ledger.events import Violation
>>> tail = Violation("swa-tail-short", "fill 300: tail 44 < 100", seq=3, worker="d0", rid="r0")
>>> leak = Violation("page-leak", "pool 'swa': 1 page never freed", None, "d0", "r0")
>>> [(c.root.rule, [k.rule for k in c.knock_ons]) for c in root_causes([leak, tail])]
[('swa-tail-short', ['page-leak'])]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from harness.ledger.events import Violation
from harness.ledger.rules import KNOCK_ONS


@dataclass(frozen=True)
class Cause:
    """A violation that follows from no earlier one (``root``), and those that followed from it."""

    root: Violation
    knock_ons: tuple[Violation, ...] = field(default=())


def _depth(rule: str, seen: frozenset[str] = frozenset()) -> int:
    """How far down the knock-on table ``rule`` sits: 0 for a rule no other lists, else one more than
    the deepest rule that lists it (so at one event a cause sorts before what follows from it)."""
    parents = [r for r, follows in KNOCK_ONS.items() if rule in follows and r not in seen]
    return 1 + max(_depth(r, seen | {rule}) for r in parents) if parents else 0


_DEPTH = {rule: _depth(rule) for follows in KNOCK_ONS.values() for rule in follows}


def _order(v: Violation) -> tuple[bool, int, int]:
    # An event's violation in event order; one the end of the run found (no event) after all of them;
    # at one event, a cause before its knock-ons.
    return (v.seq is None, v.seq if v.seq is not None else 0, _DEPTH.get(v.rule, 0))


def _follows(later: Violation, earlier: Violation) -> bool:
    same_place = later.worker == earlier.worker and (not later.rid or later.rid == earlier.rid)
    return same_place and _order(earlier)[:2] <= _order(later)[:2] and later.rule in KNOCK_ONS.get(earlier.rule, ())


def root_causes(violations: Iterable[Violation]) -> list[Cause]:
    """The violations that follow from no earlier one, earliest first, each with its knock-ons.

    Args:
        violations: any violations (:func:`harness.ledger.check`'s, or a suite's own).

    Returns:
        One :class:`Cause` per root; a knock-on is grouped under the earliest root it follows from
        (a knock-on of a knock-on under that one's root).
    """
    ordered = sorted(violations, key=_order)
    roots: list[Violation] = []
    under: dict[int, list[Violation]] = {}
    placed: dict[int, int] = {}  # id(violation) -> index of its root
    for i, v in enumerate(ordered):
        parent = next((j for j in range(i) if _follows(v, ordered[j])), None)
        if parent is None:
            placed[id(v)] = len(roots)
            under[len(roots)] = []
            roots.append(v)
        else:
            root = placed[id(ordered[parent])]
            placed[id(v)] = root
            under[root].append(v)
    return [Cause(r, tuple(under[i])) for i, r in enumerate(roots)]


class LedgerBroken(AssertionError):
    """A check found the ledger broken: its violations, root causes first (``str`` names them all, one a
    line; ``.causes`` groups the knock-ons under their root, :mod:`harness.ledger.causes`)."""

    def __init__(self, violations: Sequence[Violation], what: str = ""):
        self.violations = tuple(violations)
        self.what = what
        self.causes = root_causes(self.violations)
        lines = []
        for cause in self.causes:
            lines.append(str(cause.root))
            lines += [f"  then {v}" for v in cause.knock_ons]
        head = (
            f"ledger broken{' ' + what if what else ''}: {len(self.violations)} violation(s), "
            f"{len(self.causes)} root cause(s)"
        )
        super().__init__("\n".join([head, *lines]))

    def __reduce__(self) -> tuple:
        return (type(self), (self.violations, self.what))


def assert_clean(violations: Iterable[Violation], what: str = "") -> None:
    """Raise :class:`LedgerBroken` when there is any violation (a suite's one-line ledger assert).

    Args:
        violations: what :func:`harness.ledger.check` (or :func:`~harness.ledger.prealloc_violations`) found.
        what: when or of what, for the message (``"after prealloc of r0-300"``).

    Raises:
        LedgerBroken: one or more violations, root causes first.
    """
    found = list(violations)
    if found:
        raise LedgerBroken(found, what)
