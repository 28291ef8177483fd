"""``harness gate list | show NAME | plan NAME | run NAME [--simulate] [--ray-address ADDR] | verdict NAME``.

``run`` prints live progress, then ``PASS`` or ``FAIL`` with the reasons, and writes the reports and repro
bundles; exit 0 only on PASS, 1 on FAIL, 2 on bad input. In CI a gate is split per runner label
(``plan``, ``run --runner``, ``verdict``). Detail: docs/modules.md.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from harness import rundir, runs
from harness.commands import UsageError
from harness.gates import model
from harness.targets.sglang import selection as sglang_target


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gate", help="release qualification gates: list, show, run")
    gsub = p.add_subparsers(dest="action", metavar="ACTION")
    gsub.required = True
    gsub.add_parser("list", help="list the gates in ci/gates/").set_defaults(func=_list)
    show = gsub.add_parser("show", help="print one gate as JSON")
    show.add_argument("name", help="a gate name or a path to a .toml file")
    show.set_defaults(func=_show)
    plan = gsub.add_parser("plan", help="print the gate as a GitHub Actions matrix (JSON): one entry per runner label")
    plan.add_argument("name", help="a gate name or a path to a .toml file")
    plan.add_argument(
        "--simulate",
        action="store_true",
        help="GPU groups whose topology allows simulation go to the cpu topology's runner (no GPU runner)",
    )
    plan.add_argument(
        "--github-output", type=Path, metavar="FILE", help="also append matrix=<json> to FILE ($GITHUB_OUTPUT)"
    )
    plan.add_argument("--repo-root", type=Path, default=rundir.REPO_ROOT, help=argparse.SUPPRESS)
    plan.set_defaults(func=_plan)
    run = gsub.add_parser("run", help="run a gate and print PASS / FAIL with reasons")
    run.add_argument("name", help="a gate name or a path to a .toml file")
    run.add_argument("--simulate", action="store_true", help="run groups whose GPUs are missing on Ray logical GPUs")
    run.add_argument(
        "--ray-address", metavar="ADDR", help="join the Ray cluster at ADDR (host:port) instead of a local one"
    )
    run.add_argument("--run-dir", type=Path, help="where results go (default: runs/<timestamp>-<pid>)")
    run.add_argument(
        "--gpus",
        type=int,
        help="GPUs available (default: what nvidia-smi lists; with --ray-address: the joined cluster's GPU resources)",
    )
    run.add_argument("--jobs", type=int, help="most groups at once (default: min(4, CPUs))")
    run.add_argument(
        "--suites-dir", type=Path, action="append", default=[], metavar="DIR", help="an extra test tree; repeatable"
    )
    run.add_argument("--hypothesis-seed", type=int, help="override the gate's Hypothesis seed")
    run.add_argument("--workload-seed", type=int, help="override the gate's workload seed")
    run.add_argument("--sglang", metavar="TARGET", help=sglang_target.HELP)
    run.add_argument(
        "--runner", metavar="LABEL", help="run only the groups of this CI runner label (see `harness gate plan`)"
    )
    run.add_argument("--repo-root", type=Path, default=rundir.REPO_ROOT, help=argparse.SUPPRESS)
    run.set_defaults(func=_run)
    verdict = gsub.add_parser("verdict", help="combine the CI jobs' results of a `plan` matrix into one PASS / FAIL")
    verdict.add_argument("name", help="a gate name or a path to a .toml file")
    verdict.add_argument(
        "--matrix",
        required=True,
        metavar="JSON",
        help="the matrix `harness gate plan` printed (empty: the plan failed)",
    )
    verdict.add_argument(
        "--reports",
        type=Path,
        required=True,
        metavar="DIR",
        help="where the jobs' run directories are, one per artifact name (DIR/<artifact>/report/result.json)",
    )
    verdict.set_defaults(func=_verdict)


def _load(name: str) -> model.Gate:
    try:
        return model.get(name)
    except model.GateError as e:
        raise UsageError(str(e)) from None


def _list(args: argparse.Namespace) -> int:
    for name in model.names():
        g = _load(name)
        required = sum(1 for s in g.suites if s.required)
        print(f"{g.name:16} {len(g.suites)} suite(s), {required} required  {g.description}")
    return 0


def _show(args: argparse.Namespace) -> int:
    print(json.dumps(_load(args.name).summary(), indent=2))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from harness import topology
    from harness.gates import gate_plan
    from harness.rerun import collector, spec_resolve, spec_grammar
    from harness.rerun import plan as plan_mod
    from harness.rerun.registry import RegistryError

    gate = _load(args.name)
    try:
        m = gate_plan.matrix(gate, collector.collect(args.repo_root.resolve()), args.simulate)
    except (
        spec_resolve.ResolveError,
        plan_mod.PlanError,
        spec_grammar.SpecError,
        RegistryError,
        topology.TopologyError,
    ) as e:
        raise UsageError(f"gate {gate.name} cannot be planned: {e}") from None
    print(json.dumps(m, indent=2))
    if args.github_output:
        with open(args.github_output, "a", encoding="utf-8") as f:
            f.write(f"matrix={json.dumps(m, separators=(',', ':'))}\n")
    return 0


def _verdict(args: argparse.Namespace) -> int:
    from harness.gates import render, verdict

    gate = _load(args.name)
    try:
        entries = json.loads(args.matrix)["include"] if args.matrix.strip() else []
        labels = [(str(e["name"]), str(e["artifact"])) for e in entries]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UsageError(f"--matrix: not a matrix from `harness gate plan` ({e}); pass its JSON") from None
    jobs: list[tuple[str, dict | None]] = []
    details: list[tuple[str, str]] = []
    for label, artifact in labels:
        report = rundir.RunDir(args.reports / artifact).report
        try:
            result = json.loads((report / "result.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            result = None  # a job that reported nothing readable is judged as one that reported nothing
        jobs.append((label, result if isinstance(result, dict) else None))
        try:
            details.append((label, (report / "summary.md").read_text(encoding="utf-8")))
        except OSError:
            pass  # no summary: the table already says "no result"
    passed, reasons = verdict.judge_jobs(jobs)
    print(render.jobs_md(gate.name, jobs, passed, reasons, tuple(details)), end="")
    return 0 if passed else 1


def _run(args: argparse.Namespace) -> int:
    from harness.gates import render, gate_runner
    from harness.rerun.execute import detect_gpus
    from harness.rerun.plan import PlanError
    from harness.rerun.registry import RegistryError

    gate = _load(args.name)
    if args.simulate and args.ray_address:
        raise UsageError("--simulate starts local clusters and --ray-address joins one: pass only one")
    for opt in ("gpus", "jobs"):
        value = getattr(args, opt)
        if value is not None and value < (0 if opt == "gpus" else 1):
            raise UsageError(f"--{opt} {value}: must be ≥ {0 if opt == 'gpus' else 1}")
    root = args.repo_root.resolve()
    run_dir = (args.run_dir or rundir.default_path(root / rundir.RUNS)).resolve()
    gpus = detect_gpus() if args.gpus is None else args.gpus
    joined = None
    if args.ray_address:  # one line and exit 2 when the cluster cannot be used, before any suite starts
        from harness.cluster import join

        try:
            joined = join.preflight(args.ray_address)
        except join.JoinError as e:
            raise UsageError(str(e)) from None
        print(joined.summary())
        if args.gpus is None:  # the cluster's, not this machine's: a group waits until its GPUs are free there
            gpus = int(sum(n.gpus for n in joined.nodes))
    opts = gate_runner.GateOptions(
        repo_root=root,
        run_dir=run_dir,
        simulate=args.simulate,
        ray_address=args.ray_address,
        gpus=gpus,
        jobs=args.jobs or max(1, min(4, os.cpu_count() or 1)),
        suites_dirs=tuple(args.suites_dir),
        hypothesis_seed=args.hypothesis_seed,
        workload_seed=args.workload_seed,
        runner=args.runner,
        joined_gpus=joined.gpu_kind if joined else None,
    )
    try:
        target = sglang_target.select_for_cli(args.sglang, "harness")
        with runs.record(
            run_dir,
            ["harness", *args.argv],
            target=target.label(),
            refused=(RegistryError, PlanError, sglang_target.TargetError),
        ) as rec:
            result = gate_runner.run_gate(gate, opts)
            rec.finish("passed" if result.exit_code == 0 else "failed", report=run_dir / "report" / "index.html")
    except (RegistryError, PlanError, sglang_target.TargetError) as e:
        raise UsageError(str(e)) from None
    print()
    for line in render.verdict_lines(result.verdict):
        print(line)
    for key, path in result.repros.items():
        print(f"  repro: {key} → {run_dir / path}")
    print(f"report: {run_dir / 'report' / 'summary.md'}  result: {run_dir / 'report' / 'result.json'}")
    return result.exit_code
