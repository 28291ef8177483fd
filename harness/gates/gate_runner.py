"""Run a gate through rerun-test's machinery and write its reports, repro bundles and flaky record.

Each suite entry is selected, planned and executed; failures the flaky policy allows are rerun alone; then
the verdict, the reports, a repro bundle per failing test and a flaky-history line are written. The run as
numbered steps: docs/modules.md. Over 400 lines: the steps share one gate run's state and its evidence.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from harness import atomic, report, rundir
from harness import topology as topo_mod
from harness.gates import bundle as repro
from harness.gates import classify, history, render
from harness.gates.evidence import collect_evidence, repro_key
from harness.gates.model import Gate, GateSuite
from harness.gates.gate_plan import entry_plan, runner_label
from harness.gates.gate_state import Attempt, EntryRun, GateOptions, GateRun
from harness.gates.verdict import SuiteOutcome, TestOutcome, Verdict, judge
from harness.report import page
from harness.report.junit import read_junit
from harness.report.results import CaseResult, GroupResult
from harness.report.stamp import git_state
from harness.rerun import collector, execute, spec_resolve
from harness.rerun import plan as plan_mod
from harness.rerun import spec_grammar as spec_mod
from harness.rerun.registry import RegistryError
from harness.rundir import RunDir
from harness.targets.sglang import selection as sglang_target

log = logging.getLogger(__name__)

LIVE_EVERY_S = 5.0
#: Recent gate runs whose history the page's flaky record reads (as ``harness flaky``'s default).
FLAKY_WINDOW = 20


# --------------------------------------------------------------------------------------------
# live progress
# --------------------------------------------------------------------------------------------


def live_line(prefix: str, p: execute.Progress) -> str:
    """``[unit/cpu] running 3/10 failed 0 elapsed 12s ETA 20s`` (ETA from the group's est_time)."""
    done = len(p.cases)
    total = p.collected if p.collected is not None else len(p.group.items)
    est = p.group.est_time
    left = est * (1 - done / total) if total and done else max(est - p.wall, 0.0)
    eta = "-" if p.state in ("passed", "failed") else f"{left:.0f}s"
    failed = p.count("failed") + p.count("error")
    return f"[{prefix}/{p.group.name}] {p.state:7} {done}/{total} failed {failed} elapsed {p.wall:.0f}s ETA {eta}"


def live_lines(prefix: str, out: Callable[[str], None], every: float = LIVE_EVERY_S) -> execute.LiveLines:
    """A gate's live lines for one suite entry (see :class:`harness.rerun.execute.LiveLines`)."""
    return execute.LiveLines(lambda p: live_line(prefix, p), out, every)


# --------------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------------


def _to_rel(reg: collector.Registry) -> Callable[[str], str]:
    rel_of = {str(f.path.resolve()): f.rel for f in reg.files}

    def to_rel(path: str) -> str:
        if path in rel_of:
            return rel_of[path]
        try:
            return str(Path(path).relative_to(reg.repo_root))
        except ValueError:
            return path

    return to_rel


def _failures(junit: Path) -> dict[str, classify.Failure]:
    try:
        return {f.nodeid: f for f in classify.failures(read_junit(junit))}
    except ValueError:  # no report (the group never ran or was killed): its cases say what happened
        return {}


def _attempt(case: CaseResult, junit_failures: dict[str, classify.Failure], group_dir: Path) -> Attempt:
    f = junit_failures.get(case.nodeid)
    if case.outcome not in ("failed", "error"):
        cls, msg = "", case.message
    elif f is not None:
        cls, msg = f.failure_class, case.message or f.message
    else:
        cls, msg = classify.classify("error" if case.outcome == "error" else "failure", case.message), case.message
    return Attempt(case.outcome, cls, msg, group_dir, group_dir / "pytest.log")


def item_for(group: plan_mod.Group, nodeid: str) -> plan_mod.Item:
    """The plan item that runs exactly ``nodeid`` (a parametrized case of an item included).

    Raises:
        KeyError: no item of ``group`` is in ``nodeid``'s file.
    """
    for it in group.items:
        if nodeid.startswith(it.file_rel):
            path = it.target.split("::", 1)[0]
            return plan_mod.Item(
                nodeid=nodeid, target=path + nodeid[len(it.file_rel) :], est_time=it.est_time, file_rel=it.file_rel
            )
    raise KeyError(nodeid)


def run_one(
    group: plan_mod.Group,
    item: plan_mod.Item,
    exec_opts: execute.ExecOptions,
    reg: collector.Registry,
    on_update: Callable[[execute.Progress], None] = lambda p: None,
) -> tuple[GroupResult, Attempt]:
    """Run one test alone in ``group``'s topology (flaky reruns, ``rerun-test --from``).

    Returns:
        The group's result and the test's :class:`Attempt` (``error`` when the test did not report).
    """
    single = plan_mod.Plan((replace(group, items=(item,), shards=1, shard_index=None),))
    [res] = execute.run_plan(single, exec_opts, {}, _to_rel(reg), on_update)
    gdir = exec_opts.run_dir / "groups" / res.name
    junit = _failures(RunDir(exec_opts.run_dir).junit_file(res.name))
    case = next((c for c in res.cases if c.nodeid == item.nodeid), None)
    if case is None:
        msg = res.note or f"{item.nodeid} did not report a result"
        return res, Attempt("error", classify.classify("error", msg), msg, gdir, gdir / "pytest.log")
    return res, _attempt(case, junit, gdir)


def _blocked_note(group: plan_mod.Group, opts: GateOptions) -> str:
    """Why a group cannot run here, and what to do (without ``--simulate`` or where its topology forbids it)."""
    try:
        may_simulate = topo_mod.get(group.topology).allow_simulation
    except topo_mod.TopologyError:
        may_simulate = False
    fix = (
        "pass --simulate to run it on Ray logical GPUs, or run"
        if may_simulate
        else f"{group.topology} forbids simulation; run"
    )
    return f"needs {group.gpus} GPUs, this machine has {opts.gpus}; {fix} on runner {group.runner}"


def run_entry(
    gate: Gate,
    entry: GateSuite,
    reg: collector.Registry,
    opts: GateOptions,
    info: render.RunInfo,
    out: Callable[[str], None],
) -> EntryRun | None:
    """Run one suite entry with its flaky reruns (never raises for failing tests).

    Returns:
        The entry's run; None when ``opts.runner`` is set and the entry has no group on that runner.
    """
    edir = opts.run_dir / "suites" / entry.name
    try:
        p = entry_plan(entry, reg, opts.simulate)
        if opts.runner is not None:
            p = plan_mod.Plan(tuple(g for g in p.groups if runner_label(g) == opts.runner))
            if not p.groups:
                return None
    except (
        spec_resolve.ResolveError,
        plan_mod.PlanError,
        spec_mod.SpecError,
        RegistryError,
        topo_mod.TopologyError,
    ) as e:
        out(f"[{entry.name}] cannot run: {e}")
        return EntryRun(
            entry, SuiteOutcome(entry.name, entry.required, entry.min_pass_rate, error=str(e)), edir, (), None, {}, ()
        )
    seeds = (f"--hypothesis-seed={info.hypothesis_seed}", f"--workload-seed={info.workload_seed}")
    exec_opts = execute.ExecOptions(
        repo_root=opts.repo_root,
        run_dir=edir,
        python=opts.python,
        ray_address=opts.ray_address,
        gpus=opts.gpus,
        jobs=opts.jobs,
        timeout=entry.timeout,
        pytest_args=(*seeds, *entry.pytest_args()),
        joined_gpus=opts.joined_gpus,
    )
    mode = "required" if entry.required else "informational"
    out(
        f"[{entry.name}] {mode}: {sum(len(g.items) for g in p.groups)} item(s) in {len(p.groups)} group(s), "
        f"est {p.est_time:.0f}s"
    )
    file_tests = {f.rel: len(f.tests) for f in reg.files}
    live = live_lines(entry.name, out)
    blocked = {
        g.name: _blocked_note(g, opts)
        for g in p.groups
        if execute.simulation(g, opts.gpus, joined=bool(opts.ray_address)) is None
    }
    runnable = plan_mod.Plan(tuple(g for g in p.groups if g.name not in blocked))
    ran = iter(execute.run_plan(runnable, exec_opts, file_tests, _to_rel(reg), live) if runnable.groups else [])
    results = [
        GroupResult(name=g.name, topology=g.topology, runner=g.runner, note=blocked[g.name])
        if g.name in blocked
        else next(ran)
        for g in p.groups
    ]
    for name, note in blocked.items():
        out(f"[{entry.name}/{name}] not run: {note}")
    tests: list[TestOutcome] = []
    attempts: dict[tuple[str, str], tuple[Attempt, ...]] = {}
    reruns: list[tuple[str, GroupResult, Path]] = []
    for g, res in zip(p.groups, results):
        junit = _failures(RunDir(edir).junit_file(res.name))
        gdir = edir / "groups" / res.name
        for case in res.cases:
            first = _attempt(case, junit, gdir)
            tries = [first]
            while tries[-1].outcome in ("failed", "error") and gate.flaky.may_rerun(
                tries[-1].failure_class, len(tries)
            ):
                k = len(tries)
                rdir = edir / "reruns" / f"{rundir.safe_name(case.nodeid)}-{k}"
                out(
                    f"[{entry.name}/{res.name}] rerun {k}/{gate.flaky.reruns} of {case.nodeid} "
                    f"({tries[-1].failure_class})"
                )
                rres, att = run_one(g, item_for(g, case.nodeid), replace(exec_opts, run_dir=rdir), reg)
                tries.append(att)
                reruns.append((case.nodeid, rres, rdir))
            last_fail = next((a for a in reversed(tries) if a.outcome in ("failed", "error")), None)
            if last_fail is not None:
                attempts[(res.name, case.nodeid)] = tuple(tries)
            tests.append(
                TestOutcome(
                    nodeid=case.nodeid,
                    group=res.name,
                    outcome=tries[-1].outcome,
                    attempts=tuple(a.outcome for a in tries),
                    failure_class=last_fail.failure_class if last_fail else "",
                    # a skip keeps its reason: a required test that skipped is named with it
                    message=last_fail.message if last_fail else tries[-1].message,
                )
            )
    notes = tuple(f"[{r.name}] {r.note}" for r in results if r.note)
    outcome = SuiteOutcome(
        entry.name, entry.required, entry.min_pass_rate, tuple(tests), notes, require=_required_here(entry, p)
    )
    return EntryRun(entry, outcome, edir, tuple(results), p, attempts, tuple(reruns))


def _required_here(entry: GateSuite, p: plan_mod.Plan) -> tuple[str, ...]:
    """The entry's required tests that this run's plan (its runner's share) selects: a test planned on
    another runner is that runner's to prove."""
    planned = [it.nodeid for g in p.groups for it in g.items]
    return tuple(r for r in entry.require if any(r.startswith(n) or n.startswith(r) for n in planned))


# --------------------------------------------------------------------------------------------
# the gate
# --------------------------------------------------------------------------------------------


def run_gate(
    gate: Gate, opts: GateOptions, out: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic
) -> GateRun:
    """Run every suite of ``gate``, judge, and write the reports (see the module docstring).

    Args:
        gate: the validated gate.
        opts: how to run.
        out: where console lines go (the live lines, the verdict).
        clock: seconds (a seam for tests).

    Returns:
        The :class:`GateRun` (``exit_code`` 0 only on PASS).

    Raises:
        RegistryError: an extra suites tree is missing or a durations file is broken.
        plan_mod.PlanError: ``opts.runner`` is set and no entry has a group on that runner.
    """
    start = clock()
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    sha, dirty = git_state(opts.repo_root)
    rnd = random.SystemRandom()
    hyp = next(s for s in (opts.hypothesis_seed, gate.hypothesis_seed, rnd.randrange(2**31)) if s is not None)
    work = next(s for s in (opts.workload_seed, gate.workload_seed, rnd.randrange(2**31)) if s is not None)
    target = sglang_target.current()  # the CLI selected it (--sglang); its pytest runs inherit it
    info = render.RunInfo(
        gate=gate.name,
        run_dir=str(opts.run_dir),
        git_sha=sha,
        git_dirty=dirty,
        sglang_version=target.version,
        sglang_required=gate.sglang_version,
        hypothesis_seed=hyp,
        workload_seed=work,
        sglang=tuple(target.to_dict().items()),
    )
    out(
        f"gate {gate.name}: {len(gate.suites)} suite(s); git {sha[:12]}{' (dirty)' if dirty else ''}; "
        f"{target.label()}; seeds hypothesis={hyp} workload={work}; run dir {opts.run_dir}"
    )
    reg = collector.collect(opts.repo_root.resolve(), list(opts.suites_dirs))
    runs = [r for r in (run_entry(gate, e, reg, opts, info, out) for e in gate.suites) if r is not None]
    if not runs:  # only with opts.runner: every entry was left out
        raise plan_mod.PlanError(
            f"gate {gate.name} runs nothing on runner {opts.runner!r}; "
            f"`harness gate plan {gate.name}` lists its runner labels"
        )
    v = judge([r.outcome for r in runs], gate.sglang_version, info.sglang_version)
    info = replace(info, wall_time=clock() - start)
    env = repro.environment()
    repros: dict[str, str] = {}
    for r in runs:
        for t in r.outcome.tests:
            if t.failed:
                path = collect_evidence(gate, r, t, info, opts, env)
                repros[repro_key(r.entry.name, t)] = str(path.relative_to(opts.run_dir))
    write_reports(runs, info, v, repros, opts.run_dir, opts.repo_root)
    history.append(
        opts.run_dir.parent / history.FILE_NAME,
        opts.run_dir.name,
        {t.nodeid: list(t.attempts) for r in runs for t in r.outcome.tests},
        gate=gate.name,
        git_sha=sha,
    )
    return GateRun(gate=gate, info=info, verdict=v, run_dir=opts.run_dir, repros=repros)


def write_reports(
    runs: list[EntryRun],
    info: render.RunInfo,
    v: Verdict,
    repros: dict[str, str],
    run_dir: Path,
    repo_root: Path = page.REPO_ROOT,
) -> None:
    """``report/``: ``junit.xml`` (every group and rerun, stamped), ``summary.md``, ``result.json``,
    ``durations.json`` and ``index.html`` (:mod:`harness.report.page`: the verdict table, the flaky
    record — this run's reruns and the history's flaky tests, read before this run is appended)."""
    out = RunDir(run_dir).report
    out.mkdir(parents=True, exist_ok=True)
    parts: list[tuple[str, dict[str, str]]] = []

    def part(res: GroupResult, jdir: Path, name: str, **extra: str) -> None:
        xml = jdir / f"{res.name}.xml"
        text = xml.read_text(encoding="utf-8") if xml.is_file() else f'<testsuite name="{name}" tests="0"/>'
        parts.append(
            (text, {"group": name, "topology": res.topology, "runner": res.runner, **dict(res.properties), **extra})
        )

    for r in runs:
        for res in r.results:
            part(
                res,
                RunDir(r.dir).junit,
                f"{r.entry.name}/{res.name}",
                suite=r.entry.name,
                required=str(r.entry.required).lower(),
            )
        for k, (nodeid, res, rdir) in enumerate(r.reruns, 1):
            part(
                res,
                RunDir(rdir).junit,
                f"{r.entry.name}/{res.name}/rerun-{k}",
                suite=r.entry.name,
                required=str(r.entry.required).lower(),
                rerun_of=nodeid,
            )
    atomic.write_text(out / "junit.xml", render.merged_junit(info, parts))
    atomic.write_text(out / "summary.md", render.summary_md(info, v, repros, page=page.INDEX))
    atomic.write_json(out / "result.json", render.result_json(info, v, repros))
    # measured durations: the next plan's est_time (and so the live ETA) comes from them
    measured = report.durations([res for r in runs for res in r.results])
    atomic.write_json(out / "durations.json", measured, sort_keys=True)
    groups = [replace(res, name=f"{r.entry.name}/{res.name}") for r in runs for res in r.results]
    groups += [
        replace(res, name=f"{r.entry.name}/{res.name}/rerun-{k}")
        for r in runs
        for k, (_, res, _) in enumerate(r.reruns, 1)
    ]
    recent = history.flaky(history.read(run_dir.parent / history.FILE_NAME), FLAKY_WINDOW)
    header = page.Header(
        f"gate {info.gate}",
        v.passed,
        tuple(v.reasons),
        tuple(v.warnings),
        info.wall_time,
        {"hypothesis": info.hypothesis_seed, "workload": info.workload_seed},
        sglang=sglang_target.stamp(),
    )
    tables = render.page_tables(v, repros, [(t.nodeid, t.pass_rate, t.passed, t.attempts) for t in recent])
    page.write(out, header, groups, tables, repo_root=repo_root)
