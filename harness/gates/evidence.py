"""A failing test's evidence, kept with the gate's report: the workers' logs and ledgers the test owned
(or, when it recorded none, those written while it ran), an excerpt of each ledger with its broken
rules, the pytest log of its last failing run, per-test reports the suite wrote, and its ``repro.json``
(:mod:`harness.gates.bundle`) under ``<run_dir>/report/failures/<test>/``."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from harness import ledger
from harness import topology as topo_mod
from harness.gates import bundle as repro
from harness.gates import render
from harness.gates.model import Gate
from harness.gates.gate_state import EntryRun, GateOptions
from harness.gates.verdict import TestOutcome
from harness.plugins import seeds as seeds_mod
from harness.rerun import execute
from harness import rundir
from harness.rundir import RunDir

LEDGER_TAIL = 20


def _records(group_dir: Path) -> dict[tuple[str, str], dict]:
    path = group_dir / seeds_mod.RECORD_FILE
    out: dict[tuple[str, str], dict] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
                out[(Path(rec["path"]).name, rec["suffix"])] = rec
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return out


def _touched_workers(group_dir: Path, since: float) -> list[str]:
    """Workers whose log or ledger was written after ``since`` (a test that recorded no owned workers).

    A fixture may own workers without telling the harness; the files it wrote while the test ran
    are the best evidence left. Workers idle during the test are left out.
    """
    names: set[str] = set()
    run = RunDir(group_dir)
    for sub, ext in ((run.workers, ".log"), (run.ledger, ".jsonl")):
        for p in sub.glob(f"*{ext}"):
            try:
                if p.stat().st_mtime >= since:
                    names.add(p.name[: -len(ext)])
            except OSError:
                continue
    return sorted(names)


def _ledger_excerpt(path: Path) -> dict:
    try:
        events = ledger.read(path)
        violations = [str(v) for v in ledger.check(events)]
    except (OSError, ValueError, TypeError) as e:
        return {"error": f"unreadable ledger: {e}"}
    tail = []
    for line in path.read_text(encoding="utf-8").splitlines()[-LEDGER_TAIL:]:
        try:
            tail.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return {"events": len(events), "violations": violations[:LEDGER_TAIL], "tail": tail}


def _copy_test_reports(group_dir: Path, nodeid: str, dest: Path) -> list[str]:
    """Copy per-test reports that suites wrote under ``<group run dir>/report/`` (e.g. ``pd/<test>.json``).

    Suites name such files after the node id with every other character replaced by ``_``.
    """
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid)
    copied = []
    base = RunDir(group_dir).report
    for p in sorted(base.rglob(f"{stem}.*")) if base.is_dir() else []:
        rel = p.relative_to(group_dir)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dest / rel)
        copied.append(str(rel))
    return copied


def repro_key(suite: str, test: TestOutcome) -> str:
    """How reports name a failing test's bundle: ``suite/group::nodeid`` (a test may run in several groups)."""
    return f"{suite}/{test.group}::{test.nodeid}"


def collect_evidence(
    gate: Gate, run: EntryRun, test: TestOutcome, info: render.RunInfo, opts: GateOptions, env: dict
) -> Path:
    """Copy a failing test's worker logs, ledgers and pytest log, and write its ``repro.json``.

    Returns:
        The ``repro.json`` path.
    """
    nodeid = test.nodeid
    tries = run.attempts[(test.group, nodeid)]
    last = next(a for a in reversed(tries) if a.outcome in ("failed", "error"))
    group = next(g for g in run.plan.groups if g.name == test.group) if run.plan else None
    dest = RunDir(opts.run_dir).report / "failures" / rundir.safe_name(f"{run.entry.name}-{test.group}-{nodeid}")
    dest.mkdir(parents=True, exist_ok=True)
    files: list[str] = []
    if last.log.is_file():
        shutil.copy2(last.log, dest / "pytest.log")
        files.append("pytest.log")
    file_rel = group and next((i.file_rel for i in group.items if nodeid.startswith(i.file_rel)), "")
    suffix = nodeid[len(file_rel) :] if file_rel else ""
    rec = _records(last.run_dir).get((Path(file_rel or nodeid.split("::", 1)[0]).name, suffix), {})
    workers = list(rec.get("workers", []))
    if not workers and rec.get("start"):
        workers = _touched_workers(last.run_dir, float(rec["start"]))
    excerpt = {}
    for w in workers:
        for src in (RunDir(last.run_dir).worker_log(w), RunDir(last.run_dir).ledger_file(w)):
            if src.is_file():
                sub = src.parent.name  # the same layout beside the bundle
                (dest / sub).mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / sub / src.name)
                files.append(f"{sub}/{src.name}")
        lp = RunDir(last.run_dir).ledger_file(w)
        if lp.is_file():
            excerpt[w] = _ledger_excerpt(lp)
    files += _copy_test_reports(last.run_dir, nodeid, dest)
    topo = test.group if group is None else group.topology
    try:
        engine_args = {r.name: list(r.engine_args) for r in topo_mod.get(topo).roles}
    except topo_mod.TopologyError:
        engine_args = {}
    simulated = bool(group and execute.simulation(group, opts.gpus, joined=bool(opts.ray_address)))
    name = Path(file_rel or nodeid.split("::", 1)[0]).name
    data = repro.bundle(
        spec=nodeid,
        gate=gate.name,
        suite=run.entry.name,
        topology=topo,
        simulated=simulated,
        engine=run.entry.engine,
        hypothesis_seed=info.hypothesis_seed,
        workload_base=info.workload_seed,
        workload_seed=seeds_mod.derive(info.workload_seed, name, suffix),
        engine_args=engine_args,
        env=env,
        sglang_version=info.sglang_version,
        git_sha=info.git_sha,
        sglang=dict(info.sglang) or None,
        failure={
            "class": test.failure_class,
            "outcome": test.outcome,
            "message": test.message,
            "attempts": list(test.attempts),
        },
        workers=workers,
        files=files,
        ledger_excerpt=excerpt,
    )
    return repro.write(dest / "repro.json", data)
