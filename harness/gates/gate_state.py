"""What one gate run holds: how it runs (:class:`GateOptions`), each try of a failing test
(:class:`Attempt`), each suite entry's run (:class:`EntryRun`) and the finished run (:class:`GateRun`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from harness.gates import render
from harness.gates.model import Gate, GateSuite
from harness.gates.verdict import SuiteOutcome, Verdict
from harness.report.results import GroupResult
from harness.rerun import plan as plan_mod


@dataclass(frozen=True)
class GateOptions:
    """How to run a gate.

    Attributes:
        repo_root: the repository (its ``suites/``; pytest's rootdir).
        run_dir: this run's directory.
        simulate: let groups whose GPUs are missing run on Ray logical GPUs (if their topology allows it).
        ray_address: join this Ray cluster.
        gpus: real GPUs on this machine.
        jobs: most groups at once within a suite.
        python: interpreter for pytest.
        suites_dirs: extra test trees (rerun-test's ``--suites-dir``).
        hypothesis_seed, workload_seed: override the gate's seeds (None: the gate's, else random).
        runner: run only the groups of this CI runner label (:func:`harness.gates.gate_plan.runner_label`);
            entries with none there are left out of the run and its verdict (None: every group).
        joined_gpus: with ``ray_address``: the joined cluster's GPUs as its nodes reported them
            (:func:`harness.cluster.nodes.gpu_kind`), stamped on the report.
    """

    repo_root: Path
    run_dir: Path
    simulate: bool = False
    ray_address: str | None = None
    gpus: int = 0
    jobs: int = 1
    python: str = sys.executable
    suites_dirs: tuple[Path, ...] = ()
    hypothesis_seed: int | None = None
    workload_seed: int | None = None
    runner: str | None = None
    joined_gpus: str | None = None


@dataclass(frozen=True)
class Attempt:
    """One run of one test: its outcome, failure class and where its evidence is."""

    outcome: str
    failure_class: str
    message: str
    run_dir: Path  # the group's --run-dir of this attempt
    log: Path  # its pytest.log


@dataclass(frozen=True)
class GateRun:
    """A finished gate run."""

    gate: Gate
    info: render.RunInfo
    verdict: Verdict
    run_dir: Path
    repros: dict[str, str]

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict.passed else 1


@dataclass(frozen=True)
class EntryRun:
    entry: GateSuite
    outcome: SuiteOutcome
    dir: Path
    results: tuple[GroupResult, ...]
    plan: plan_mod.Plan | None
    attempts: dict[tuple[str, str], tuple[Attempt, ...]]  # (group, nodeid) → attempts (tests that failed)
    reruns: tuple[tuple[str, GroupResult, Path], ...]  # (nodeid, result, rerun dir)
