"""``harness matrix --sglang T1,T2,… SPEC…``: the same rerun-test specs on several sglang targets, one table.

Every target is resolved before anything runs (an unknown release, a missing path, a directory
without ``sglang/``, a release older than the supported range: one line, exit 2); then each runs in
its own rerun-test, one after another (:mod:`harness.rerun.version_matrix`). Exit 0 when every target's
run passed, 1 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import atomic, rundir
from harness import runs as run_record
from harness.commands import UsageError, check_seconds
from harness.rerun import version_matrix as versions
from harness.targets.sglang import selection as sglang_target


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("matrix", help="run the same tests on several sglang targets and print one table")
    p.add_argument("specs", nargs="+", metavar="SPEC", help="rerun-test specs (test_x.py, path::test, …)")
    p.add_argument(
        "--sglang",
        required=True,
        metavar="T1,T2,…",
        help="comma-separated targets: releases (0.5.21), source trees, wheels or 'installed'",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        help="where results go (default runs/matrix-<timestamp>-<pid>); one sub-directory per target",
    )
    p.add_argument("--timeout", type=float, metavar="S", help="seconds per target (default: none)")
    p.add_argument("--ray-address", metavar="ADDR", help="passed to each rerun-test")
    p.add_argument("--repo-root", type=Path, default=rundir.REPO_ROOT, help=argparse.SUPPRESS)
    p.set_defaults(func=_matrix)


def _matrix(args: argparse.Namespace) -> int:
    try:
        specs = versions.parse_targets(args.sglang)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0, got {args.timeout:g}")
    check_seconds(args.timeout, "--timeout")
    resolved = []
    for spec in specs:
        try:  # resolve only: each target is activated in its own rerun-test, never in this process
            resolved.append(sglang_target.resolve(spec, progress=lambda line: print(f"harness: {line}", flush=True)))
        except sglang_target.TargetError as e:
            raise UsageError(str(e)) from None
    root = args.repo_root.resolve()
    run_dir = (args.run_dir or rundir.default_path(root / rundir.RUNS, kind="matrix")).resolve()
    with run_record.record(run_dir, ["harness", *args.argv], target=", ".join(t.label() for t in resolved)) as rec:
        extra = ["--ray-address", args.ray_address] if args.ray_address else []
        runs = []
        for i, target in enumerate(resolved):
            spec = target.root if target.origin == "tree" else target.spec
            runs.append(
                versions.run_target(
                    spec,
                    target.label(),
                    list(args.specs),
                    run_dir / f"{i + 1}-{versions.slug(target.spec)}",
                    repo_root=root,
                    extra_args=extra,
                    timeout_s=args.timeout,
                )
            )
        atomic.write_text(run_dir / "matrix.md", versions.render_markdown(runs))
        atomic.write_json(run_dir / "matrix.json", versions.to_json(runs))
        print()
        print(versions.render_text(runs))
        print(f"\nmatrix: {run_dir / 'matrix.md'}  json: {run_dir / 'matrix.json'}")
        ok = all(r.returncode == 0 and not r.note for r in runs)
        rec.finish("passed" if ok else "failed", report=run_dir / "matrix.md")
    return 0 if ok else 1
