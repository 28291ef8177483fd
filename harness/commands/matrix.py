"""``harness matrix --sglang T1,T2,… SPEC…``: the same rerun-test specs on several sglang targets, one table;
``harness matrix --pair P,D [--pair …]``: a real CPU PD stack with prefill on P and decode on D, one verdict a pair.

Every target is resolved before anything runs (an unknown release, a missing path, a directory
without ``sglang/``, a release older than the supported range: one line, exit 2); then each runs in
its own rerun-test (:mod:`harness.rerun.version_matrix`) or pair check (:mod:`harness.rerun.pair_matrix`),
one after another. Exit 0 when every run passed (every pair a pass or a clean refusal), 1 otherwise, 2 on
bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import atomic, rundir
from harness import runs as run_record
from harness.commands import UsageError, check_seconds
from harness.rerun import pair_matrix as pairs
from harness.rerun import version_matrix as versions
from harness.targets.sglang import selection as sglang_target


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("matrix", help="run the same tests on several sglang targets and print one table")
    p.add_argument(
        "specs", nargs="*", metavar="SPEC", help="rerun-test specs (test_x.py, path::test, …); with --sglang"
    )
    p.add_argument(
        "--sglang",
        metavar="T1,T2,…",
        help="comma-separated targets: releases (0.5.21), source trees, wheels or 'installed'",
    )
    p.add_argument(
        "--pair",
        action="append",
        metavar="PREFILL,DECODE",
        help="a real CPU PD stack with prefill's server on one target and decode's on the other, a fixed short "
        "check (greedy parity with a plain server of prefill's target, clean resets): pass, refusal or finding; "
        "repeatable",
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


def _resolve(spec: str) -> sglang_target.Target:
    try:  # resolve only: each target is activated in its own child process, never in this one
        return sglang_target.resolve(spec, progress=lambda line: print(f"harness: {line}", flush=True))
    except sglang_target.TargetError as e:
        raise UsageError(str(e)) from None


def _matrix(args: argparse.Namespace) -> int:
    if bool(args.sglang) == bool(args.pair):
        raise UsageError("give --sglang T1,T2,… SPEC… or --pair PREFILL,DECODE (one of the two)")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0, got {args.timeout:g}")
    check_seconds(args.timeout, "--timeout")
    if args.pair:
        return _pairs(args)
    if not args.specs:
        raise UsageError("--sglang needs the rerun-test specs to run, e.g. test_disaggregation_basic.py")
    try:
        specs = versions.parse_targets(args.sglang)
    except ValueError as e:
        raise UsageError(str(e)) from None
    resolved = [_resolve(spec) for spec in specs]
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


def _pairs(args: argparse.Namespace) -> int:
    if args.specs:
        raise UsageError(f"--pair runs a fixed check and takes no specs (got {' '.join(args.specs)})")
    if args.ray_address:
        raise UsageError("--pair starts its own local Ray for the CPU stack; drop --ray-address")
    try:
        given = [pairs.parse_pair(value) for value in args.pair]
    except ValueError as e:
        raise UsageError(str(e)) from None
    resolved = {spec: _resolve(spec) for pair in given for spec in pair}
    # A tree travels as its root (a relative path means the same in the child); the rest by their TARGET.
    as_arg = {spec: t.root if t.origin == "tree" else t.spec for spec, t in resolved.items()}
    root = args.repo_root.resolve()
    run_dir = (args.run_dir or rundir.default_path(root / rundir.RUNS, kind="matrix")).resolve()
    label = ", ".join(f"{resolved[p].label()} -> {resolved[d].label()}" for p, d in given)
    with run_record.record(run_dir, ["harness", *args.argv], target=label) as rec:
        results = [
            pairs.run_pair(
                as_arg[p],
                as_arg[d],
                run_dir / f"{i + 1}-{versions.slug(p)}--{versions.slug(d)}",
                repo_root=root,
                timeout_s=args.timeout or pairs.PAIR_TIMEOUT_S,
            )
            for i, (p, d) in enumerate(given)
        ]
        atomic.write_text(run_dir / "matrix.md", pairs.render_markdown(results))
        atomic.write_json(run_dir / "matrix.json", pairs.to_json(results))
        print()
        print(pairs.render_text(results))
        print(f"\nmatrix: {run_dir / 'matrix.md'}  json: {run_dir / 'matrix.json'}")
        ok = all(r.verdict != "finding" for r in results)
        rec.finish("passed" if ok else "failed", report=run_dir / "matrix.md")
    return 0 if ok else 1
