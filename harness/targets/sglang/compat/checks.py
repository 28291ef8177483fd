"""sglang's own runtime checks, turned on as a second oracle beside the harness's ledger.

Every server and simulated rank runs with each off-by-default check the target has on (:func:`environment`);
a failure one raised is evidence of its own class (``sglang-check``, :func:`hit`), attributed to sglang's
oracle. What a target has is read from its source (:func:`present`). No library: nothing outside sglang
knows these switches. Detail: docs/modules.md.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from harness.targets.sglang.releases import source_text

#: Env var choosing which of sglang's checks the harness turns on: unset or ``all`` (the default),
#: ``0`` / ``off`` (every one off, sglang's default-on idle check included: a person bisecting whether
#: a failure is the checks' own), or a comma list of names: those on, the others off (a test proving
#: one check fires turns on only that one, so no check that fires earlier preempts it).
SELECT_ENV = "HARNESS_SGLANG_CHECKS"


class UnknownCheck(ValueError):
    """``HARNESS_SGLANG_CHECKS`` names a check that does not exist."""


@dataclass(frozen=True)
class EngineCheck:
    """One of sglang's own checks.

    Attributes:
        name: the harness's name for it (in headlines, reports and ``run.json``).
        env: the variable sglang reads.
        value: the value that turns it on at its strictest.
        what: one line saying what it checks and where.
        hits: regular expressions of how a hit reads (the first group, when there is one, names what
            broke: an invariant's name, a pool).
        contracts: names that must appear in the target's source for the check to mean what the
            harness relies on (``(file under srt/, text)``); a target lacking one has the check only in
            part, said by :func:`present`.
        off: the value that turns it off.
    """

    name: str
    env: str
    value: str
    what: str
    hits: tuple[str, ...]
    contracts: tuple[tuple[str, str], ...] = field(default=())
    off: str = "0"


CHECKS: tuple[EngineCheck, ...] = (
    EngineCheck(
        "invariant-strict",
        "SGLANG_INVARIANT_CHECK",
        "2",
        "sglang's named invariants at level strict (srt/utils/invariants.py): a broken GUARD or FATAL "
        "invariant raises, e.g. swa.peer_mapped / swa.peer_released on every SWA free (the variable first "
        "in 0.5.17, those two SWA contracts in 0.5.20: 0.5.16 lacks the check, 0.5.17 … 0.5.19 have it "
        "without them)",
        (r"invariant-check FAILED \[([\w.]+)\]", r"invariant-check \[([\w.]+)@rank\d+\]: \+\d+ hit"),
        (("mem_cache/allocator/swa.py", '"swa.peer_mapped"'), ("mem_cache/allocator/swa.py", '"swa.peer_released"')),
    ),
    EngineCheck(
        "mem-check-busy",
        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY",
        "1",
        "the scheduler's pool identity after every busy step (available + evictable + protected + held "
        "+ uncached == total), asserted; sglang 0.5.23 runs it in its plain scheduler loops only, not "
        "in the PD prefill and decode loops",
        (r"(Full|SWA) Pool Mem Leak Detected!",),
    ),
    EngineCheck(
        "mem-check-idle",
        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE",
        "1",
        "the scheduler's pool and request-slot identities whenever it is idle, raised (on by default)",
        (r"(\w+) memory leak detected!",),
    ),
    EngineCheck(
        "kv-page-invariants",
        "SGLANG_CHECK_KV_PAGE_INVARIANTS",
        "1",
        "no owner references a free page and no page is free twice, after every busy step (inside "
        "the busy check: plain servers only in sglang 0.5.23)",
        (r"KV (double free)", r"KV page (use-after-free)"),
    ),
    EngineCheck(
        "debug-memory-pool",
        "SGLANG_DEBUG_MEMORY_POOL",
        "1",
        "the paged allocator's own asserts: page-aligned allocation sizes, contiguous last locations, "
        "unique handed-out indices, no page free twice (bare asserts: the traceback's frame or source line "
        "names them), SWA pages matching their full peers",
        (
            r"The allocation size should be (page-aligned)",
            r"\bin _debug_check_(no_duplicate_pages)\b",
            r"assert len\(torch\.unique\((out_indices)\)\) == len\(out_indices\)",
            r"(swa pages do not match the mapped pages)",
            r"(expansion page set mismatch)",
        ),
    ),
)

_COMPILED = tuple((check, tuple(re.compile(p) for p in check.hits)) for check in CHECKS)


def selected() -> tuple[EngineCheck, ...]:
    """The checks ``HARNESS_SGLANG_CHECKS`` selects (every one by default).

    Raises:
        UnknownCheck: it names a check that does not exist (the message lists the known ones).
    """
    value = os.environ.get(SELECT_ENV, "").strip().lower()
    if value in ("", "1", "all", "on"):
        return CHECKS
    if value in ("0", "off", "none"):
        return ()
    by_name = {c.name: c for c in CHECKS}
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise UnknownCheck(
            f"{SELECT_ENV}={value!r}: no sglang check named {', '.join(unknown)}; "
            f"known: {', '.join(by_name)} (or all / 0)"
        )
    return tuple(c for c in CHECKS if c.name in names)


def present(root: Path) -> tuple[tuple[EngineCheck, ...], dict[str, str]]:
    """The checks the target at ``root`` has, and why each other one is missing or partial.

    Args:
        root: the directory holding the target's ``sglang/``.

    Returns:
        ``(checks it has, {name: reason})``; a check whose variable the target reads but that lacks a
        contract is in both (it runs, without that contract).
    """
    environ = source_text(root, "environ.py")
    have: list[EngineCheck] = []
    why: dict[str, str] = {}
    for check in CHECKS:
        if check.env not in environ:
            why[check.name] = f"sglang/srt/environ.py has no {check.env}"
            continue
        have.append(check)
        lacking = [text.strip('"') for rel, text in check.contracts if text not in source_text(root, rel)]
        if lacking:
            why[check.name] = f"no {', '.join(lacking)} contract"
    return tuple(have), why


def environment(root: Path | None) -> dict[str, str]:
    """The variables that turn every selected check on and every other one off, for the checks the
    target at ``root`` has (all of them when ``root`` is None: a variable a release does not know is
    one it never reads)."""
    chosen = selected()
    known = CHECKS if root is None else present(root)[0]
    return {check.env: check.value if check in chosen else check.off for check in known}


#: A line that says an exception was raised (``ValueError: ...``, ``AssertionError: ...``).
_RAISED = re.compile(r"^\s*(?:[\w.]+\.)?\w*(?:Error|Exception)\b")


def hit(text: str, among: Sequence[EngineCheck] | None = None) -> tuple[EngineCheck, str, str] | None:
    """The check whose hit ``text`` shows first (an exception message, a log tail), what it names and
    the line it is on, among the checks that are on (``among``; default: this process's
    :func:`selected`, which its servers and ranks inherit).

    A hit on a line that raised wins over one only logged: what stopped the process is the one that
    raised. A check that is off is never named: sglang's idle check, turned off, still warns with its
    message, and a warning of a check nobody turned on is not that check's catch.

    >>> raised = "RuntimeError: invariant-check FAILED [swa.peer_released]: is_true: caller wants free"
    >>> check, what, line = hit("x\\n" + raised)
    >>> check.name, what, line == raised
    ('invariant-strict', 'swa.peer_released', True)
    >>> hit("ValueError: token_to_kv_pool_allocator memory leak detected! available_size=1")[0].name
    'mem-check-idle'
    >>> hit("[12:00] pool memory leak detected! [full]\\nAssertionError: SWA Pool Mem Leak Detected! [swa]")[0].name
    'mem-check-busy'
    >>> check, what, _ = hit('  File "x/paged.py", line 376, in _debug_check_no_duplicate_pages\\nAssertionError')
    >>> check.name, what
    ('debug-memory-pool', 'no_duplicate_pages')
    >>> hit("    assert len(torch.unique(out_indices)) == len(out_indices)\\nAssertionError")[1]
    'out_indices'
    >>> hit("all good") is None
    True
    >>> hit("ValueError: token_to_kv_pool_allocator memory leak detected! available_size=1", among=()) is None
    True
    """
    on = {c.name for c in (selected() if among is None else among)}
    lines = text.splitlines()
    for candidates in ([ln for ln in lines if _RAISED.match(ln)], lines):
        best: tuple[int, int, EngineCheck, str, str] | None = None
        for check, patterns in _COMPILED:
            if check.name not in on:
                continue
            for pattern in patterns:
                for i, line in enumerate(candidates):
                    m = pattern.search(line)
                    if m:
                        found = (i, m.start(), check, m.group(1) if m.groups() else m.group(0), line)
                        if best is None or found[:2] < best[:2]:
                            best = found
                        break
        if best is not None:
            return best[2], best[3], best[4]
    return None


def summary(root: Path | None) -> str:
    """One line for a session header and a run's record: which checks are on, which are missing.

    >>> summary(None).startswith("sglang checks on: invariant-strict")
    True
    """
    chosen = selected()
    if not chosen:
        return f"sglang checks: all off ({SELECT_ENV}=0)"
    if root is None:
        return "sglang checks on: " + ", ".join(c.name for c in chosen)
    have, why = present(root)
    line = "sglang checks on: " + (", ".join(c.name for c in chosen if c in have) or "none")
    why = {name: reason for name, reason in why.items() if any(c.name == name for c in chosen)}
    if why:
        line += "; missing in this target: " + "; ".join(f"{name} ({reason})" for name, reason in why.items())
    return line
