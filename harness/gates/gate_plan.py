"""What a gate runs and where: each suite entry's plan, and the gate as a GitHub Actions matrix.

Pure, and standard library only (the CI plan job runs it before ``./dev install``). One matrix entry per
runner label, so every group runs on exactly one job; with ``simulate`` a GPU group may run on the CPU
runner. Detail: docs/modules.md.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from harness import topology as topo_mod
from harness.gates.model import Gate, GateSuite
from harness.rerun import collector, spec_resolve
from harness.rerun import plan as plan_mod
from harness.rerun import spec_grammar as spec_mod

#: The topology whose runner takes the simulated groups of a ``--simulate`` plan.
CPU_TOPOLOGY = "cpu"


def select(entry: GateSuite, reg: collector.Registry) -> list[spec_resolve.Selection]:
    """The selections of one entry.

    Raises:
        spec_resolve.ResolveError: a spec resolves to nothing, or a directory holds no suite file with tests.
    """
    out: list[spec_resolve.Selection] = []
    for v in entry.select:
        if not v.endswith("/"):
            out.append(spec_resolve.resolve_one(spec_mod.parse_spec(v), reg))
            continue
        hits = [f for f in reg.files if f.rel.startswith(v) and not f.disabled and (f.tests or f.error)]
        if not hits:
            raise spec_resolve.ResolveError(
                f"{v!r} holds no registered suite file with tests; fix the path or remove it"
            )
        for f in hits:
            if f.error:
                raise spec_resolve.ResolveError(f.error)
            out.append(spec_resolve.Selection(suite=f, tests=f.tests, whole=True))
    return out


def entry_plan(
    entry: GateSuite,
    reg: collector.Registry,
    simulate: bool,
    get_topology: Callable[[str], topo_mod.Topology] = topo_mod.get,
) -> plan_mod.Plan:
    """The plan of one entry: its selections grouped per topology, limited to ``entry.topologies``.

    Without ``simulate`` no group may simulate GPUs (a group needing missing GPUs is then not runnable).

    Raises:
        spec_resolve.ResolveError, plan_mod.PlanError: nothing to run, or an unknown topology.
    """
    p = plan_mod.make_plan(select(entry, reg), get_topology=get_topology)
    groups = [g for g in p.groups if not entry.topologies or g.topology in entry.topologies]
    if not groups:
        raise plan_mod.PlanError(
            f"selects no test declared for {', '.join(entry.topologies)}; "
            f"the selected tests run on {', '.join(g.topology for g in p.groups)}"
        )
    if not simulate:
        groups = [replace(g, allow_simulation=False) for g in groups]
    return plan_mod.Plan(tuple(groups))


def runner_label(group: plan_mod.Group, get_topology: Callable[[str], topo_mod.Topology] = topo_mod.get) -> str:
    """The CI runner label that runs ``group`` (a group of :func:`entry_plan`).

    A GPU group that may simulate (its topology allows it and the plan was made with ``simulate``)
    runs on the :data:`CPU_TOPOLOGY`'s runner; every other group on its own topology's runner.

    Raises:
        topo_mod.TopologyError: the CPU topology is missing (only asked for a simulated GPU group).
    """
    if group.gpus and group.allow_simulation:
        return get_topology(CPU_TOPOLOGY).runner
    return group.runner


def artifact_name(gate: str, label: str) -> str:
    """The name a CI job uploads its gate report under (what ``harness gate verdict`` looks for)."""
    return f"gate-{gate}-{label}"


def matrix(
    gate: Gate, reg: collector.Registry, simulate: bool, get_topology: Callable[[str], topo_mod.Topology] = topo_mod.get
) -> dict:
    """The gate as a GitHub Actions matrix: one ``include`` entry per runner label, sorted by label.

    Each entry: ``name`` and ``runner`` (the label), ``artifact`` (:func:`artifact_name`),
    ``topologies`` and ``suites`` (what runs there), in first-seen order: gate order, then each
    entry's plan order (longest group first).

    Raises:
        spec_resolve.ResolveError, plan_mod.PlanError, spec_mod.SpecError: an entry cannot be planned.
        topo_mod.TopologyError: a simulated GPU group but no CPU topology.
    """
    by_label: dict[str, dict] = {}
    for entry in gate.suites:
        for g in entry_plan(entry, reg, simulate, get_topology).groups:
            label = runner_label(g, get_topology)
            row = by_label.setdefault(
                label,
                {
                    "name": label,
                    "runner": label,
                    "artifact": artifact_name(gate.name, label),
                    "topologies": [],
                    "suites": [],
                },
            )
            for key, value in (("topologies", g.topology), ("suites", entry.name)):
                if value not in row[key]:
                    row[key].append(value)
    return {"include": [by_label[k] for k in sorted(by_label)]}
