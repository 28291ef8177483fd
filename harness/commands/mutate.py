"""``harness mutate``: the mutation score of the sglang code under test.

Parses, checks and chooses the functions, then runs :func:`harness.mutation.flow.mutate`. Bad input (a function
the target lacks, a bad BASE, no mutant): one line, exit 2, nothing run. Exit 0 when the run finished (whatever
the score), 1 when the candidate tests fail on the unmutated target or a mutant's run failed. Examples and the
flow: docs/modules.md.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from harness import rundir
from harness.changes.lines import ChangeError
from harness.commands import UsageError
from harness.mutation import DEFAULT_FUNCTIONS, flow, upstream_tests
from harness.mutation import select as choose
from harness.rerun import changed as change_of
from harness.rerun import comment
from harness.rerun import upstream as registrations
from harness.targets.sglang import selection as sglang_target

#: The candidate tests by default: the suites that run sglang's real prealloc, eviction and free paths in
#: the test's own process (each mutant's tests are the candidates whose coverage reached its lines).
DEFAULT_TESTS = ("suites/unit",)
PROG = flow.PROG


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mutate", help="mutation score of the sglang functions under test (killed / survived)")
    p.add_argument("--sglang", metavar="TARGET", help=sglang_target.HELP)
    p.add_argument(
        "--function",
        action="append",
        default=[],
        metavar="MODULE:QUALNAME",
        help="a function to mutate (repeatable; default: the PD prealloc / SWA set)",
    )
    p.add_argument(
        "--changed",
        metavar="BASE",
        help="mutate the functions whose lines differ from BASE (as rerun-test --changed), only on the changed lines",
    )
    p.add_argument(
        "--tests",
        action="append",
        default=[],
        metavar="PATH",
        help=f"candidate test files or directories (repeatable; default: {' '.join(DEFAULT_TESTS)})",
    )
    p.add_argument("--limit", type=int, metavar="N", help="at most N mutants, spread over functions and operators")
    p.add_argument("--jobs", type=int, default=2, help="mutants at a time (default 2)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S", help="seconds per mutant run (default 300)")
    p.add_argument("--run-dir", type=Path, help="where results go (default runs/mutate-<timestamp>-<pid>)")
    p.add_argument(
        "--compare-upstream",
        action="store_true",
        help="also run sglang's own register_cpu_ci unit tests (the target checkout's test/registered/) "
        "that import a mutated module on the same mutants, and print both scores",
    )
    p.add_argument(
        "--comment-out",
        type=Path,
        metavar="FILE",
        help="keep the bot's status line (done / total, then the score) in this markdown file",
    )
    p.add_argument("--repo-root", type=Path, default=rundir.REPO_ROOT, help=argparse.SUPPRESS)
    p.set_defaults(func=_mutate)


def _comment(path: Path | None, text: str) -> None:
    if path is not None:
        comment.write_note(path, "mutation", text)


def _upstream_files(target: sglang_target.Target, tree: Path) -> list[Path]:
    """The CPU-registered unit test files of the target's checkout (``--compare-upstream``).

    Raises:
        UsageError: the target is no checkout with ``test/registered/`` (wheels and releases ship none).
    """
    registered = upstream_tests.checkout_tests(tree)
    if registered is None:
        raise UsageError(
            f"--compare-upstream: {target.label()} has no test/registered/ beside its sglang/ "
            "(releases and wheels do not ship sglang's tests); pass a checkout's python/ directory"
        )
    files = []
    for path in sorted(registered.rglob("test_*.py")):
        try:
            regs = registrations.read_registrations(
                ast.parse(path.read_text(encoding="utf-8", errors="replace")), str(path)
            )
        except (SyntaxError, registrations.RegistryError):
            continue
        if any(r.backend == "cpu" and not r.disabled for r in regs):
            files.append(path)
    if not files:
        raise UsageError(f"--compare-upstream: no register_cpu_ci test file under {registered}")
    return files


def _mutate(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit {args.limit}: must be ≥ 1 mutants")
    if args.jobs < 1 or args.timeout <= 0:
        raise UsageError("--jobs must be ≥ 1 and --timeout > 0 seconds")
    if args.changed and args.function:
        raise UsageError("--changed and --function both choose the functions; pass one of them")
    root = args.repo_root.resolve()
    for t in args.tests:
        if not (root / t).exists():
            raise UsageError(f"--tests {t}: no such file or directory under {root}")
    try:
        target = sglang_target.select_for_cli(args.sglang, PROG)
    except sglang_target.TargetError as e:
        raise UsageError(str(e)) from None
    tree = Path(target.root).resolve()
    upstream_files = _upstream_files(target, tree) if args.compare_upstream else None
    lines = None
    try:
        if args.changed:
            change = change_of.read_change(target, args.changed)
            funcs = choose.changed(change, tree)
            lines = change.lines
            if not funcs:
                raise UsageError(
                    f"--changed {args.changed}: the change touches no function of sglang/ "
                    f"({len(change.files)} file(s) changed); nothing to mutate"
                )
        else:
            funcs = choose.named(args.function or list(DEFAULT_FUNCTIONS), tree)
    except (ChangeError, choose.SelectError) as e:
        raise UsageError(str(e)) from None
    mutants = choose.mutants(funcs, tree, args.limit, lines)
    if not mutants:
        raise UsageError("the chosen functions have no mutant (no operator applies to them)")
    out = (args.run_dir or rundir.default_path(root / rundir.RUNS, kind="mutate")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tests = tuple(args.tests) or DEFAULT_TESTS
    print(
        f"{PROG}: {len(mutants)} mutant(s) of {len(funcs)} function(s) on {target.label()}; candidates "
        f"{' '.join(tests)}; run dir {out}",
        flush=True,
    )
    return flow.mutate(
        mutants,
        target,
        tests,
        out,
        root,
        command=["harness", *getattr(args, "argv", [])],
        jobs=args.jobs,
        timeout_s=args.timeout,
        upstream_files=upstream_files,
        note=lambda text: _comment(args.comment_out, text),
    )
