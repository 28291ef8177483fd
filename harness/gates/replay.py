"""``rerun-test --from repro.json``: rerun one failing test with its seeds, and say whether it reproduces.

The test runs alone in its recorded topology with the bundle's seeds and engine; the answer is one line,
``REPRODUCED`` or ``NOT REPRODUCED``, then the environment differences. Exit status and command line are
``rerun-test``'s. Detail: docs/modules.md.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from harness import runs
from harness.gates import bundle as repro
from harness.gates.gate_runner import item_for, live_lines, run_one
from harness.rerun import collector, execute, reports, spec_resolve
from harness.rerun import plan as plan_mod
from harness.rerun import spec_grammar as spec_mod


def bundle_target(data: dict) -> str | None:
    """The TARGET a bundle's failure ran on (its tree's root for a source tree, so a rerun from
    another directory finds it), or None for a bundle written before targets were recorded."""
    recorded = data.get("sglang")
    if not isinstance(recorded, dict):
        return None
    return recorded.get("root") if recorded.get("origin") == "tree" else recorded.get("spec")


def reproduce(
    bundle_path: Path,
    repo_root: Path,
    run_dir: Path,
    ray_address: str | None = None,
    gpus: int = 0,
    suites_dirs: tuple[Path, ...] = (),
    out: Callable[[str], None] = print,
    sglang: str | None = None,
) -> int:
    """Rerun the test of a repro bundle.

    Args:
        bundle_path: the ``repro.json``.
        repo_root: the repository whose ``suites/`` hold the test.
        run_dir: where this rerun's evidence goes.
        ray_address: join this cluster instead of a local Ray.
        gpus: real GPUs on this machine.
        suites_dirs: extra test trees.
        out: console lines.
        sglang: the TARGET to rerun on (default: the one the bundle records, else the environment's).

    Returns:
        1 reproduced (the test failed), 0 not reproduced (it passed).

    Raises:
        repro.ReproError: an unusable bundle, or its test or topology is not found here.
        TargetError: the sglang target cannot be used here.
    """
    from harness.targets.sglang import selection as target_mod

    from harness.targets.sglang import resolve as target_resolve

    data = repro.load(bundle_path)
    if sglang is None:  # the bundle chooses what is imported: only from the repository or the target cache
        problem = repro.target_problem(data, repo_root.resolve(), target_resolve.cache_dir().resolve())
        if problem:
            raise repro.ReproError(f"{bundle_path}: {problem}; give --sglang to choose the target")
    target = target_mod.select_for_cli(sglang or bundle_target(data), "rerun-test")
    reg = collector.collect(repo_root.resolve(), list(suites_dirs))
    try:
        sel = spec_resolve.resolve_one(spec_mod.parse_spec(data["spec"]), reg)
        p = plan_mod.make_plan([sel])
    except (spec_mod.SpecError, spec_resolve.ResolveError, plan_mod.PlanError) as e:
        raise repro.ReproError(f"{bundle_path}: {e}") from None
    group = next((g for g in p.groups if g.topology == data["topology"]), None)
    if group is None:
        have = ", ".join(g.topology for g in p.groups)
        raise repro.ReproError(
            f"{bundle_path}: {data['spec']} no longer runs on {data['topology']} (it declares {have}); "
            "rerun it by name with rerun-test"
        )
    seeds = data["seeds"]
    args = [f"--hypothesis-seed={seeds['hypothesis']}", f"--workload-seed={seeds['workload_base']}"]
    if data.get("engine"):
        args += ["--engine", data["engine"]]
    opts = execute.ExecOptions(
        repo_root=repo_root.resolve(), run_dir=run_dir, ray_address=ray_address, gpus=gpus, pytest_args=tuple(args)
    )
    failure = data.get("failure") or {}
    out(
        f"repro: {data['spec']} on {data['topology']} with {target.label()} "
        f"(seeds hypothesis={seeds['hypothesis']} workload={seeds.get('workload')}); "
        f"recorded {failure.get('class') or failure.get('outcome', 'failure')}: {failure.get('message', '')}"
    )
    with runs.record(
        run_dir,
        ["rerun-test", "--from", str(bundle_path)],
        target=target.label(),
        source=str(Path(bundle_path).resolve()),
    ) as rec:
        start = time.monotonic()
        res, att = run_one(group, item_for(group, data["spec"]), opts, reg, live_lines("repro", out))
        page = reports.write_reports(run_dir, [res], target=target)  # the same report files as any rerun
        took = time.monotonic() - start
        if att.outcome in ("failed", "error"):
            same = (
                "same class"
                if att.failure_class == failure.get("class")
                else f"class {att.failure_class}, recorded {failure.get('class')}"
            )
            out(f"REPRODUCED: {data['spec']} {att.outcome} again ({same}) in {took:.1f}s: {att.message}")
            code = 1
        else:
            out(f"NOT REPRODUCED: {data['spec']} {att.outcome} in {took:.1f}s")
            code = 0
        rec.finish("failed" if code else "passed", report=page)
    diffs = repro.env_differences(data.get("environment") or {}, repro.environment())
    recorded = data.get("sglang") or {}
    if recorded and recorded.get("version") != target.version:
        diffs.insert(0, f"sglang: {recorded.get('version')} → {target.version}")
    if data.get("git_sha") and data["git_sha"] != "unknown":
        from harness.gates.gate_runner import git_state

        sha, _ = git_state(repo_root)
        if sha != data["git_sha"]:
            diffs.insert(0, f"git_sha: {data['git_sha']} → {sha}")
    for d in diffs:
        out(f"  differs: {d}")
    out(f"evidence: {run_dir}")
    return code
