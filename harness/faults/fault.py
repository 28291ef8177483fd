"""What a fault is: one named breakage of engine code, the evidence its catch must show and the suites
that carry it (:class:`Fault`); the catalog itself is :mod:`harness.faults.names`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

#: Env var holding the comma-separated names of the faults of a run (every process it starts inherits it).
ENV_VAR = "HARNESS_FAULTS"
#: How a pytest session stopped by ``--stop-at-catch`` says so: the faults plugin writes it, the fault check
#: (standard library only, for ``gate plan``) reads it.
STOP_AT_CATCH_LINE = "--stop-at-catch: "


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
        sglang_checks: the sglang checks on in the fault check's runs of it (a ``HARNESS_SGLANG_CHECKS``
            value; empty: every check, as in any run). For a fault one of sglang's own checks would
            stop the server over before the harness's oracle can look (its idle memory check, on by
            default, crashes the scheduler at the first idle moment after a leak): the catch the
            check counts must be the harness's.
        env: sglang test-hook faults only: the variables activation sets in every process that runs
            engine code (sglang's own hook reads them; :mod:`harness.faults.sglang_hooks`).
        fired_log: test-hook faults: a regex of sglang's log line that shows the hook took effect; the
            activation watches sglang's loggers for it and writes the fired marker a patch writes.
        est_s: seconds one ``harness faults check`` run of it takes with its ``suites`` (real server
            stacks included) on the 2-core CPU runner, as last measured (the check prints each run's);
            the check hands the longest runs out first. 0: not known.
    """

    name: str
    description: str
    upstream: str
    evidence: tuple[str, ...] = ()
    suites: tuple[str, ...] = ()
    target: str = ""
    make: Callable[[Any], Any] | None = None
    requires: tuple[str, ...] = ()
    sglang_checks: str = ""
    est_s: float = 0.0
    env: tuple[tuple[str, str], ...] = ()
    fired_log: str = ""

    @property
    def is_patch(self) -> bool:
        """A source-patch fault (no runtime target, no hook variable): ``harness/faults/patches/<name>.diff``."""
        return self.make is None and not self.env
