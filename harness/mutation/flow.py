"""One mutation run, from the chosen mutants to the score: the runner behind ``harness mutate``.

1. Record the run (``run.json``) in its directory.
2. Map which candidate tests reach which lines (:func:`harness.mutation.run.coverage_map`).
3. Run each mutant's tests (:func:`harness.mutation.run.run_all`), and with ``upstream_files`` the same
   mutants against sglang's own tests (:mod:`harness.mutation.upstream_tests`).
4. Write ``mutation.md`` / ``mutation.json`` and the report page; print the score.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

from harness import runs as run_record
from harness.mutation import run, score, upstream_tests
from harness.mutation.operators import Mutant
from harness.report import page
from harness.targets.sglang import selection as sglang_target

PROG = "harness mutate"


def mutate(
    mutants: Sequence[Mutant],
    target: sglang_target.Target,
    tests: Sequence[str],
    out: Path,
    root: Path,
    *,
    command: Sequence[str],
    jobs: int,
    timeout_s: float,
    upstream_files: Sequence[Path] | None = None,
    note: Callable[[str], None] = lambda text: None,
) -> int:
    """Run ``mutants`` of ``target`` against the candidate ``tests`` and score them, in the run directory ``out``.

    Args:
        root: the repository the tests run in.
        command: the command line the run records.
        jobs: mutants at a time; ``timeout_s``: seconds per mutant run (the coverage map gets four times it).
        upstream_files: sglang's own CPU-registered test files to run the same mutants against (None: no
            comparison).
        note: takes the status line as the run goes (the bot's comment).

    Returns:
        0 the run finished (whatever the score), 1 the candidate tests fail on the unmutated target or the
        harness failed running a mutant (one line said).
    """
    tree = Path(target.root).resolve()
    with run_record.record(out, command, target=target.label()) as rec:
        started = time.monotonic()
        note(f"mutation: mapping which tests reach the {len(mutants)} mutants")
        try:
            cmap = run.coverage_map(tests, out, root, tree, timeout_s * 4)
        except RuntimeError as e:
            print(f"{PROG}: {e}")
            rec.finish("failed")
            return 1
        print(f"{PROG}: coverage map of {len(cmap.tests_seen)} test(s) in {cmap.wall_s:.0f} s", flush=True)

        def on_done(v: run.Verdict, done: int, total: int) -> None:
            by = f" by {v.killer}" if v.killer else ""
            print(
                f"  [{done}/{total}] {v.verdict:11} {v.mutant.id} {v.mutant.describe()}{by} ({v.seconds:.0f} s)",
                flush=True,
            )
            note(f"mutation: {done} / {total} mutants run")

        theirs = None
        files = list(upstream_files or [])
        try:
            verdicts = run.run_all(mutants, cmap, out, root, tree, jobs=jobs, timeout_s=timeout_s, on_done=on_done)
            wall = time.monotonic() - started
            if upstream_files is not None:
                broken = upstream_tests.failing_clean(files, out, root, timeout_s)
                for f in sorted(broken):
                    print(f"{PROG}: sglang's {f} fails on the unmutated target; left out of the comparison", flush=True)
                files = [f for f in files if str(f) not in broken]
                print(f"{PROG}: the same mutants against {len(files)} CPU-registered sglang test file(s)", flush=True)
                theirs = upstream_tests.run_upstream(
                    mutants,
                    files,
                    out,
                    root,
                    tree,
                    jobs=jobs,
                    timeout_s=timeout_s,
                    on_done=lambda v, d, n: print(f"  upstream [{d}/{n}] {v.verdict:11} {v.mutant.id}", flush=True),
                )
        except run.MutationError as e:
            print(f"{PROG}: {e}")
            rec.finish("failed")
            return 1
        md, js = score.write(out, verdicts, tree, theirs, files)
        header = page.Header(PROG, passed=True, wall_time=wall, sglang=sglang_target.stamp(target))
        tables = [
            page.Table("Mutation score", tuple(score.HEAD), tuple(score.rows(verdicts)), note=score.line(verdicts)),
            page.Table(
                "Survivors",
                ("mutant", "operator", "diff"),
                tuple(
                    (v.mutant.id, v.mutant.operator, score.diff(v.mutant, tree))
                    for v in verdicts
                    if v.verdict == run.SURVIVED
                ),
            ),
        ]
        if theirs is not None:
            compared = score.compare_line(verdicts, theirs)
            tables.append(
                page.Table(
                    "The same mutants against sglang's own tests",
                    score.SIDE_HEAD,
                    tuple(score.side_by_side(verdicts, theirs)),
                    note=compared,
                )
            )
            print(compared)
        report = page.write(out / "report", header, [], tuple(tables), repo_root=root)
        note(score.comment_line(verdicts))
        print()
        print(score.line(verdicts) + f" ({wall:.0f} s)")
        print(f"mutation: {md}  json: {js}  report: {report}")
        rec.finish("passed", report=report)
    return 0
