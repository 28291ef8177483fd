"""Resolve parsed specs against the registry: which files and tests the user meant.

A bare name must match exactly one registered file (none → close matches; several → the
candidates). A path is taken relative to the repository, then to each suites root; an absolute path
must lie inside the repository or a ``--suites-dir``. ``file::Class::test`` must name a test the file
declares. Every failure is a :class:`ResolveError` with one line saying what to do.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from harness.rerun.collector import Registry
from harness.rerun.registry import SuiteFile, TestEntry, counterparts
from harness.rerun.spec_grammar import Spec


class ResolveError(ValueError):
    """A spec names no registered suite/test, or several. One line."""


@dataclass(frozen=True)
class Selection:
    """Tests chosen from one suite file.

    Attributes:
        suite: the file.
        tests: the chosen tests (all of the file's for a whole-file spec).
        param: a parametrize id (``[p1]``) when the spec named one, else ``""``.
        whole: True when the whole file was asked for.
    """

    suite: SuiteFile
    tests: tuple[TestEntry, ...]
    param: str = ""
    whole: bool = False


def _inside(path: Path, base: Path) -> bool:
    try:
        path.resolve().relative_to(base.resolve())
        return True
    except ValueError:
        return False


def find_file(spec: Spec, reg: Registry) -> SuiteFile:
    """The registered file a spec's path part names.

    Raises:
        ResolveError: no such registered file, several for a bare name, or a path outside the trees.
    """
    if spec.is_bare:
        hits = reg.by_name(spec.path)
        if len(hits) == 1:
            return hits[0]
        if hits:
            listed = ", ".join(h.rel for h in hits)
            raise ResolveError(f"{spec.path!r} matches {len(hits)} files: {listed}; give the path of the one you mean")
        names = sorted({f.name for f in reg.files})
        close = difflib.get_close_matches(spec.path, names, n=5, cutoff=0.5)
        hint = f"close matches: {', '.join(close)}" if close else "list the suites with `rerun-test --list`"
        raise ResolveError(
            f"no suite file named {spec.path!r} under {', '.join(r.prefix + '/' for r in reg.roots)}; {hint}"
        )
    candidates: list[Path] = []
    p = Path(spec.path)
    if p.is_absolute():
        if not any(_inside(p, base) for base in (reg.repo_root, *(r.path for r in reg.roots))):
            raise ResolveError(
                f"{spec.path!r} is outside the repository and the --suites-dir trees; name a suite file inside them"
            )
        candidates.append(p)
    else:
        candidates.append(reg.repo_root / p)
        for root in reg.roots:
            candidates.append(root.path / p)
            first, _, rest = spec.path.partition("/")
            if first == root.prefix and rest:
                candidates.append(root.path / rest)
    for c in candidates:
        if c.is_file() and any(_inside(c, r.path) for r in reg.roots):
            hit = reg.by_path(c)
            if hit is not None:
                return hit
    for c in candidates:
        if c.is_file():
            raise ResolveError(
                f"{spec.path!r} is not a registered suite file (test_*.py under suites/ or a --suites-dir); "
                "move it there or name another"
            )
    close = difflib.get_close_matches(spec.path, [f.rel for f in reg.files], n=5, cutoff=0.5)
    hint = f"close matches: {', '.join(close)}" if close else "list the suites with `rerun-test --list`"
    raise ResolveError(f"no suite file {spec.path!r}; {hint}")


def resolve_one(spec: Spec, reg: Registry) -> Selection:
    """Resolve one spec to a :class:`Selection`.

    Raises:
        ResolveError: see :func:`find_file`; or the test named after ``::`` does not exist; or the
            file's registration is unusable (an unmapped upstream suite, an unparsable file).
    """
    suite = find_file(spec, reg)
    if suite.error:
        raise ResolveError(suite.error)
    if not spec.names:
        return Selection(suite=suite, tests=suite.tests, whole=True)
    n = len(spec.names)
    tests = tuple(t for t in suite.tests if t.names[:n] == spec.names)
    if not tests:
        known = [t.suffix.lstrip(":") for t in suite.tests] + list(suite.classes)
        wanted = "::".join(spec.names)
        close = difflib.get_close_matches(wanted, known, n=5, cutoff=0.5)
        hint = f"close matches: {', '.join(close)}" if close else f"it has: {', '.join(known[:8]) or 'no tests'}"
        raise ResolveError(f"{suite.rel} has no test {wanted!r}; {hint}")
    if spec.param and len(tests) != 1:
        raise ResolveError(f"{spec.text!r}: a parametrize id needs one test function, not a class; add ::test_name")
    return Selection(suite=suite, tests=tests, param=spec.param)


def resolve(specs: list[Spec], reg: Registry) -> list[Selection]:
    """Resolve every spec (all must resolve).

    Returns:
        Selections in spec order.

    Raises:
        ResolveError: the first spec that does not resolve.
    """
    return [resolve_one(s, reg) for s in specs]


def everything(reg: Registry) -> list[Selection]:
    """The default run: every registered file with tests (upstream-disabled ones left out).

    A file in which no test is visible statically (a helper named ``test_*.py``) is left out: run
    by itself it would collect nothing and fail the run.

    Raises:
        ResolveError: a registered file's registration is unusable.
    """
    out = []
    for f in reg.files:
        if f.disabled:
            continue
        if f.error:
            raise ResolveError(f.error)
        if not f.tests:
            continue
        out.append(Selection(suite=f, tests=f.tests, whole=True))
    return out


def with_counterparts(selections: list[Selection], reg: Registry) -> tuple[list[Selection], list[tuple[str, str]]]:
    """Add, for every whole-file selection, the files it pairs with (:data:`harness.rerun.registry.PAIRS`).

    Re-running a simulated PD suite by name also runs the real server-stack suites covering the
    same behaviour, and the other way round. A spec naming single tests pairs with nothing.

    Args:
        selections: resolved selections.
        reg: the registry.

    Returns:
        The selections with the counterparts appended (each file once), and ``(added, because_of)``
        display paths for every file added.
    """
    out = list(selections)
    chosen = {sel.suite.rel for sel in selections}
    added: list[tuple[str, str]] = []
    for sel in selections:
        if not sel.whole:
            continue
        for rel in counterparts(sel.suite.rel):
            other = reg.by_rel(rel)
            if other is None or rel in chosen or other.error or not other.tests:
                continue
            chosen.add(rel)
            out.append(Selection(suite=other, tests=other.tests, whole=True))
            added.append((rel, sel.suite.rel))
    return out, added


def only_engine(selections: list[Selection], engine: str) -> list[Selection]:
    """Keep only the tests of ``engine`` (``sim`` or ``sglang-server``; ``all`` keeps everything).

    A selection left without tests is dropped; one that had none to begin with (nothing visible
    statically) is kept, its engine unknown.
    """
    if engine == "all":
        return list(selections)
    out = []
    for sel in selections:
        tests = tuple(t for t in sel.tests if t.engine == engine)
        if tests or not sel.tests:
            whole = sel.whole and len(tests) == len(sel.tests)
            out.append(Selection(suite=sel.suite, tests=tests, param=sel.param, whole=whole))
    return out
