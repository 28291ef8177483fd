"""``harness faults list`` and
``harness faults check [--fault NAME ...] [--suite PATH ... | --all] [--json | --table]``.

``list`` prints the fault catalog; ``check`` runs the kill matrix (:mod:`harness.faultcheck`) and writes the
run's HTML page. Exit 0 when the clean run passed and no fault was missed or broken, 1 otherwise, 2 on bad
input. Each option: docs/modules.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness import faultcheck, faults, rundir, runs
from harness.commands import UsageError, check_seconds
from harness.targets.sglang import selection as sglang_target
from harness.workers import procs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("faults", help="list the fault catalog; check that the suites catch every fault")
    fsub = p.add_subparsers(dest="action", metavar="ACTION")
    fsub.required = True
    fsub.add_parser("list", help="list the faults: name, upstream issue, targeted suites, description").set_defaults(
        func=_list
    )
    check = fsub.add_parser("check", help="run the clean suites, then each fault; print the kill matrix")
    check.add_argument(
        "--fault",
        action="append",
        metavar="NAME",
        dest="faults",
        help="check only this fault (repeatable; default: the whole catalog)",
    )
    check.add_argument(
        "--suite",
        action="append",
        metavar="PATH",
        dest="suites",
        help="run every fault against this suite instead of its targets (repeatable; "
        "a path relative to the repository root)",
    )
    check.add_argument(
        "--clean-junit",
        metavar="XML",
        type=Path,
        help="take the clean run from this JUnit report (pytest --junitxml=XML -o junit_family=xunit1) "
        "of a run that already ran the targeted suites, instead of running them again",
    )
    check.add_argument(
        "--wait-for",
        metavar="PID",
        type=int,
        dest="clean_writer",
        help="the --clean-junit report is still being written by process PID (a test run started "
        "beside this check): the fault runs start at once, the report is read once PID exits",
    )
    check.add_argument(
        "--all",
        action="store_true",
        dest="all_suites",
        help="run every fault against every suite that asserts accounting (slow: real servers too)",
    )
    check.add_argument(
        "--every-test",
        action="store_true",
        help="run every selected test of a fault even after one caught it (default: stop at the first catch, "
        "except with --suite / --all, which fill every cell)",
    )
    check.add_argument("--json", action="store_true", help="print the matrix as JSON")
    check.add_argument("--table", action="store_true", help="also print the fault x suite table (markdown)")
    check.add_argument(
        "--jobs",
        type=int,
        default=faultcheck.DEFAULT_JOBS,
        help=f"fault runs at a time (default {faultcheck.DEFAULT_JOBS})",
    )
    check.add_argument(
        "--timeout",
        type=float,
        default=faultcheck.DEFAULT_TIMEOUT_S,
        help=f"seconds one pytest run may take (default {faultcheck.DEFAULT_TIMEOUT_S:.0f})",
    )
    check.add_argument("--sglang", metavar="TARGET", help=sglang_target.HELP)
    check.add_argument(
        "--run-dir", metavar="DIR", help="where JUnit XML and logs go (default runs/faults-<timestamp>-<pid>)"
    )
    check.set_defaults(func=_check)


def _list(args: argparse.Namespace) -> int:
    known = faults.catalog()
    width = max(len(name) for name in known)
    for name, fault in known.items():
        form = "source patch" if fault.is_patch else f"runtime wrapper of {fault.target}"
        print(f"{name:<{width}}  {fault.upstream}  [{form}]")
        print(f"{'':<{width}}  {fault.description}")
        print(f"{'':<{width}}  evidence: {' | '.join(fault.evidence)}")
        print(f"{'':<{width}}  suites: {' '.join(faultcheck.targets_for(name))}")
    return 0


def _validate(args: argparse.Namespace) -> None:
    known = faults.catalog()
    for name in args.faults or ():
        if name not in known:
            raise UsageError(f"unknown fault {name!r}; `harness faults list` shows the known ones")
    if args.all_suites and args.suites:
        raise UsageError("--all and --suite exclude each other; pass one")
    for suite in args.suites or ():
        if Path(suite).is_absolute() or not (faultcheck.REPO_ROOT / faultcheck.suite_file(suite)).exists():
            raise UsageError(
                f"suite {suite!r} not found; pass a path relative to the repository root, e.g. suites/unit"
            )
    if args.clean_writer is not None and args.clean_junit is None:
        raise UsageError("--wait-for PID needs --clean-junit XML: the report that process writes")
    if args.clean_writer is not None and args.clean_writer <= 0:
        raise UsageError(f"--wait-for takes the pid of the process writing the report, got {args.clean_writer}")
    if args.clean_writer is not None and not procs.alive(args.clean_writer) and not args.clean_junit.is_file():
        raise UsageError(
            f"--wait-for {args.clean_writer}: no such process, and no report at {args.clean_junit}; "
            "pass the pid of the running test run"
        )
    if args.clean_junit is not None and args.clean_writer is None and not args.clean_junit.is_file():
        raise UsageError(f"--clean-junit {args.clean_junit}: no such file; pass the --junitxml report of the test run")
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0, got {args.timeout:g}")
    check_seconds(args.timeout, "--timeout")


def _check(args: argparse.Namespace) -> int:
    _validate(args)
    try:
        target = sglang_target.select_for_cli(args.sglang, "harness")
    except sglang_target.TargetError as e:
        raise UsageError(str(e)) from None
    if not args.json:
        print(f"faults check on {target.label()}")
    out_dir = Path(args.run_dir) if args.run_dir else rundir.default_path(kind="faults")
    suites = faultcheck.ACCOUNTING_SUITES if args.all_suites else tuple(args.suites) if args.suites else None
    with runs.record(out_dir, ["harness", *args.argv], target=target.label()) as rec:
        result = faultcheck.check(
            args.faults,
            suites=suites,
            out_dir=out_dir,
            jobs=args.jobs,
            timeout_s=args.timeout,
            clean_junit=args.clean_junit,
            clean_writer=args.clean_writer,
            stop_at_catch=suites is None and not args.every_test,
        )
        page = faultcheck.write_page(result, out_dir)
        rec.finish("passed" if result.ok else "failed", report=page)
    if args.json:
        print(json.dumps({**faultcheck.to_dict(result), "report": str(page)}, indent=2))
    else:
        print(faultcheck.render(result))
        if args.table:
            print(faultcheck.table(result))
        print(f"evidence: {out_dir}")
        print(f"report: {page}")
    return 0 if result.ok else 1
