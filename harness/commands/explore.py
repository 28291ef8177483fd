"""``harness explore``: random PD schedules over the simulated engine's real sglang objects, shrunk when one breaks.

Drives one prefill and one decode rank in this process (:mod:`harness.explore`) for ``--minutes`` or
``--examples`` schedules. Exit 0 when nothing broke; 1 with the shrunk schedule printed as numbered steps, the
repro file written and ``repro: PATH`` on a line of its own; 2 on bad input, with one line. ``--replay PATH``
(and ``rerun-test --from PATH``) runs a repro file's steps again, exactly (exit 1 when it breaks again). The run
directory gets ``report/`` (:mod:`harness.explore.explore_report`). Guide: docs/explore.md.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

from harness import faults, rundir
from harness import topology as topology_mod
from harness.commands import UsageError, check_seconds

#: The repro file's name in the run directory.
REPRO_FILE = "explore-repro.json"
#: The ledger events of the shrunk (or replayed) schedule, one JSON line each, without wall-clock times.
EVENTS_FILE = "explore-events.jsonl"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explore", help="random PD schedules over sglang's real objects, shrunk when one breaks")
    p.add_argument("--minutes", type=float, default=5.0, metavar="N", help="time budget (default 5)")
    p.add_argument("--examples", type=int, default=None, metavar="N", help="stop after N schedules")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="the seed (default: a random one, printed)")
    p.add_argument("--topology", default="cpu", metavar="NAME", help="topology (default cpu)")
    p.add_argument(
        "--sglang", default=None, metavar="TARGET", help="which sglang (default $HARNESS_SGLANG, then installed)"
    )
    p.add_argument("--engine", choices=("sim", "sglang-server"), default="sim", help="engine (default sim)")
    p.add_argument("--run-dir", type=Path, default=None, metavar="DIR", help="run directory (default runs/explore-…)")
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="NAME",
        help="apply this catalog fault (harness faults list); repeatable",
    )
    p.add_argument("--replay", type=Path, default=None, metavar="PATH", help="replay a repro file's steps")
    p.set_defaults(func=_explore)


def _check(args: argparse.Namespace) -> None:
    if args.engine == "sglang-server" and args.replay is not None:
        raise UsageError("--replay: a real-server schedule is its seed; run it again with --seed N --examples 1")
    if args.engine == "sglang-server" and args.topology != "cpu":
        raise UsageError(f"--topology {args.topology}: real-server schedules run the CPU stack (--topology cpu)")
    check_seconds(args.minutes * 60, "--minutes")
    if args.examples is not None and args.examples < 1:
        raise UsageError(f"--examples {args.examples}: must be ≥ 1")
    if args.seed is not None and args.seed < 0:
        raise UsageError(f"--seed {args.seed}: must be ≥ 0")
    try:
        topo = topology_mod.get(args.topology)
    except (topology_mod.TopologyError, OSError, KeyError) as e:
        raise UsageError(f"--topology {args.topology}: {e}") from None
    tps = {r.kind: r.tp for r in topo.roles if r.kind in ("prefill", "decode")}
    if any(tp != 1 for tp in tps.values()):
        raise UsageError(
            f"--topology {args.topology}: TP {tps}; exploration drives one TP-1 prefill and decode "
            "rank in process, TP > 1 is not built yet"
        )
    if args.replay is not None and not args.replay.is_file():
        raise UsageError(f"--replay {args.replay}: no such file")


def _explore(args: argparse.Namespace) -> int:
    _check(args)
    if args.replay is not None:
        return replay_file(args.replay, args.run_dir, args.sglang, verbose=args.verbose)
    if args.engine == "sglang-server":
        return _explore_server(args)
    with _prepared(args.fault, args.sglang, args.verbose) as target:
        run = rundir.create(args.run_dir or rundir.default_path(kind="explore"))
        return _search(args, args.fault, run.root, target)


def _explore_server(args: argparse.Namespace) -> int:
    """Random schedules over the hold points on one real CPU stack (:mod:`harness.explore.server_schedules`):
    exit 0 when none broke, 1 with the broken schedule's steps and the command that runs it again."""
    from harness.explore import server_schedules

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    print(f"explore: real CPU stack, seed {seed}, budget {args.minutes:g} min", flush=True)
    with _prepared(args.fault, args.sglang, args.verbose, children=True):
        run = rundir.create(args.run_dir or rundir.default_path(kind="explore", suffix="server"))
        out = server_schedules.explore(
            seed,
            args.minutes * 60,
            run,
            schedules=args.examples,
            report=lambda line: print(line, file=sys.stderr, flush=True),
        )
    if out is None:
        print("explore: nothing broke")
        return 0
    print(f"explore: schedule {out.seed} broke: {out.failure}")
    for i, step in enumerate(out.steps, 1):
        print(f"{i:>3}. {step}")
    faulted = "".join(f" --fault {n}" for n in args.fault)
    print(f"again: harness explore --engine sglang-server --seed {out.seed} --examples 1{faulted}")
    return 1


@contextlib.contextmanager
def _prepared(names: list[str], sglang: str | None, verbose: bool, *, children: bool = False) -> Iterator[Any]:
    """The sglang target selected (its report stamp yielded), ``names`` applied to this process (undone
    after), sglang's logs quiet.

    Raises:
        UsageError: the target or a fault cannot be used (one line).
    """
    from harness.targets.sglang import selection

    try:
        target = selection.select_for_cli(sglang, "harness")
    except selection.TargetError as e:
        raise UsageError(f"--sglang: {e}") from None
    from harness.explore import inject

    try:
        scratch = inject.apply(names, children=children) if names else None
    except faults.FaultError as e:
        raise UsageError(f"--fault: {e}") from None
    sglang_log = logging.getLogger("sglang")
    level = sglang_log.level
    try:
        with warnings.catch_warnings():
            if not verbose:
                sglang_log.setLevel(logging.CRITICAL)
                warnings.filterwarnings("ignore", category=UserWarning)
            yield selection.stamp(target)
    finally:
        sglang_log.setLevel(level)
        if names:
            inject.undo(scratch)


def replay_file(path: Path, run_dir: Path | None, sglang: str | None, *, verbose: bool = False) -> int:
    """Replay a repro file's steps on a fresh pair, with its faults (``harness explore --replay`` and
    ``rerun-test --from``), and say whether it breaks again and whether its events are byte-identical.

    Returns:
        1 reproduced (the schedule breaks again), 0 not.

    Raises:
        UsageError: not a usable repro file, or its faults or the target cannot be used here (one line).
    """
    from harness.explore.machine import read_repro

    try:
        repro = read_repro(path)
    except ValueError as e:
        raise UsageError(str(e)) from None
    with _prepared(repro["faults"], sglang, verbose) as target:
        run = rundir.create(run_dir or rundir.default_path(kind="explore", suffix="replay"))
        return _replay(repro, path, run.root, target)


def _replay(repro: dict, path: Path, root: Path, target: Any) -> int:
    from harness.explore import explore_report
    from harness.explore.machine import events_digest, replay

    started = time.perf_counter()

    faulted = f", faults {', '.join(repro['faults'])}" if repro["faults"] else ""
    print(f"explore: replaying {len(repro['steps'])} step(s) of {path}{faulted}", flush=True)
    done = replay(repro["config"], repro["steps"], root)
    for i, step in enumerate(done.steps, 1):
        print(f"{i:>3}. {step.line()}")
    if done.failure is not None:
        print(f"  => {done.failure}")
    (root / EVENTS_FILE).write_bytes(done.log_bytes())
    digest, recorded = events_digest(done.log), repro.get("events_sha256")
    same = (
        "not recorded in the repro"
        if recorded is None
        else ("byte-identical to the recorded run" if digest == recorded else f"DIFFER from the recorded {recorded}")
    )
    events = f"events: {root / EVENTS_FILE} ({len(done.log)} events, sha256 {digest}): {same}"
    print(events)
    page = explore_report.for_replay(root, repro, path, done, time.perf_counter() - started, target, events)
    print(f"report: {page}")
    if done.failure is None:
        print(f"NOT REPRODUCED: the schedule ran clean; recorded: {repro.get('failure', '?')}")
        return 0
    what = "the same failure" if done.failure == repro.get("failure") else f"recorded: {repro.get('failure', '?')}"
    print(f"REPRODUCED: the schedule breaks again ({what})")
    return 1


def _search(args: argparse.Namespace, names: list[str], root: Path, target: Any) -> int:
    from harness.explore import explore_report
    from harness.explore.machine import Session, events_bytes, write_repro

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    tail = f", faults {', '.join(names)}" if names else ""
    print(
        f"explore: seed {seed}, budget {args.minutes:g} min"
        + (f" or {args.examples} schedules" if args.examples else "")
        + tail,
        flush=True,
    )
    session = Session(
        seed,
        root,
        examples=args.examples,
        seconds=args.minutes * 60,
        faults=names,
        report=lambda line: print(line, file=sys.stderr, flush=True),
    )
    finding = session.run()
    wall = time.perf_counter() - session.progress.started
    if finding is None:
        line = session.progress.line().removeprefix("explore: ")
        print(f"explore: nothing broke ({line}; stopped: {session.stopped})")
        print(f"report: {explore_report.for_session(root, session, wall, target, None)}")
        return 0
    first = session.first_failure_s or 0.0
    at = "schedule {}, step {}".format(*session.first_failure_at)
    print(f"explore: a schedule broke after {first:.1f}s ({at}); shrunk to {len(finding.steps)} step(s):")
    print("\n".join(finding.lines()))
    (root / EVENTS_FILE).write_bytes(events_bytes(finding.log))
    path = write_repro(finding, root / REPRO_FILE)
    print(_check_replay(finding))
    print(f"report: {explore_report.for_session(root, session, wall, target, path)}")
    print(f"repro: {path}")
    return 1


def _check_replay(finding: Any) -> str:
    """Replay the shrunk schedule once more on a fresh pair: does it break again, with the same events?"""
    from harness.explore.machine import replay

    with tempfile.TemporaryDirectory(prefix="harness-explore-check-") as scratch:
        again = replay(finding.config, [(s.op, s.args) for s in finding.steps], Path(scratch))
    broke = "breaks again" if again.failure is not None else "DOES NOT break again"
    same = "byte-identical" if again.log == finding.log else "DIFFERENT"
    return f"replayed once here: the schedule {broke}, its {len(again.log)} ledger events {same}"
