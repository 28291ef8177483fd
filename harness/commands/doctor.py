"""``harness doctor TOPOLOGY [--ray-address ADDR | --simulate] [--json]``: preflight a cluster.

Exit 0 only if every check passed (``simulated`` counts as passed, with a note); 1 if any check
failed or hung; 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from harness import rundir, topology
from harness.commands import UsageError, check_seconds
from harness.targets.sglang import selection as sglang_target


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check a real or simulated cluster against a topology before running suites")
    p.add_argument("topology", help="topology name (see `harness topology list`) or path to a .toml file")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--ray-address", metavar="ADDR", help="join this Ray cluster (host:port) instead of starting one"
    )
    where.add_argument("--simulate", action="store_true", help="local Ray with the topology's GPUs as logical GPUs")
    p.add_argument("--json", action="store_true", help="print the report as JSON (for CI)")
    p.add_argument("--sglang", metavar="TARGET", help=sglang_target.HELP)
    p.add_argument(
        "--run-dir", metavar="DIR", help="run directory (disk check, probe logs); default runs/<timestamp>-<pid>"
    )
    p.add_argument(
        "--port",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="also check that fixed port N is free on every node (repeatable)",
    )
    p.add_argument(
        "--timeout", type=float, metavar="S", help="seconds each check may take before its probe is reported hung"
    )
    p.set_defaults(func=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from harness import doctor
    from harness.cluster.join import JoinError

    try:
        topo = topology.get(args.topology)
    except topology.TopologyError as e:
        raise UsageError(str(e)) from None
    bad = [n for n in args.port if not 0 < n < 65536]
    if bad:
        raise UsageError(f"--port {bad[0]}: not a TCP port; pass a number from 1 to 65535")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout:g}: must be > 0 seconds")
    check_seconds(args.timeout, "--timeout")
    limits = doctor.Limits()
    if args.timeout is not None:
        limits = dataclasses.replace(limits, check_timeout_s=args.timeout)
    run_dir = Path(args.run_dir) if args.run_dir else rundir.default_path()
    try:  # the probes (Ray actors) inherit it and report its version
        sglang_target.select_for_cli(args.sglang, "harness")
    except sglang_target.TargetError as e:
        raise UsageError(str(e)) from None
    try:
        report = doctor.run(
            topo,
            simulate=args.simulate,
            ray_address=args.ray_address,
            run_dir=run_dir,
            limits=limits,
            ports=tuple(args.port),
        )
    except JoinError as e:  # already one line: what failed and the fix
        raise UsageError(str(e)) from None
    except (ConnectionError, RuntimeError) as e:
        if args.ray_address:
            raise UsageError(
                f"cannot use the Ray cluster at {args.ray_address}: {e}; check the address (`ray status` on the head)"
            ) from None
        raise
    print(doctor.render.to_json(report) if args.json else doctor.render.table(report))
    return report.exit_code
