"""The mutation score and its tables: per function, the survivors as diffs, the killers with their evidence.

Score = (killed + timeout) / (killed + timeout + survived + not covered); timeouts are listed apart, and
kills by sglang's own checks are counted apart from the harness's (a catalog of the harness's catches
must not lean on sglang's asserts).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from harness import atomic
from harness.mutation.operators import Mutant, mutate_source
from harness.mutation.run import KILLED, NOT_COVERED, SURVIVED, TIMEOUT, Verdict


@dataclass(frozen=True)
class FunctionScore:
    function: str
    killed: int
    by_sglang: int
    by_crash: int
    timeout: int
    survived: int
    not_covered: int

    @property
    def total(self) -> int:
        return self.killed + self.timeout + self.survived + self.not_covered

    @property
    def score(self) -> float:
        return (self.killed + self.timeout) / self.total if self.total else 0.0


def _name(m: Mutant) -> str:
    """``module:function`` (two modules may hold a function of the same name)."""
    return f"{m.path.removesuffix('.py').replace('/', '.')}:{m.function}"


def per_function(verdicts: Sequence[Verdict]) -> list[FunctionScore]:
    names = list(dict.fromkeys(_name(v.mutant) for v in verdicts))
    out = []
    for name in names:
        vs = [v for v in verdicts if _name(v.mutant) == name]
        count = {k: sum(v.verdict == k for v in vs) for k in (KILLED, TIMEOUT, SURVIVED, NOT_COVERED)}
        out.append(
            FunctionScore(
                name,
                count[KILLED],
                sum(v.oracle == "sglang" for v in vs),
                sum(v.oracle == "crash" for v in vs),
                count[TIMEOUT],
                count[SURVIVED],
                count[NOT_COVERED],
            )
        )
    return out


def total(verdicts: Sequence[Verdict]) -> FunctionScore:
    count = {k: sum(v.verdict == k for v in verdicts) for k in (KILLED, TIMEOUT, SURVIVED, NOT_COVERED)}
    return FunctionScore(
        "all",
        count[KILLED],
        sum(v.oracle == "sglang" for v in verdicts),
        sum(v.oracle == "crash" for v in verdicts),
        count[TIMEOUT],
        count[SURVIVED],
        count[NOT_COVERED],
    )


def diff(m: Mutant, tree: Path) -> str:
    """The mutant as a unified diff of its file (without the marker: what a reviewer reads)."""
    old = (tree / m.path).read_text(encoding="utf-8")
    new = mutate_source(old, m, marker=False)
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{m.path}", f"b/{m.path}", n=2
        )
    )


def line(verdicts: Sequence[Verdict]) -> str:
    """One line for the bot comment: ``mutation score 0.83 (25 killed, 3 by sglang's checks; 5 survived, …)``."""
    t = total(verdicts)
    return (
        f"mutation score {t.score:.2f}: {t.killed} killed ({t.by_sglang} by sglang's own checks, "
        f"{t.by_crash} by a crash), "
        f"{t.timeout} timeout, {t.survived} survived, {t.not_covered} not covered, of {t.total} mutants"
    )


def comment_line(verdicts: Sequence[Verdict], most: int = 5) -> str:
    """:func:`line` and, for the bot comment, the survivors by id (their diffs are in the report)."""
    survivors = [v.mutant.id for v in verdicts if v.verdict == SURVIVED]
    if not survivors:
        return line(verdicts)
    more = f" and {len(survivors) - most} more" if len(survivors) > most else ""
    return f"{line(verdicts)}; survived: {', '.join(survivors[:most])}{more} (diffs in the report)"


HEAD = ("function", "score", "killed", "by sglang's checks", "by a crash", "timeout", "survived", "not covered")


def rows(verdicts: Sequence[Verdict]) -> list[tuple[str, ...]]:
    return [
        (
            s.function,
            f"{s.score:.2f}",
            str(s.killed),
            str(s.by_sglang),
            str(s.by_crash),
            str(s.timeout),
            str(s.survived),
            str(s.not_covered),
        )
        for s in [*per_function(verdicts), total(verdicts)]
    ]


def markdown(verdicts: Sequence[Verdict], tree: Path) -> str:
    out = [
        "### Mutation score of the sglang code under test",
        "",
        line(verdicts),
        "",
        "| " + " | ".join(HEAD) + " |",
        "|" + "---|" * len(HEAD),
    ]
    out += ["| " + " | ".join(r) + " |" for r in rows(verdicts)]
    survivors = [v for v in verdicts if v.verdict == SURVIVED]
    if survivors:
        out += ["", f"#### Survivors ({len(survivors)}): no selected test fails with these", ""]
        for v in survivors:
            fired = "ran" if v.fired else "never ran (the tests reach its line but not the mutated part)"
            out += [
                f"- `{v.mutant.id}` {v.mutant.describe()}; {fired}; tests: {len(v.tests)}",
                "",
                "```diff",
                diff(v.mutant, tree).rstrip(),
                "```",
                "",
            ]
    killed = [v for v in verdicts if v.verdict == KILLED]
    if killed:
        out += ["", "#### Killed", "", "| mutant | by | evidence |", "|---|---|---|"]
        out += [
            f"| `{v.mutant.id}` {v.mutant.describe().replace('|', '/')} | {v.killer} ({v.oracle}) | "
            f"{v.evidence.replace('|', '/')[:200]} |"
            for v in killed
        ]
    return "\n".join(out) + "\n"


def to_json(verdicts: Sequence[Verdict], tree: Path) -> dict:
    t = total(verdicts)
    return {
        "score": round(t.score, 4),
        "killed": t.killed,
        "killed_by_sglang": t.by_sglang,
        "killed_by_crash": t.by_crash,
        "timeout": t.timeout,
        "survived": t.survived,
        "not_covered": t.not_covered,
        "total": t.total,
        "functions": [s.__dict__ | {"score": round(s.score, 4)} for s in per_function(verdicts)],
        "mutants": [
            {
                "id": v.mutant.id,
                "function": v.mutant.function,
                "operator": v.mutant.operator,
                "line": v.mutant.line,
                "describe": v.mutant.describe(),
                "verdict": v.verdict,
                "killer": v.killer,
                "oracle": v.oracle,
                "evidence": v.evidence,
                "fired": v.fired,
                "tests": len(v.tests),
                "seconds": round(v.seconds, 2),
                **({"diff": diff(v.mutant, tree)} if v.verdict == SURVIVED else {}),
            }
            for v in verdicts
        ],
    }


def write(
    out: Path,
    verdicts: Sequence[Verdict],
    tree: Path,
    theirs: Sequence[Verdict] | None = None,
    upstream_files: Sequence[Path] = (),
) -> tuple[Path, Path]:
    """``mutation.md`` and ``mutation.json``; with ``theirs`` (the same mutants against sglang's own
    tests, ``upstream_files``), the comparison in both."""
    md, js = out / "mutation.md", out / "mutation.json"
    text, data = markdown(verdicts, tree), to_json(verdicts, tree)
    if theirs is not None:
        text += "\n" + compare_markdown(verdicts, theirs)
        data["upstream"] = to_json(theirs, tree) | {"files": [str(f) for f in upstream_files]}
    atomic.write_text(md, text)
    atomic.write_json(js, data)
    return md, js


SIDE_HEAD = (
    "function",
    "harness score",
    "harness killed / total",
    "sglang's tests score",
    "sglang's tests killed / total",
)


def side_by_side(ours: Sequence[Verdict], theirs: Sequence[Verdict]) -> list[tuple[str, ...]]:
    """Per function (and all), the harness's score beside sglang's own tests' on the same mutants."""
    a = {s.function: s for s in [*per_function(ours), total(ours)]}
    b = {s.function: s for s in [*per_function(theirs), total(theirs)]}
    return [
        (
            name,
            f"{a[name].score:.2f}",
            f"{a[name].killed + a[name].timeout} / {a[name].total}",
            f"{b[name].score:.2f}" if name in b else "-",
            f"{b[name].killed + b[name].timeout} / {b[name].total}" if name in b else "-",
        )
        for name in a
    ]


def compare_line(ours: Sequence[Verdict], theirs: Sequence[Verdict]) -> str:
    """``harness 0.75 vs sglang's register_cpu_ci unit tests 0.00 (killed by the harness only: 3, …)``."""
    only_ours = sum(a.verdict == KILLED and b.verdict != KILLED for a, b in zip(ours, theirs))
    only_theirs = sum(b.verdict == KILLED and a.verdict != KILLED for a, b in zip(ours, theirs))
    return (
        f"harness {total(ours).score:.2f} vs sglang's register_cpu_ci unit tests {total(theirs).score:.2f} "
        f"(killed by the harness only: {only_ours}, by sglang's tests only: {only_theirs})"
    )


def compare_markdown(ours: Sequence[Verdict], theirs: Sequence[Verdict]) -> str:
    out = [
        "### The same mutants against sglang's own tests",
        "",
        compare_line(ours, theirs),
        "",
        "| " + " | ".join(SIDE_HEAD) + " |",
        "|" + "---|" * len(SIDE_HEAD),
    ]
    out += ["| " + " | ".join(r) + " |" for r in side_by_side(ours, theirs)]
    return "\n".join(out) + "\n"
