"""The changed lines of a target tree, and the function each one lies in.

A change is ``git diff`` of a source tree against a rev (uncommitted and untracked files included), or two
release trees compared file by file; only Python files of ``sglang/`` count. Not diff-cover, because the
change may come from two trees without git and must join per-test data. Detail: docs/modules.md.
"""

from __future__ import annotations

import ast
import difflib
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "sglang"
_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class ChangeError(ValueError):
    """The change cannot be read: not a git checkout, an unknown rev, a base tree without ``sglang/``."""


@dataclass(frozen=True)
class Change:
    """The changed lines of a target, per file.

    Attributes:
        base: what the target was compared against (a git rev, or a base tree's label).
        lines: ``sglang/...`` path -> the changed line numbers of the target's file (1-based; a pure
            deletion marks no line of the new file and counts in ``deleted``).
        deleted: path -> how many lines the change deleted there without replacing them.
    """

    base: str
    lines: dict[str, frozenset[int]]
    deleted: dict[str, int]

    @property
    def files(self) -> list[str]:
        return sorted(set(self.lines) | set(self.deleted))


def parse_unified(text: str) -> tuple[dict[str, set[int]], dict[str, int]]:
    """The added-or-replaced lines (new-file numbers) and pure deletions of a ``-U0`` unified diff.

    >>> diff = "+++ b/sglang/a.py\\n@@ -3,0 +4,2 @@\\n+x\\n+y\\n@@ -9 +11 @@\\n-a\\n+b\\n"
    >>> lines, deleted = parse_unified(diff + "@@ -20,2 +21,0 @@\\n-c\\n-d\\n")
    >>> sorted(lines["sglang/a.py"]), deleted
    ([4, 5, 11], {'sglang/a.py': 2})
    """
    lines: dict[str, set[int]] = {}
    deleted: dict[str, int] = {}
    path: str | None = None
    for line in text.splitlines():
        if line.startswith("+++ "):
            name = line[4:].strip().split("\t")[0]
            path = None if name == "/dev/null" else name.removeprefix("b/")
            continue
        m = _HUNK.match(line)
        if m and path is not None:
            old_count, start, count = (int(g) if g is not None else 1 for g in m.groups())
            if count:
                lines.setdefault(path, set()).update(range(start, start + count))
            elif old_count:
                deleted[path] = deleted.get(path, 0) + old_count
    return lines, deleted


def source_lines(text: str) -> list[str]:
    """The lines of a source file as Python and git number them: split at ``\\n`` only, ends kept
    (``str.splitlines`` also splits at form feeds and other separators a source may hold in a string,
    which would shift every line number after it).

    >>> source_lines("a = '\\x0c'\\nb = 2\\n")
    ["a = '\\x0c'\\n", 'b = 2\\n']
    """
    return [line for line in re.split(r"(?<=\n)", text) if line]


def statement_starts(source: str) -> dict[int, int]:
    """Each line of a module -> the first line of the innermost statement it belongs to (a compound
    statement's header lines map to its first line, its body's lines to their own statements).
    Coverage data and executable-line sets name a statement by its first line only: a changed line in
    the middle of a multi-line call counts as that call.

    >>> starts = statement_starts("x = f(\\n    1,\\n)\\nif (a and\\n        b):\\n    y = 2\\n")
    >>> [starts[n] for n in range(1, 7)]
    [1, 1, 1, 4, 4, 6]
    """
    stmts = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.stmt)]
    starts: dict[int, int] = {}
    for node in sorted(stmts, key=lambda n: (n.end_lineno or n.lineno) - n.lineno, reverse=True):
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
            starts[line] = node.lineno
    return starts


def _python_file(rel: str) -> bool:
    return rel.startswith(f"{PACKAGE}/") and rel.endswith(".py")


def from_git(root: Path, rev: str) -> Change:
    """The lines of ``root/sglang`` (working tree, untracked files included) that differ from ``rev``.

    Args:
        root: the directory holding ``sglang/``, inside a git checkout.
        rev: any git revision of that checkout (a branch, a tag, ``HEAD~1``, a commit).

    Raises:
        ChangeError: ``root`` is not in a git checkout, or ``rev`` is not a revision of it.
    """

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ChangeError(f"git {args[0]} in {root}: {exc}") from None
        if done.returncode:
            raise ChangeError(
                f"git {' '.join(args[:3])} in {root}: {done.stderr.strip().splitlines()[-1:] or ['failed']}"[:300]
            )
        return done.stdout

    try:
        git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except ChangeError:
        raise ChangeError(
            f"--changed {rev}: not a revision of the git checkout holding {root}; "
            "pass a branch, tag or commit of it (or, for a release target, another release)"
        ) from None
    diff = git("diff", "--relative", "--unified=0", "--no-color", "--no-ext-diff", rev, "--", PACKAGE)
    found, deleted = parse_unified(diff)
    lines = {p: frozenset(v) for p, v in found.items() if _python_file(p)}
    for rel in git("ls-files", "--others", "--exclude-standard", "--", PACKAGE).splitlines():
        if _python_file(rel):
            n = len(source_lines((root / rel).read_text(encoding="utf-8", errors="replace")))
            lines[rel] = frozenset(range(1, n + 1))
    return Change(rev, lines, {p: n for p, n in deleted.items() if _python_file(p)})


def between_trees(root: Path, base_root: Path, label: str) -> Change:
    """The lines of ``root/sglang`` that differ from ``base_root/sglang`` (a file only in ``root``: all
    of it), compared as text line by line (:mod:`difflib`).

    Args:
        root: the target's tree.
        base_root: the base's tree (e.g. the previous release).
        label: what the base is, for the report (``sglang 0.5.22``).

    Raises:
        ChangeError: ``base_root`` holds no ``sglang/`` package.
    """
    base_pkg, pkg = base_root / PACKAGE, root / PACKAGE
    if not base_pkg.is_dir():
        raise ChangeError(f"--changed {label}: {base_root} holds no sglang/ package")
    lines: dict[str, frozenset[int]] = {}
    deleted: dict[str, int] = {}
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "/__pycache__/" in rel:
            continue
        new = source_lines(path.read_text(encoding="utf-8", errors="replace"))
        other = base_root / rel
        old = source_lines(other.read_text(encoding="utf-8", errors="replace")) if other.is_file() else []
        if old == new:
            continue
        changed: set[int] = set()
        gone = 0
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
            if tag in ("replace", "insert"):
                changed.update(range(j1 + 1, j2 + 1))
            elif tag == "delete":
                gone += i2 - i1
        if changed:
            lines[rel] = frozenset(changed)
        if gone:
            deleted[rel] = gone
    return Change(label, lines, deleted)


def functions(source: str) -> list[tuple[str, int, int]]:
    """Every function of a module as ``(qualname, first line, last line)``, decorators included, the
    innermost after the ones around it.

    >>> functions("class A:\\n    def f(self):\\n        pass\\n\\ndef g():\\n    return 1\\n")
    [('A.f', 2, 3), ('g', 5, 6)]
    """
    out: list[tuple[str, int, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                out.append((f"{prefix}{child.name}", start, child.end_lineno or child.lineno))
                walk(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return out


def function_of(spans: list[tuple[str, int, int]], line: int) -> str:
    """The innermost function of ``spans`` (:func:`functions`) holding ``line``; ``<module>`` outside any."""
    best = "<module>"
    size = None
    for name, start, end in spans:
        if start <= line <= end and (size is None or end - start < size):
            best, size = name, end - start
    return best
