"""Plan: selections → one group per topology (its runner label), shards, the GitHub Actions matrix.

A group is what one pytest process runs on one runner. Sharding splits a group's items by
(measured) est_time with the longest-processing-time rule: longest first, each onto the least
loaded shard — within 4/3 of the ideal in the worst case, close to ideal on real mixes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from harness import topology as topo_mod
from harness.rerun.spec_resolve import Selection


class PlanError(ValueError):
    """A plan cannot be made (unknown topology, bad shard arguments). One line."""


@dataclass(frozen=True)
class Item:
    """One unit of work: a pytest node id.

    Attributes:
        nodeid: display id, e.g. ``suites/pd/test_x.py::TestC::test_y`` (also the spec to rerun it).
        target: what pytest gets (absolute path + ``::`` part).
        est_time: seconds.
        file_rel: the file's display path.
        engine: the test's engine (its ``engine`` marker): real sglang servers need real GPUs on a GPU
            topology, so a simulated group skips such a test.
    """

    nodeid: str
    target: str
    est_time: float
    file_rel: str
    engine: str = "sim"

    @property
    def needs_real_gpus(self) -> bool:
        """Whether the test, on a GPU topology, runs only on real GPUs (real servers)."""
        return self.engine != "sim"


@dataclass(frozen=True)
class Group:
    """The work of one topology (one runner label), possibly one shard of it."""

    topology: str
    runner: str
    items: tuple[Item, ...]
    gpus: int = 0
    allow_simulation: bool = True
    shards: int = 1
    shard_index: int | None = None

    @property
    def name(self) -> str:
        """Unique within a plan: the topology, plus the shard when sharded."""
        return self.topology if self.shard_index is None else f"{self.topology}-{self.shard_index + 1}of{self.shards}"

    @property
    def est_time(self) -> float:
        return sum(i.est_time for i in self.items)

    @property
    def specs(self) -> list[str]:
        return [i.nodeid for i in self.items]

    def runnable(self, simulated: bool | None) -> tuple[Item, ...]:
        """The items that can run when the group's GPUs are ``simulated`` (None: it cannot run here at
        all; False: real GPUs or none needed). On simulated GPUs real servers are skipped."""
        if simulated is None:
            return ()
        if simulated and self.gpus:
            return tuple(i for i in self.items if not i.needs_real_gpus)
        return self.items


@dataclass(frozen=True)
class Plan:
    groups: tuple[Group, ...]

    @property
    def est_time(self) -> float:
        return sum(g.est_time for g in self.groups)


def items_by_topology(selections: list[Selection]) -> dict[str, list[Item]]:
    """Explode selections into items, per topology, first-seen order, duplicates removed."""
    out: dict[str, list[Item]] = {}
    for sel in selections:
        f = sel.suite
        entries = [(t.suffix, t.topologies, t.est_time, t.engine) for t in sel.tests]
        if not entries:  # nothing visible statically (generated tests): run the whole file
            entries = [("", (f.topologies or ("cpu",)), 0.0, "sim")]
        for suffix, topologies, est, engine in entries:
            suffix = suffix + sel.param
            item = Item(nodeid=f.rel + suffix, target=str(f.path) + suffix, est_time=est, file_rel=f.rel, engine=engine)
            for t in topologies:
                bucket = out.setdefault(t, [])
                if all(i.nodeid != item.nodeid for i in bucket):
                    bucket.append(item)
    return out


def compact(items: tuple[Item, ...], file_tests: dict[str, int]) -> list[tuple[str, str]]:
    """(display spec, pytest target) per item, a file whose every test is present collapsed to its path.

    Collapsing keeps command lines and matrices short; it is only done when the file holds nothing
    else (its other tests may belong to other topologies) and no parametrize id narrows an item.

    Args:
        items: a group's items.
        file_tests: file display path → number of tests the file declares (all topologies).
    """
    by_file: dict[str, list[Item]] = {}
    for it in items:
        by_file.setdefault(it.file_rel, []).append(it)
    out: list[tuple[str, str]] = []
    for rel, its in by_file.items():
        whole = any(i.nodeid == rel for i in its) or (
            file_tests.get(rel, -1) == len(its) and all("[" not in i.nodeid for i in its)
        )
        if whole:
            out.append((rel, its[0].target.split("::", 1)[0]))
        else:
            out.extend((i.nodeid, i.target) for i in its)
    return out


def lpt(weights: list[float], n: int) -> list[list[int]]:
    """Longest-processing-time assignment of indices to ``n`` bins.

    Args:
        weights: item weights.
        n: number of bins (≥ 1).

    Returns:
        For each bin, the indices assigned to it (each bin in descending weight order).
    """
    bins: list[list[int]] = [[] for _ in range(n)]
    load = [0.0] * n
    for idx in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        b = min(range(n), key=lambda k: (load[k], k))
        bins[b].append(idx)
        load[b] += weights[idx]
    return bins


def shard(items: tuple[Item, ...], shards: int, index: int) -> tuple[Item, ...]:
    """The items of shard ``index`` of ``shards`` (longest first).

    Raises:
        PlanError: ``index`` not in ``[0, shards)`` or ``shards`` < 1.
    """
    if shards < 1 or not 0 <= index < shards:
        raise PlanError(
            f"--shard-index {index} is not in 0..{shards - 1} (with --shards {shards}); "
            "pick an index below the shard count"
        )
    bins = lpt([i.est_time for i in items], shards)
    return tuple(items[k] for k in bins[index])


def make_plan(
    selections: list[Selection],
    shards: int = 1,
    shard_index: int | None = None,
    max_shard_time: float | None = None,
    get_topology: Callable[[str], topo_mod.Topology] = topo_mod.get,
) -> Plan:
    """Group selections by topology and shard them.

    Args:
        selections: resolved selections.
        shards: split every group into this many shards (1: no split).
        shard_index: keep only this shard of each group (None: keep all shards as separate groups).
        max_shard_time: when set (and ``shards`` is 1), each group gets ``ceil(est/max)`` shards.
        get_topology: topology loader (tests pass their own).

    Returns:
        The :class:`Plan`, groups longest first.

    Raises:
        PlanError: an unknown topology (naming the files that ask for it) or bad shard arguments.
    """
    if shards < 1:
        raise PlanError(f"--shards {shards}: need 1 or more")
    if shard_index is not None and not 0 <= shard_index < shards:
        raise PlanError(f"--shard-index {shard_index} is not in 0..{shards - 1}; pick an index below --shards")
    groups: list[Group] = []
    for name, items in items_by_topology(selections).items():
        try:
            t = get_topology(name)
        except topo_mod.TopologyError as e:
            users = sorted({i.file_rel for i in items})
            raise PlanError(f"{', '.join(users)}: {e}") from None
        base = Group(
            topology=t.name, runner=t.runner, items=tuple(items), gpus=t.total_gpus, allow_simulation=t.allow_simulation
        )
        n = shards
        if max_shard_time and shards == 1:
            n = max(1, min(len(items), math.ceil(base.est_time / max_shard_time)))
        if n == 1:
            groups.append(base)
            continue
        indices = [shard_index] if shard_index is not None else list(range(n))
        for k in indices:
            groups.append(replace(base, items=shard(base.items, n, k), shards=n, shard_index=k))
    groups.sort(key=lambda g: (-g.est_time, g.name))
    return Plan(groups=tuple(groups))


def to_matrix(plan: Plan, suites_dirs: list[str] | None = None) -> dict:
    """The plan as a GitHub Actions matrix (``strategy.matrix: ${{ fromJSON(...) }}``).

    One ``include`` entry per group (per shard when sharded): ``name``, ``runner`` (for
    ``runs-on``), ``topology``, ``specs``, ``est_time``, ``shards``, ``shard_index``, ``gpus``,
    ``suites_dirs``. An entry given back to ``rerun-test --plan-entry`` reruns exactly that group.
    """
    return {
        "include": [
            {
                "name": g.name,
                "runner": g.runner,
                "topology": g.topology,
                "specs": g.specs,
                "est_time": round(g.est_time, 1),
                "shards": g.shards,
                "shard_index": g.shard_index if g.shard_index is not None else 0,
                "gpus": g.gpus,
                "suites_dirs": list(suites_dirs or []),
            }
            for g in plan.groups
        ]
    }
