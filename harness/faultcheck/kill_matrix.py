"""The kill matrix's runs: the clean run (or the clean results of a test run that already ran the
suites), then one ``python -m pytest --inject-fault NAME`` subprocess per fault, at most ``jobs`` at a
time; each fault's verdict comes from :mod:`.verdicts`. Over 400 lines because the clean run, the fault runs
and their order and shared fork servers are one procedure. The whole method: :mod:`harness.faultcheck`'s
section in docs/modules.md.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Mapping

from harness import faults as fault_catalog
from harness.faultcheck.verdicts import (
    CAUGHT,
    CLEAN,
    FAILING,
    NOT_APPLIED,
    Cell,
    Matrix,
    SuiteRun,
    TestOutcome,
    Verdict,
    build_cells,
    in_suite,
    suite_file,
    suite_group,
    verdict,
)
from harness.faults import source
from harness.faults import STOP_AT_CATCH_LINE
from harness.report import junit
from harness.rundir import REPO_ROOT, RunDir
from harness.engines import fork_preload
from harness.targets.sglang import selection
from harness.targets.sglang.compat import checks
from harness.workers import childpytest, procs

logger = logging.getLogger(__name__)


#: Every suite that asserts accounting (``harness faults check --all``): the unit sweep, ledger,
#: reservation, reclaim and hisparse suites, the in-worker run of the unit suites, the PD pair and
#: e2e suites over Ray, and the real-server suites (the DeepSeek-V4 one needs GPUs: n/a elsewhere).
ACCOUNTING_SUITES: tuple[str, ...] = (
    "suites/unit/disaggregation/test_swa_prealloc_accounting.py",
    "suites/unit/disaggregation/test_decode_prealloc_ledger.py",
    "suites/unit/disaggregation/test_decode_reservation.py",
    "suites/unit/disaggregation/test_decode_radix_swa_reclaim.py",
    "suites/unit/mem_cache/test_hisparse_allocator.py",
    "suites/unit/test_in_ray_worker.py",
    "suites/disaggregation/test_disaggregation_basic.py",
    "suites/disaggregation/test_disaggregation_dsv4.py",
    "suites/e2e/test_swa_accounting.py",
    "suites/disaggregation/test_disaggregation_basic_server.py",
    "suites/disaggregation/test_disaggregation_swa_server.py",
    "suites/disaggregation/test_disaggregation_dsv4_server.py",
)

#: Fault name -> the capabilities of the sglang target it needs (names in
#: ``harness.targets.sglang.compat.CAPABILITIES``): a fault breaking a step a release does not have,
#: or whose suites cannot run on this device for that release, cannot apply to a target lacking them.
#: Such a fault is reported not applied (with the missing capability) and neither run nor counted;
#: a patch that does not apply to the target's source is reported the same way.
NEEDS: dict[str, tuple[str, ...]] = {
    "swa-tail-unaligned": ("decode-prealloc-swa-tail",),
    "swa-tail-short": ("decode-prealloc-swa-tail",),
    "release-leaks-swa": ("free-kv-row-segments",),
    "prealloc-no-swa-evict": ("decode-radix-swa-reclaim",),
    "swa-full-length": ("decode-prealloc-swa-tail",),
    "decode-reserve-unaligned": ("decode-reservation",),
    "hisparse-budget-swa": ("hisparse-prealloc", "hisparse-device", "decode-swa-reservation"),
    "decode-skips-swa-evict": ("free-swa-out-of-window-slots",),
}

#: Seconds one pytest subprocess may run before it is killed (and its run counted as broken).
DEFAULT_TIMEOUT_S = 900.0
#: Fault runs at a time. One more than the 2-core CI runner's cores: the real-server runs spend much
#: of their time waiting on sglang's timers (a release's grace, the bootstrap retries, a dead peer's
#: heartbeat) with their cores idle. The whole catalog, back to back on one clean report: 200.9 s and
#: 346.6 CPU-s at 3, 220.7 s and 325.5 CPU-s at 2.
DEFAULT_JOBS = 3
#: How long a check waits for the process writing its clean report (``clean_writer``) to finish.
CLEAN_WRITER_TIMEOUT_S = 3600.0
#: Hypothesis and workload seeds of every run, so the sweep draws the same cases and the PD suites
#: the same workloads, clean and broken.
HYPOTHESIS_SEED = 0
WORKLOAD_SEED = 0


def targets_for(name: str) -> tuple[str, ...]:
    """The selections a fault is checked against: its catalog entry's ``suites``.

    Args:
        name: a fault name.

    Returns:
        Node ids or files, relative to the repository root.

    Raises:
        FaultError: an unknown fault name, or one that names no suite.
    """
    fault = fault_catalog.get(name)
    if not fault.suites:
        raise fault_catalog.FaultError(f"fault {name} names no suite that carries its evidence; add Fault.suites")
    return fault.suites


# ------------------------------------------------------------------------------------- JUnit


def parse_junit(path: Path, root: Path = REPO_ROOT) -> tuple[TestOutcome, ...]:
    """Read the test cases of a pytest JUnit XML report through :func:`harness.report.junit.read_junit`.

    Args:
        path: the XML file (``junit_family=xunit1``, which carries files).
        root: the directory test files are relative to.

    Returns:
        One :class:`TestOutcome` per test case; empty when the file is missing or not XML (a run
        killed before pytest wrote it).
    """
    try:
        cases = junit.read_junit(path, root)
    except ValueError:
        return ()
    # the evidence is looked for in the whole message and traceback, not only the first line
    return tuple(
        TestOutcome(
            test_id=c.nodeid, file=c.file, outcome=c.outcome, message=c.message, text=f"{c.reason}\n{c.traceback}"
        )
        for c in cases
    )


# ------------------------------------------------------------------------------------- running


def checks_env(fault: str) -> dict[str, str]:
    """The sglang-check selection a fault's runs get: its catalog entry's ``sglang_checks`` (the
    checks that would stop a server before the harness's oracle looks are off), else nothing (every
    check on, as in any run).

    >>> checks_env("decode-skips-failed-release")
    {'HARNESS_SGLANG_CHECKS': 'invariant-strict,mem-check-busy,kv-page-invariants,debug-memory-pool'}
    >>> checks_env("swa-tail-short")
    {}
    """
    only = fault_catalog.get(fault).sglang_checks
    return {checks.SELECT_ENV: only} if only else {}


def run_suites(
    label: str,
    suites: Iterable[str],
    out_dir: Path,
    *,
    fault: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    root: Path = REPO_ROOT,
    stop_at_catch: bool = False,
) -> SuiteRun:
    """Run suites in a fresh pytest subprocess, with ``fault`` active (or none), and read its JUnit XML.

    Args:
        label: names the run's files (``<out_dir>/junit/<label>.xml``, ``<out_dir>/workers/<label>.log``).
        suites: suite paths, relative to ``root``.
        out_dir: the run directory.
        fault: the fault to inject (``--inject-fault``); None runs clean. ``HARNESS_FAULTS`` is
            removed from the child's env either way, so the caller's cannot leak into a run.
        timeout_s: the run is killed (its whole process group) after this many seconds.
        root: where pytest runs.
        stop_at_catch: with ``fault``, the run stops after the first test that catches it (``--stop-at-catch``);
            the result's ``stop_at_catch`` says whether it did.

    Returns:
        The :class:`SuiteRun`.
    """
    suites = tuple(suites)
    junit = RunDir(out_dir).junit_file(label)
    log = RunDir(out_dir).worker_log(label)
    junit.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)
    # The fault goes in through the plugin's --inject-fault (it sets HARNESS_FAULTS for the session and
    # everything the tests start); a value inherited from the caller must not leak into any run.
    fired_file = out_dir / "fired" / f"{label}.txt"
    fired_file.parent.mkdir(parents=True, exist_ok=True)
    fired_file.unlink(missing_ok=True)
    env = childpytest.environment({source.FIRED_ENV: str(fired_file)}, drop=[fault_catalog.ENV_VAR])
    cmd = childpytest.command(
        suites,
        junit=junit,
        run_dir=out_dir / "pytest" / label,
        before=["-q", "-p", "no:cacheprovider"],
        after=[f"--hypothesis-seed={HYPOTHESIS_SEED}", f"--workload-seed={WORKLOAD_SEED}"],
    )
    if fault is not None:
        cmd += ["--inject-fault", fault, *(["--stop-at-catch"] if stop_at_catch else [])]
        env.update(checks_env(fault))
    logger.info("run %s: %s", label, " ".join(cmd))
    start = time.monotonic()
    # One OpenMP / BLAS thread (the runs go side by side, and beside the tests in CI), started as a fork
    # of an interpreter that imported sglang's third-party graph; each imports sglang (patched or not) itself.
    argv, env = fork_preload.python_command(cmd, env)
    returncode, timed_out = procs.run_logged(argv, cwd=root, env=env, log=log, timeout_s=timeout_s)
    if timed_out:
        logger.error("run %s passed its %.0f s limit; its process group was killed", label, timeout_s)
    wall = time.monotonic() - start
    return SuiteRun(
        label=label,
        suites=suites,
        returncode=returncode,
        outcomes=parse_junit(junit, root),
        wall_s=wall,
        junit=junit,
        log=log,
        fired=frozenset(source.fired(fired_file)),
        stop_at_catch=stop_at_catch and fault is not None and _stopped_at_catch(log),
    )


def _stopped_at_catch(log: Path) -> bool:
    """Whether the run's log has pytest's line for a session stopped by ``--stop-at-catch``."""
    try:
        return STOP_AT_CATCH_LINE in log.read_text(errors="replace")
    except OSError:
        return False


# ------------------------------------------------------------------------------------- matrix


def run_clean(
    suites: tuple[str, ...],
    out_dir: Path,
    *,
    jobs: int = DEFAULT_JOBS,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    root: Path = REPO_ROOT,
) -> SuiteRun:
    """The clean run of ``suites``: one subprocess per group of suites
    (:func:`~harness.faultcheck.verdicts.suite_group`), ``jobs`` at a time, merged into one :class:`SuiteRun`.

    Args:
        suites: the suite paths.
        out_dir: the run directory.
        jobs: subprocesses at a time.
        timeout_s: limit of each subprocess.
        root: the repository root.

    Returns:
        The merged run: its outcomes are all groups' outcomes, its exit code 0 only when every
        group's was 0 (else the first non-zero one), its wall time the longest group's.
    """
    groups: dict[str, list[str]] = {}
    for suite in suites:
        groups.setdefault(suite_group(suite), []).append(suite)
    if len(groups) <= 1:
        return run_suites(CLEAN, suites, out_dir, timeout_s=timeout_s, root=root)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        parts = list(
            pool.map(
                lambda item: run_suites(
                    f"{CLEAN}-{item[0]}", tuple(item[1][1]), out_dir, timeout_s=timeout_s, root=root
                ),
                enumerate(groups.items()),
            )
        )
    failed = [p.returncode for p in parts if p.returncode != 0]
    return SuiteRun(
        label=CLEAN,
        suites=suites,
        returncode=failed[0] if failed else 0,
        outcomes=tuple(o for p in parts for o in p.outcomes),
        wall_s=max(p.wall_s for p in parts),
        junit=parts[0].junit.parent,
        log=parts[0].log.parent,
    )


def clean_from_junit(path: Path, suites: tuple[str, ...], root: Path = REPO_ROOT) -> SuiteRun:
    """The clean run read from the JUnit XML (``junit_family=xunit1``) of a run that ran ``suites``.

    It passes when every suite has at least one passing test in the report and none of its tests
    failed; a suite the report does not cover fails it (its message names the suite).

    Args:
        path: the JUnit XML of an earlier pytest run (e.g. CI's ``./dev test``).
        suites: the suites the faults target.
        root: the repository root (test files in the report are relative to it).

    Returns:
        A :class:`SuiteRun` labelled ``clean`` holding the suites' outcomes (wall time 0).
    """
    outcomes = tuple(o for o in parse_junit(path, root) if any(in_suite(o, s) for s in suites))
    missing = [s for s in suites if not any(in_suite(o, s) and o.outcome == "passed" for o in outcomes)]
    failing = any(o.outcome in FAILING for o in outcomes)
    if missing:
        logger.error("%s has no passing test of %s: run them there, or drop --clean-junit", path, ", ".join(missing))
    return SuiteRun(
        label=CLEAN,
        suites=suites,
        returncode=1 if (missing or failing) else 0,
        outcomes=outcomes if not missing else (),
        wall_s=0.0,
        junit=path,
        log=path,
    )


def _clean_when_written(
    path: Path | None, writer: tuple[int, float | None] | None, suites: tuple[str, ...], root: Path
) -> SuiteRun:
    """The clean run from ``path`` once process ``writer`` (pid, start time) has exited (a missing
    report fails it)."""
    assert path is not None and writer is not None
    pid, start = writer
    logger.info("waiting for process %d to finish the clean report %s", pid, path)
    # No start time: it was gone before the check began.
    left = procs.wait_gone([pid], CLEAN_WRITER_TIMEOUT_S, {pid: start}) if start is not None else []
    if left or not path.is_file():
        why = (
            f"process {pid} still runs after {CLEAN_WRITER_TIMEOUT_S:.0f} s"
            if left
            else f"process {pid} exited without writing it"
        )
        logger.error("no clean report at %s: %s", path, why)
        return SuiteRun(label=CLEAN, suites=suites, returncode=1, outcomes=(), wall_s=0.0, junit=path, log=path)
    return clean_from_junit(path, suites, root)


def target_lacks(names: Iterable[str], *, root: Path = REPO_ROOT, timeout_s: float = 300.0) -> dict[str, str]:
    """Which faults cannot apply to the sglang target this process selected, and why.

    The capabilities are probed in one subprocess (probing imports sglang; the caller does not need
    it), which inherits the target through ``HARNESS_SGLANG`` / ``PYTHONPATH``.

    Args:
        names: fault names.
        root: the repository root.
        timeout_s: limit of the probe.

    Returns:
        Fault name -> one line naming the missing capability, for the faults that do not apply.

    Raises:
        RuntimeError: the probe itself failed (the target does not import).
    """
    wanted = {n: NEEDS.get(n, ()) for n in names}
    caps = sorted({c for needs in wanted.values() for c in needs})
    if not caps:
        return {}
    code = (
        "import json, sys; from harness.targets.sglang import compat, selection; selection.current(); "
        "print(json.dumps({c: compat.missing(c) for c in sys.argv[1:]}))"
    )
    env = {k: v for k, v in os.environ.items() if k != fault_catalog.ENV_VAR}
    done = subprocess.run(
        [sys.executable, "-c", code, *caps],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"probing the sglang target's capabilities failed: {tail}")
    missing = json.loads(done.stdout.strip().splitlines()[-1])
    out = {}
    for name, needs in wanted.items():
        lacking = [f"{c} ({missing[c]})" for c in needs if missing.get(c)]
        if lacking:
            out[name] = "the sglang target lacks " + "; ".join(lacking)
    return out


def starts_servers(selection: str) -> bool:
    """Whether a suite selection starts real sglang servers (a ``*_server.py`` module: a stack start of
    tens of seconds, and sglang's own waits on the failure paths)."""
    return suite_file(selection).endswith("_server.py")


def starts_servers_any(selections: Iterable[str]) -> bool:
    """Whether any of a run's selections starts real servers (:func:`starts_servers`)."""
    return any(starts_servers(s) for s in selections)


def estimate(name: str, selections: tuple[str, ...]) -> float:
    """Seconds a fault's run is expected to take: its catalog ``est_s`` when it runs its catalog
    selections, else 0 (not known: ``--suite`` chose others)."""
    fault = fault_catalog.get(name)
    return fault.est_s if tuple(selections) == tuple(fault.suites) else 0.0


def submission_order(plan: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The order fault runs are handed to the ``jobs`` workers: longest first (:func:`estimate`), and
    among runs of no known length those that start real servers first (the most server selections
    first); catalog order between equals. A long run handed out late finishes alone while the other
    workers idle (in catalog order, a fresh clone's check handed out the malformed bootstrap address's
    run, 92 s, second to last; the last 30 s it ran by itself); the short runs fill the end instead."""
    return sorted(plan, key=lambda name: (-estimate(name, plan[name]), -sum(starts_servers(s) for s in plan[name])))


def start_order(plan: Mapping[str, tuple[str, ...]], jobs: int) -> list[str]:
    """:func:`submission_order`, but the first ``jobs`` runs without servers go first (the longest of
    them): they keep the cores busy while the shared server fork server starts
    (:func:`share_server_fork_server`), which every run with servers waits for."""
    order = submission_order(plan)
    early = [name for name in order if not starts_servers_any(plan[name])][:jobs]
    return early + [name for name in order if name not in early]


def share_server_fork_server(plan: Mapping[str, tuple[str, ...]]) -> bool:
    """Start one server fork server here, named to the runs, when a run of ``plan`` starts real
    servers (:func:`harness.engines.server.stack.share_fork_server`)."""
    if not any(starts_servers_any(targeted) for targeted in plan.values()):
        return False
    from harness import topology
    from harness.engines.server import stack

    return stack.share_fork_server(topology.get("cpu"))


def check(
    names: Iterable[str] | None = None,
    *,
    suites: tuple[str, ...] | None = None,
    out_dir: Path,
    jobs: int = DEFAULT_JOBS,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    root: Path = REPO_ROOT,
    clean_junit: Path | None = None,
    clean_writer: int | None = None,
    tree: Path | None = None,
    stop_at_catch: bool = True,
) -> Matrix:
    """Run the clean run, then every fault against its suites, and build the kill matrix.

    Args:
        names: the faults to check (default: the whole catalog, in catalog order).
        suites: run every fault against these selections instead of its catalog ``suites``.
        out_dir: the run directory (``junit/``, ``workers/`` logs and ``fired/`` markers go there).
        jobs: fault runs at a time.
        timeout_s: limit of each pytest subprocess.
        root: the repository root.
        clean_junit: take the clean run from this JUnit report instead of running it (:func:`clean_from_junit`).
        clean_writer: the pid of the process still writing ``clean_junit`` (the test run beside this
            check): the fault runs start at once, and the report is read once that process has
            exited (waiting at most :data:`CLEAN_WRITER_TIMEOUT_S`).
        tree: the target's directory holding ``sglang`` (default: the selected target's).
        stop_at_catch: each fault's run stops at its first catch (one decides the verdict; in a fresh clone's
            CI the tests after it cost 566 s of the runs' 984, 310 of them one run waiting on a dead server).
            False runs every selected test (every cell of the table filled).

    Returns:
        The :class:`Matrix`; its ``runs`` is empty when the clean run did not pass.

    Raises:
        FaultError: an unknown fault name.
    """
    start = time.monotonic()
    tree = tree if tree is not None else selection.sglang_root().resolve()
    names = list(fault_catalog.catalog()) if names is None else [fault_catalog.get(n).name for n in names]
    not_applied: dict[str, str] = dict(target_lacks(names, root=root))
    for name in names:
        if name not in not_applied and fault_catalog.get(name).is_patch:
            errors = source.patch_errors(name, tree)
            if errors:
                not_applied[name] = "; ".join(errors)
                logger.warning("fault %s does not apply to the target: %s", name, not_applied[name])
    plan = {name: (suites if suites is not None else targets_for(name)) for name in names if name not in not_applied}
    union = tuple(dict.fromkeys(s for targeted in plan.values() for s in targeted))
    clean: SuiteRun | None = None
    # The writer is known by pid and start time: a pid reused by another process is not waited on.
    writer = (clean_writer, procs.start_time(clean_writer)) if clean_writer is not None else None
    if clean_junit is not None and clean_writer is None:
        clean = clean_from_junit(clean_junit, union, root)
    elif clean_junit is None:
        clean = run_clean(union, out_dir, jobs=jobs, timeout_s=timeout_s, root=root)
    if clean is not None and not clean.passed:
        logger.error("clean run failed (exit %d); faults not run", clean.returncode)
        return Matrix(clean=clean, wall_s=time.monotonic() - start)
    # The runs go to exactly ``jobs`` threads, which take them in start order (a thread pool hands out
    # its queue first in, first out). One thread more, with a semaphore holding the runs to ``jobs``,
    # started them out of order: a run waiting on the semaphore lost each freed slot to the thread
    # that had just freed it, so the longest run (handed out first) started last and ran alone for
    # over a minute (a fresh clone's check: 70 s of its 253).
    with ThreadPoolExecutor(max_workers=1) as side, ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        # One server fork server for every run's real servers, started here while the first runs
        # without servers go (each run would otherwise import the server graph in one of its own).
        shared = side.submit(share_server_fork_server, plan)

        def run(name: str) -> SuiteRun:
            if starts_servers_any(plan[name]):
                shared.result()
            return run_suites(
                name, plan[name], out_dir, fault=name, timeout_s=timeout_s, root=root, stop_at_catch=stop_at_catch
            )

        futures = {name: pool.submit(run, name) for name in start_order(plan, jobs)}
        if clean is None:  # the fault runs need nothing of the clean run: it is read while they run
            clean = _clean_when_written(clean_junit, writer, union, root)
        runs = {name: future.result() for name, future in futures.items()}
    if not clean.passed:
        logger.error("clean run failed (exit %d); faults ran but are not judged", clean.returncode)
        return Matrix(clean=clean, wall_s=time.monotonic() - start)
    cells: list[Cell] = []
    verdicts = []
    for name in names:
        if name in not_applied:
            reason = not_applied[name]
            verdicts.append(
                Verdict(
                    name,
                    NOT_APPLIED,
                    reason if reason.startswith("the sglang target lacks") else f"patch does not apply: {reason}",
                )
            )
            continue
        row = build_cells(name, plan[name], clean, runs[name])
        if runs[name].stop_at_catch and verdict(name, row, runs[name]).status != CAUGHT:
            # The run stopped at a catch the clean run does not count (a test that did not pass clean):
            # the tests after it decide, so the fault runs again, every test this time.
            logger.warning("fault %s: its run stopped at a catch the clean run does not count; running it whole", name)
            runs[name] = run_suites(name, plan[name], out_dir, fault=name, timeout_s=timeout_s, root=root)
            row = build_cells(name, plan[name], clean, runs[name])
        cells.extend(row)
        verdicts.append(verdict(name, row, runs[name]))
    return Matrix(clean=clean, runs=runs, cells=tuple(cells), verdicts=tuple(verdicts), wall_s=time.monotonic() - start)


# ------------------------------------------------------------------------------------- output
