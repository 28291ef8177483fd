"""The same mutants against sglang's own tests: what the harness adds over the engine's unit tests.

When the target is a checkout, sglang's CPU-registered unit tests that import a mutated module run on each
of its mutants through the same scratch copy and fork; their verdicts sit beside the harness's. Detail:
docs/modules.md.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Callable, Sequence

from harness.mutation.operators import Mutant
from harness.mutation.run import Verdict, in_pool, pytest_command
from harness.report import junit
from harness.engines import fork_preload
from harness.workers import childpytest, procs


def checkout_tests(tree: Path) -> Path | None:
    """``<repo>/test/registered`` for a target tree ``<repo>/python``; None when there is none."""
    registered = tree.parent / "test" / "registered"
    return registered if registered.is_dir() else None


def imported_modules(source: str) -> set[str]:
    """Every module a file imports, and the parents named by ``from X import Y`` (``X.Y`` too).

    >>> sorted(imported_modules("from sglang.srt.disaggregation import decode\\nimport sglang.srt.x as y\\n"))
    ['sglang.srt.disaggregation', 'sglang.srt.disaggregation.decode', 'sglang.srt.x']
    """
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def module_of(path: str) -> str:
    """``sglang/srt/x/y.py`` -> ``sglang.srt.x.y``."""
    return path.removesuffix(".py").replace("/", ".")


def tests_by_module(files: Sequence[Path], mutants: Sequence[Mutant]) -> dict[str, list[str]]:
    """For each mutated module, the upstream files (of ``files``) that import it."""
    modules = {module_of(m.path) for m in mutants}
    found: dict[str, list[str]] = {mod: [] for mod in modules}
    for f in files:
        try:
            imports = imported_modules(f.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for mod in modules:
            if mod in imports:
                found[mod].append(str(f))
    return found


def failing_clean(files: Sequence[Path], out: Path, root: Path, timeout_s: float) -> set[str]:
    """The files (of ``files``) with a test that fails on the unmutated target: their kills would mean
    nothing, so they are left out (and said so)."""
    if not files:
        return set()
    junit_path = out / "upstream" / "clean.xml"
    junit_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = pytest_command([str(f) for f in files], junit_path, out / "upstream" / "pytest-clean", first_failure=False)
    argv, env = fork_preload.python_command(cmd, childpytest.environment())
    procs.run_logged(argv, cwd=root, env=env, log=out / "upstream" / "clean.log", timeout_s=timeout_s)
    cases = junit.read_junit(junit_path, root) if junit_path.exists() else []
    if not cases:  # nothing readable (a crash in collection): none of them can judge a mutant
        return {str(f) for f in files}
    bad = {c.file for c in cases if c.outcome in ("failed", "error")}
    return {str(f) for f in files if any(str(f).endswith(b) for b in bad if b)}


def run_upstream(
    mutants: Sequence[Mutant],
    files: Sequence[Path],
    out: Path,
    root: Path,
    tree: Path,
    *,
    jobs: int,
    timeout_s: float,
    on_done: Callable[[Verdict, int, int], None] = lambda v, d, n: None,
) -> list[Verdict]:
    """Every mutant against the upstream files importing its module, ``jobs`` at a time."""
    by_module = tests_by_module(files, mutants)
    return in_pool(
        [(m, by_module.get(module_of(m.path), [])) for m in mutants],
        out / "upstream",
        root,
        tree,
        jobs=jobs,
        timeout_s=timeout_s,
        on_done=on_done,
    )
