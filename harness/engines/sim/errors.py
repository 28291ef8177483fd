"""What the simulated PD engine's own checks raise: a byte of KV that differs from what the prefill
wrote (:class:`KVCorruption`), a window position without its SWA slot (:class:`WindowLost`), a prealloc
sglang failed (:class:`PreallocError`), and the pair's own problems (:class:`PDError`: ranks that
disagree, a request that can never be admitted, ledger violations at the end). Each is an
``AssertionError``: a test that meets one fails with it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from harness import ledger

if TYPE_CHECKING:  # kvfill imports torch: the errors are raised and read where torch is not loaded
    from harness.engines.sim import kvfill


class KVCorruption(AssertionError):
    """Received or kept KV differs from what prefill wrote: names the request, pool, page and position."""

    def __init__(self, rid: str, pool: str, where: kvfill.Mismatch, when: str):
        super().__init__(f"KV corruption in request {rid}: {pool} {where} ({when})")
        self.rid, self.pool, self.where, self.when = rid, pool, where, when

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Raised in a Ray worker and re-raised in the driver: pickle the constructor's arguments,
        # not the message (the default), or Ray reports an undeserializable exception instead.
        return type(self), (self.rid, self.pool, self.where, self.when)


class WindowLost(AssertionError):
    """A token inside the sliding window has no SWA slot (evicted too early)."""


class PreallocError(AssertionError):
    """sglang's prealloc raised for a request (e.g. the page-alignment assertion); pages it took stay."""


class PDError(AssertionError):
    """The PD run broke an end-to-end expectation (ranks disagree, a request can never fit, not idle), or
    its ledger broke: ``violations`` (root causes first in the message) and ``problems`` say which."""

    def __init__(self, message: str, *, violations: Sequence[ledger.Violation] = (), problems: Sequence[str] = ()):
        super().__init__(message)
        self.violations = tuple(violations)
        self.problems = tuple(problems)

    def __reduce__(self) -> tuple:
        return (_pd_error, (self.args[0] if self.args else "", self.violations, self.problems))


def _pd_error(message: str, violations: Sequence[ledger.Violation], problems: Sequence[str]) -> PDError:
    return PDError(message, violations=violations, problems=problems)
