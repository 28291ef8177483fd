"""The changed-line table: per file and function, how many of the changed executable lines the run
executed, which it never did, and which tests ran each line (:func:`changed_coverage`); rendered for
``summary.md`` (:func:`markdown`), ``summary.json`` (:meth:`ChangedCoverage.to_json`) and the one
line of the bot's comment (:meth:`ChangedCoverage.line`).

How a line is attributed to a test or a group: docs/modules.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from harness.changes.lines import Change, function_of, functions, statement_starts
from harness.changes.measure import Combined


@dataclass
class FunctionRow:
    """The changed lines of one function of one file."""

    path: str
    function: str
    changed: list[int] = field(default_factory=list)  # executable changed lines
    executed: list[int] = field(default_factory=list)
    tests: set[str] = field(default_factory=set)

    @property
    def missed(self) -> list[int]:
        return [n for n in self.changed if n not in set(self.executed)]


@dataclass
class ChangedCoverage:
    """What the run executed of a change."""

    base: str
    rows: list[FunctionRow]
    unmeasured: list[str]
    processes: int
    #: Processes measured up to their last early save (a server's scheduler, saved at each flush).
    partial: list[str] = field(default_factory=list)
    #: Files the change touched with no executable line changed (comments, docstrings, deletions only).
    other_files: list[str] = field(default_factory=list)

    @property
    def changed(self) -> int:
        return sum(len(r.changed) for r in self.rows)

    @property
    def executed(self) -> int:
        return sum(len(r.executed) for r in self.rows)

    def line(self) -> str:
        """One line: ``changed lines executed: 7 of 9 (vs main; 2 never: sglang/x.py:12, 14)``."""
        if not self.changed:
            return f"changed lines executed: no executable line changed (vs {self.base})"
        missed = [f"{r.path}:{n}" for r in self.rows for n in r.missed]
        tail = f"; never: {', '.join(missed[:4])}{' …' if len(missed) > 4 else ''}" if missed else ""
        lost = f"; {len(self.unmeasured)} process(es) not measured" if self.unmeasured else ""
        lost += f"; {len(self.partial)} partly" if self.partial else ""
        return f"changed lines executed: {self.executed} of {self.changed} (vs {self.base}{tail}{lost})"

    def to_json(self) -> dict:
        return {
            "base": self.base,
            "changed": self.changed,
            "executed": self.executed,
            "processes": self.processes,
            "not_measured": self.unmeasured,
            "partly_measured": self.partial,
            "other_files": self.other_files,
            "functions": [
                {
                    "path": r.path,
                    "function": r.function,
                    "changed": r.changed,
                    "executed": r.executed,
                    "never": r.missed,
                    "tests": sorted(r.tests),
                }
                for r in self.rows
            ],
        }


def _tests_of(contexts: set[str]) -> set[str]:
    out = set()
    for ctx in contexts:
        if not ctx:
            continue
        group, _, test = ctx.partition("|")
        out.add(test if test else f"{group} (its servers and workers)")
    return out


def changed_coverage(change: Change, combined: Combined, root: Path, statements) -> ChangedCoverage:
    """Join a change with what the run executed.

    Args:
        change: the changed lines (:mod:`harness.changes.lines`).
        combined: the run's measurement read back (:meth:`harness.changes.measure.Measurement.combine`).
        root: the target's tree.
        statements: ``rel -> executable lines`` (:meth:`~harness.changes.measure.Measurement.statements`).
    """
    rows: list[FunctionRow] = []
    other: list[str] = []
    for rel in change.files:
        lines = sorted(change.lines.get(rel, ()))
        path = root / rel
        if not lines or not path.is_file():
            other.append(rel)
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            spans = functions(source)
            stmts = statements(rel)
            starts = statement_starts(source)
        except SyntaxError:
            other.append(rel)
            continue
        ran = combined.lines.get(rel, {})
        by_fn: dict[str, FunctionRow] = {}
        for n in lines:
            first = starts.get(n, n)  # a line inside a multi-line statement counts as that statement
            if first not in stmts:
                continue
            fn = function_of(spans, n)
            row = by_fn.setdefault(fn, FunctionRow(rel, fn))
            row.changed.append(n)
            if first in ran:
                row.executed.append(n)
                row.tests |= _tests_of(ran[first])
        if not by_fn:
            other.append(rel)
        rows.extend(by_fn.values())
    unmeasured = [f"pid {p.pid}: {p.what()}" for p in combined.unmeasured]
    partial = [f"pid {p.pid}: {p.what()}" for p in combined.partial]
    return ChangedCoverage(change.base, rows, unmeasured, len(combined.processes), partial, other)


def _ranges(lines: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``3-5, 9``."""
    out: list[str] = []
    for n in lines:
        if out and out[-1].split("-")[-1] == str(n - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ", ".join(out)


def table_rows(cov: ChangedCoverage) -> list[list[str]]:
    """Rows of the report table: file, function, executed of changed, never executed, tests."""
    return [
        [
            r.path,
            r.function,
            f"{len(r.executed)} of {len(r.changed)}",
            _ranges(r.missed) or "-",
            ", ".join(sorted(r.tests)[:6]) + (" …" if len(r.tests) > 6 else ""),
        ]
        for r in cov.rows
    ]


HEAD = ["file", "function", "changed lines executed", "never executed", "tests that ran them"]


def markdown(cov: ChangedCoverage) -> str:
    """The section of ``summary.md``."""
    out = [f"### Changed lines of sglang (vs {cov.base})", "", cov.line(), ""]
    if cov.rows:
        out += ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
        out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in table_rows(cov)]
        out.append("")
    if cov.unmeasured:
        out += [
            f"Not measured (the process left no data: killed by SIGKILL or died hard; its lines are unknown, "
            f"not unexecuted): {'; '.join(cov.unmeasured)}",
            "",
        ]
    if cov.partial:
        out += [
            f"Partly measured (saved at a cache flush, then killed by its server: what it ran after its last "
            f"flush is unknown): {'; '.join(cov.partial)}",
            "",
        ]
    if cov.other_files:
        out += [f"Changed with no executable line changed: {', '.join(cov.other_files)}", ""]
    return "\n".join(out)
