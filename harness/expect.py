"""Named comparisons for suites: ``expect(swa_tail_len=(got, want), ...)`` fails with each value named,
``swa_tail_len 44 != 108``, instead of a tuple assert's ``(300, 44) == (300, 108)``.

>>> expect(fill_len=(300, 300), swa_tail_len=(108, 108))
>>> expect(fill_len=(300, 300), swa_tail_len=(44, 108))
Traceback (most recent call last):
AssertionError: swa_tail_len 44 != 108 (fill_len 300 as expected)
"""

from __future__ import annotations

from typing import Any


def expect(what: str = "", /, **named: tuple[Any, Any]) -> None:
    """Assert that every ``name=(got, want)`` pair is equal.

    Args:
        what: a few words said before the differences (``"prealloc of r0-300"``).
        **named: the values, each as ``(got, want)``.

    Raises:
        AssertionError: one or more differ: the differing ones first (``name got != want``), then the
            equal ones for context.
    """
    differ = [f"{name} {got!r} != {want!r}" for name, (got, want) in named.items() if got != want]
    if not differ:
        return
    same = [f"{name} {got!r}" for name, (got, want) in named.items() if got == want]
    context = f" ({', '.join(same)} as expected)" if same else ""
    raise AssertionError(f"{what + ': ' if what else ''}{'; '.join(differ)}{context}")
