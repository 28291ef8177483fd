"""``rerun-test``: run tests by name (or a ``/rerun-test`` comment) on the topologies they declare.

parse → resolve → plan → run → report, one module each. A file named whole also runs the files it pairs
with. Bad input: one line on stderr, exit 2, nothing run; exit 0 only when every group passed, 1 when any
failed, 130 when interrupted. ``--sglang TARGET`` picks the sglang under test. Usage examples:
docs/modules.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness import atomic, report, rundir, runs
from harness.commands import UsageError as CommandUsageError
from harness.commands import rerun_args as args_mod
from harness.commands import showcommands
from harness.commands.rerun_args import PROG, UsageError, build_parser, option_tokens, options_of, specs_of
from harness.changes.lines import ChangeError
from harness.rerun import changed, checkpoint, collector, comment, execute, registry, spec_resolve, spec_grammar
from harness.rerun import plan as plan_mod
from harness.rerun.execute import detect_gpus
from harness.rerun.registry import RegistryError
from harness.rerun.reports import write_reports
from harness.targets.sglang import selection as target_mod
from harness.targets.sglang.compat import checks

log = logging.getLogger(__name__)


def joined_preflight(address: str) -> Any:
    """Check the cluster at ``address`` before any group starts (:func:`harness.cluster.join.preflight`).

    Returns:
        The :class:`harness.cluster.join.Preflight` (the nodes, their GPU kind).

    Raises:
        UsageError: cannot join (unreachable, refused auth, Ray/Python mismatch) or a node's versions
            differ from this machine's: one line with the fix, instead of one failure per test.
    """
    from harness.cluster import join

    try:
        return join.preflight(address)
    except join.JoinError as e:
        raise UsageError(str(e)) from None


def _plan(args: argparse.Namespace) -> tuple[collector.Registry, plan_mod.Plan, bool]:
    specs, entry = specs_of(args)
    dirs = list(args.suites_dir)
    if entry:
        dirs += [Path(d) for d in entry.get("suites_dirs", []) if Path(d) not in dirs]
    reg = collector.collect(args.repo_root.resolve(), dirs, args.durations)
    default = not specs and not entry and not args.comment_file
    sels = spec_resolve.everything(reg) if default else spec_resolve.resolve(specs, reg)
    if not default and not entry:
        sels, added = spec_resolve.with_counterparts(sels, reg)
        if args.engine != "sim":
            for rel, why in added:
                print(f"{PROG}: also running {rel} (paired with {why}; --engine sim leaves it out)", file=sys.stderr)
    sels = spec_resolve.only_engine(sels, str((entry or {}).get("engine", args.engine)))
    if entry:
        p = plan_mod.make_plan(sels)
        groups = [g for g in p.groups if g.topology == entry["topology"]]
        shards = int(entry.get("shards", 1))
        if shards > 1:
            groups = [replace(g, shards=shards, shard_index=int(entry.get("shard_index", 0))) for g in groups]
        return reg, plan_mod.Plan(tuple(groups)), default
    p = plan_mod.make_plan(sels, shards=args.shards, shard_index=args.shard_index, max_shard_time=args.max_shard_time)
    return reg, p, default


def _matrix(p: plan_mod.Plan, reg: collector.Registry, suites_dirs: list[Path], options: dict) -> dict:
    counts = {f.rel: len(f.tests) for f in reg.files}
    m = plan_mod.to_matrix(p, [str(d) for d in suites_dirs])
    for entry in m["include"]:
        entry.update(options)
    for entry, g in zip(m["include"], p.groups):
        entry["specs"] = [spec_text for spec_text, _ in plan_mod.compact(g.items, counts)]
    return m


def _with_engine(m: dict, engine: str) -> dict:
    # A --plan-entry rerun keeps the engine its plan was made for (its specs are already paired).
    if engine != "all":
        for entry in m["include"]:
            entry["engine"] = engine
    return m


def _status(p: execute.Progress, link: str) -> comment.GroupStatus:
    failures = tuple((c.nodeid, c.message or c.outcome) for c in p.cases if c.outcome in ("failed", "error"))
    return comment.GroupStatus(
        name=p.group.name,
        runner=p.group.runner,
        state=p.state,
        passed=p.count("passed"),
        failed=p.count("failed") + p.count("error"),
        skipped=p.count("skipped"),
        xfailed=p.count("xfailed"),
        link=link,
        failures=failures,
    )


def _write_comment(path: Path, statuses: list[comment.GroupStatus]) -> None:
    body = path.read_text(encoding="utf-8") if path.exists() else ""
    new = comment.apply(body, statuses)
    if new != body:
        atomic.write_text(path, new)


def _run(args: argparse.Namespace, reg: collector.Registry, p: plan_mod.Plan, target: target_mod.Target) -> int:
    root = args.repo_root.resolve()
    run_dir = (args.run_dir or rundir.default_path(root / rundir.RUNS)).resolve()
    joined = joined_preflight(args.ray_address) if args.ray_address else None  # refused: no run directory
    with runs.record(run_dir, [PROG, *getattr(args, "argv", [])], target=target.label()) as rec:
        code, page = _execute(args, reg, p, target, run_dir, joined)
        if args.mutate:
            argv = mutate_command(args, run_dir)
            print(f"\n{PROG}: --mutate: {' '.join(argv[2:])}", flush=True)
            if args.mutate_detached:
                pid = checkpoint.start(args.mutate_detached.resolve(), argv, cwd=args.repo_root.resolve())
                print(
                    f"{PROG}: --mutate runs in the background (pid {pid}); its output: {args.mutate_detached / 'log'}",
                    flush=True,
                )
            else:
                code = max(code, subprocess.run(argv, cwd=args.repo_root.resolve()).returncode)
        rec.finish("passed" if code == 0 else "failed", report=page)
    return code


#: At most this many mutants after a ``--mutate`` rerun (about 7 s each on 2 cores: minutes, not an hour).
MUTATE_LIMIT = 20


def mutate_command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The ``harness mutate`` run that ``--mutate`` starts after the groups: the same target and
    ``--changed``, its results under ``<run>/mutation``, its done / total, score and survivors kept
    in the same status comment file. A process of its own, as from the command line: the mutation
    run owns its pool and its fault patches, and nothing of it is imported into this one."""
    argv = [
        sys.executable,
        "-m",
        "harness.cli",
        "mutate",
        "--run-dir",
        str(run_dir / "mutation"),
        "--limit",
        str(MUTATE_LIMIT),
    ]
    if args.sglang:
        argv += ["--sglang", args.sglang]
    if args.changed:
        argv += ["--changed", args.changed]
    if args.comment_out:
        argv += ["--comment-out", str(args.comment_out)]
    return argv


def _execute(
    args: argparse.Namespace,
    reg: collector.Registry,
    p: plan_mod.Plan,
    target: target_mod.Target,
    run_dir: Path,
    joined: Any,
) -> tuple[int, Path]:
    root = args.repo_root.resolve()
    gpus = detect_gpus() if args.gpus is None else args.gpus
    jobs = args.jobs or max(1, min(4, os.cpu_count() or 1))
    if args.ray_address and args.gpus is None:
        # Groups share the joined cluster with whoever else uses it: let each have it alone, longest first.
        gpus, jobs = max(g.gpus for g in p.groups), args.jobs or 1
    measure = changed.measurement(run_dir, target) if args.coverage else None
    opts = execute.ExecOptions(
        repo_root=root,
        run_dir=run_dir,
        ray_address=args.ray_address,
        gpus=gpus,
        jobs=jobs,
        timeout=args.timeout,
        joined_gpus=joined.gpu_kind if joined else None,
        measure=measure,
    )
    file_tests = {f.rel: len(f.tests) for f in reg.files}
    rel_of = {str(f.path.resolve()): f.rel for f in reg.files}

    def to_rel(path: str) -> str:
        if path in rel_of:
            return rel_of[path]
        try:
            return str(Path(path).relative_to(root))
        except ValueError:
            return path

    printer = execute.LiveLines(execute.Progress.line, lambda line: print(line, flush=True))

    def on_update(prog: execute.Progress) -> None:
        printer(prog)
        if args.comment_out:
            _write_comment(args.comment_out, [_status(prog, args.link)])

    if args.comment_out:
        _write_comment(args.comment_out, [comment.GroupStatus(g.name, g.runner, link=args.link) for g in p.groups])
    for line in plan_lines(p, opts, joined.summary() if joined else f"{gpus} real GPU(s)", jobs):
        print(line)
    print(f"  {target.label()}, root {target.root}; run dir {run_dir}")
    started = time.monotonic()
    results = execute.run_plan(p, opts, file_tests, to_rel, on_update)
    cov_line, cov = "", None
    if measure is not None:
        combined, cov = changed.summarize(measure, args.change)
        cov_line = cov.line() if cov is not None else changed.overall_line(combined)
    page = write_reports(run_dir, results, args.link, wall_time=time.monotonic() - started, target=target, coverage=cov)
    if args.save_durations:
        save_durations(root / "suites" / registry.DURATIONS_FILE, report.durations(results))
    if args.comment_out:
        _write_comment(args.comment_out, [comment.from_result(r, args.link) for r in results])
        if cov_line:
            comment.write_note(args.comment_out, "changed-lines", cov_line)
    print()
    print(report.table(results))
    for r in results:
        for c in r.failures:
            print(f"FAILED {c.nodeid} ({r.name}): {c.message}")
        if r.note:
            print(f"GROUP {r.name}: {r.note}")
    print(f"\njunit: {run_dir / 'report' / 'junit.xml'}  summary: {run_dir / 'report' / 'summary.md'}")
    if cov_line:
        print(cov_line)
        if cov is not None:
            for r in cov.rows:
                if r.missed:
                    print(f"  never executed: {r.path} {r.function}: lines {', '.join(map(str, r.missed))}")
    print(f"report: {page}")
    return (0 if all(r.ok for r in results) else 1), page


def plan_lines(p: plan_mod.Plan, opts: execute.ExecOptions, where: str, jobs: int) -> list[str]:
    """What a run will do, before it starts: per group its runner, its tests and files, and an
    estimate of what can run *here* (a simulated group skips the tests that need real GPUs: they are
    counted apart, not in the estimate; a group that cannot run here estimates nothing)."""
    lines, here_total, left_total = [], 0.0, 0.0
    body = []
    for g in p.groups:
        sim = (
            None
            if execute.gpu_mode(g, opts) == "cannot run here"
            else (False if opts.ray_address else execute.simulation(g, opts.gpus))
        )
        runnable = g.runnable(sim)
        here = sum(i.est_time for i in runnable)
        left = [i for i in g.items if i not in runnable]
        here_total += here
        left_total += sum(i.est_time for i in left)
        why = ""
        if left:
            reason = "cannot run here" if sim is None else "need real GPUs, skipped here"
            why = f"; {len(left)} test(s) {reason}, est {sum(i.est_time for i in left):.0f}s left out"
        body.append(
            f"  {g.name:24} runner {g.runner:16} {len(g.items):3} test(s) est {here:.0f}s "
            f"({execute.gpu_mode(g, opts)}{why})"
        )
        files = list(dict.fromkeys(Path(i.file_rel).name for i in g.items))
        body.append(f"    {', '.join(files[:8])}{f' and {len(files) - 8} more' if len(files) > 8 else ''}")
    left_text = f" ({left_total:.0f}s of tests that cannot run here left out)" if left_total else ""
    lines.append(
        f"{PROG}: {len(p.groups)} group(s), est {here_total:.0f}s here{left_text}, {where}, up to {jobs} at once"
    )
    return lines + body


def save_durations(path: Path, measured: dict[str, float]) -> None:
    """Merge ``measured`` into the repository's durations file (new values win; keys sorted)."""
    merged = registry.load_durations([path]) if path.exists() else {}
    # parametrized cases of one function are summed, as load_durations does
    sums: dict[str, float] = {}
    for k, v in measured.items():
        base = k.split("[", 1)[0]
        sums[base] = sums.get(base, 0.0) + v
    merged.update({k: round(v, 3) for k, v in sums.items()})
    atomic.write_json(path, dict(sorted(merged.items())))


def _from_repro(args: argparse.Namespace) -> int:
    """``rerun-test --from REPRO``: an explore repro replays its schedule
    (:func:`harness.commands.explore.replay_file`), a gate's bundle reruns its test
    (:func:`harness.gates.replay.reproduce`), with this command's defaults.

    Returns:
        1 reproduced, 0 not reproduced, 2 an unusable bundle or target (one line on stderr).
    """
    from harness.explore.machine import is_repro

    if is_repro(args.from_repro):
        from harness.commands import explore

        return explore.replay_file(args.from_repro, args.run_dir, args.sglang, verbose=args.verbose)
    from harness.gates import replay as reproduce
    from harness.gates.bundle import ReproError

    root = args.repo_root.resolve()
    run_dir = (args.run_dir or rundir.default_path(root / rundir.RUNS, suffix="repro")).resolve()
    gpus = detect_gpus() if args.gpus is None else args.gpus
    try:
        return reproduce.reproduce(
            args.from_repro, root, run_dir, args.ray_address, gpus, tuple(args.suites_dir), sglang=args.sglang
        )
    except ReproError as e:
        raise UsageError(str(e)) from None


def _list(reg: collector.Registry) -> int:
    for f in reg.files:
        where = ",".join(f.topologies) or "-"
        state = f"ERROR {f.error}" if f.error else (f"disabled: {f.disabled}" if f.disabled else "")
        print(f"{f.rel:60} {where:30} {len(f.tests):3} test(s) est {f.est_time:6.0f}s {state}".rstrip())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``rerun-test``.

    Returns:
        0 all passed (or a dry run / list), 1 a group failed, 2 bad input, 130 interrupted.
    """
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
        args_mod.check(args)
        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
        )
        if args.parse_only:
            specs, _ = specs_of(args)
            if not specs:
                raise UsageError("no specs given; name test files like test_x.py")
            line = " ".join([*option_tokens(options_of(args)), *(s.text for s in specs)])
            print(line)
            if args.github_output:
                with open(args.github_output, "a", encoding="utf-8") as f:
                    f.write(f"specs={line}\n")
            if args.comment_out:
                _write_comment(args.comment_out, [])
            return 0
        if args.from_repro:
            return _from_repro(args)
        if args.show_commands:
            print(showcommands.text(args.show_commands), end="")
            return 0
        if args.list:
            return _list(collector.collect(args.repo_root.resolve(), args.suites_dir, args.durations))
        reg, p, default = _plan(args)
        if not p.groups:
            msg = "no registered suites under suites/; nothing to run" if default else "the specs select no tests"
            print(f"{PROG}: {msg}", file=sys.stderr)
            return 0 if default else 2
        if args.dry_run:
            m = _with_engine(_matrix(p, reg, args.suites_dir, options_of(args)), args.engine)
            print(json.dumps(m, indent=2))
            if args.github_output:
                with open(args.github_output, "a", encoding="utf-8") as f:
                    f.write(f"matrix={json.dumps(m, separators=(',', ':'))}\n")
            if args.comment_out:
                _write_comment(
                    args.comment_out, [comment.GroupStatus(g.name, g.runner, link=args.link) for g in p.groups]
                )
            return 0
        checks.selected()  # a bad HARNESS_SGLANG_CHECKS is refused before any group starts
        target = target_mod.select_for_cli(args.sglang, PROG)
        args.coverage = args.coverage or bool(args.changed)
        args.change = changed.read_change(target, args.changed) if args.changed else None
        return _run(args, reg, p, target)
    except (
        UsageError,
        spec_grammar.SpecError,
        spec_resolve.ResolveError,
        plan_mod.PlanError,
        RegistryError,
        target_mod.TargetError,
        checks.UnknownCheck,
        ChangeError,
        CommandUsageError,
    ) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
