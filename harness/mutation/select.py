"""Which functions to mutate and which mutants to run: ``MODULE:QUALNAME`` names, the functions a change
touches, and a deterministic choice of at most N mutants spread over functions and operators."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Sequence

from harness.changes.lines import Change, function_of, functions
from harness.mutation.operators import Mutant, find_function, mutants_of


class SelectError(ValueError):
    """A function name that does not name a function of the target: one line with what to pass."""


def module_path(module: str) -> str:
    """``sglang.srt.x.y`` -> ``sglang/srt/x/y.py``.

    >>> module_path("sglang.srt.disaggregation.decode")
    'sglang/srt/disaggregation/decode.py'
    """
    return module.replace(".", "/") + ".py"


def named(specs: Sequence[str], tree: Path) -> list[tuple[str, str]]:
    """``MODULE:QUALNAME`` -> ``(path, qualname)``, each checked against the target's source.

    Raises:
        SelectError: a malformed name, a module not in the target, or no such function in it.
    """
    out = []
    for spec in specs:
        module, sep, qualname = spec.partition(":")
        if not sep or not module.startswith("sglang") or not qualname:
            raise SelectError(
                f"--function {spec!r}: write MODULE:QUALNAME, e.g. "
                "sglang.srt.disaggregation.decode:DecodePreallocQueue._swa_tail_len"
            )
        path = module_path(module)
        if not (tree / path).is_file():
            raise SelectError(f"--function {spec}: the target has no module {module} ({path} is not in {tree})")
        if find_function(ast.parse((tree / path).read_text(encoding="utf-8")), qualname) is None:
            raise SelectError(f"--function {spec}: {module} has no function {qualname} in this target")
        out.append((path, qualname))
    return out


def changed(change: Change, tree: Path) -> list[tuple[str, str]]:
    """The functions holding a changed line of ``change`` (module-level lines are not functions)."""
    out: list[tuple[str, str]] = []
    for rel in sorted(change.lines):
        path = tree / rel
        if not path.is_file():
            continue
        try:
            spans = functions(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for n in sorted(change.lines[rel]):
            fn = function_of(spans, n)
            if fn != "<module>" and "<locals>" not in fn and (rel, fn) not in out:
                out.append((rel, fn))
    return out


def mutants(
    funcs: Sequence[tuple[str, str]],
    tree: Path,
    limit: int | None = None,
    lines: dict[str, frozenset[int]] | None = None,
) -> list[Mutant]:
    """The mutants of ``funcs``; with ``lines``, only those touching those lines of their file; with
    ``limit``, at most that many, taken round-robin over functions and within each over operators (the
    same choice every time)."""
    per_fn: list[list[Mutant]] = []
    for path, qualname in funcs:
        ms = mutants_of((tree / path).read_text(encoding="utf-8"), path, qualname)
        if lines is not None:
            wanted = lines.get(path, frozenset())
            ms = [m for m in ms if any(n in wanted for n in range(m.line, m.end_line + 1))]
        by_op: dict[str, list[Mutant]] = {}
        for m in ms:
            by_op.setdefault(m.operator, []).append(m)
        spread: list[Mutant] = []
        queues = list(by_op.values())
        while any(queues):
            for q in queues:
                if q:
                    spread.append(q.pop(0))
        per_fn.append(spread)
    out: list[Mutant] = []
    while any(per_fn) and (limit is None or len(out) < limit):
        for q in per_fn:
            if q and (limit is None or len(out) < limit):
                out.append(q.pop(0))
    return out
