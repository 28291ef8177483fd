"""``harness explore``: random PD schedules over the simulated engine's real sglang objects, shrunk when one breaks.

Drives one prefill and one decode rank in this process (:mod:`harness.explore`) for ``--minutes`` or
``--examples`` schedules. Exit 0 when nothing broke; 1 with the shrunk schedule printed as numbered steps, the
repro file written and ``repro: PATH`` on a line of its own; 2 on bad input, with one line. ``--replay PATH``
runs a repro file's steps again, exactly (exit 1 when it breaks again).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

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
    if args.engine == "sglang-server":
        raise UsageError("--engine sglang-server: exploration over a real server is not built yet; use --engine sim")
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
    from harness.targets.sglang import selection

    repro = None
    if args.replay is not None:
        from harness.explore.machine import read_repro

        try:
            repro = read_repro(args.replay)
        except ValueError as e:
            raise UsageError(str(e)) from None
    names = args.fault or (repro["faults"] if repro else [])
    try:
        selection.select_for_cli(args.sglang, "harness")
    except selection.TargetError as e:
        raise UsageError(f"--sglang: {e}") from None
    from harness.explore import inject

    try:
        scratch = inject.apply(names) if names else None
    except faults.FaultError as e:
        raise UsageError(f"--fault: {e}") from None
    if not args.verbose:
        logging.getLogger("sglang").setLevel(logging.CRITICAL)
        warnings.filterwarnings("ignore", category=UserWarning)
    run = rundir.create(args.run_dir or rundir.default_path(kind="explore"))
    try:
        if repro is not None:
            return _replay(repro, args.replay, run.root)
        return _search(args, names, run.root)
    finally:
        if scratch is not None:
            inject.undo(scratch)


def _replay(repro: dict, path: Path, root: Path) -> int:
    from harness.explore.machine import replay

    print(f"explore: replaying {len(repro['steps'])} step(s) of {path}", flush=True)
    done = replay(repro["config"], repro["steps"], root)
    for i, step in enumerate(done.steps, 1):
        print(f"{i:>3}. {step.line()}")
    (root / EVENTS_FILE).write_bytes(done.log_bytes())
    print(f"events: {root / EVENTS_FILE}")
    if done.failure is None:
        print("explore: the replay did not break")
        return 0
    print(f"  => {done.failure}")
    return 1


def _search(args: argparse.Namespace, names: list[str], root: Path) -> int:
    from harness.explore.machine import Session, write_repro

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
    if finding is None:
        line = session.progress.line().removeprefix("explore: ")
        print(f"explore: nothing broke ({line}; stopped: {session.stopped})")
        return 0
    first = session.first_failure_s or 0.0
    print(f"explore: a schedule broke after {first:.1f}s; shrunk to {len(finding.steps)} step(s):")
    print("\n".join(finding.lines()))
    (root / EVENTS_FILE).write_bytes("".join(line + "\n" for line in finding.log).encode())
    path = write_repro(finding, root / REPRO_FILE)
    print(f"repro: {path}")
    return 1
