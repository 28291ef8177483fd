"""``harness faults check``, the kill matrix: which suites catch which catalog fault, measured by running them.

:func:`check` first runs every selected suite once with no fault (the clean run, which must pass),
or takes the clean results from a JUnit report of a run that already ran them (``--clean-junit``:
CI's test run, so the check does not run the same tests twice, :func:`clean_from_junit`), then once
per fault, each in a fresh ``python -m pytest --inject-fault NAME`` subprocess (the plugin builds the
patched sglang copy and puts it first on the import path of every process the run starts, or
applies a runtime fault), at most ``jobs`` at a time. Results are read from each run's JUnit XML,
never from its output; a fault's marker lines (env ``HARNESS_FAULT_FIRED``) say whether its broken
code ran.

Per fault and suite file (a *cell*):

* ``caught``: a test that passed in the clean run *failed in its body* with one of the fault's
  expected evidence strings (:attr:`harness.faults.Fault.evidence`) in its report;
* ``broken``: no test caught it, but a test failed with other evidence (a different exception,
  sglang's own assert), errored outside its body (setup / teardown), or the run did not finish;
* ``missed``: every selected test passed;
* ``n/a``: the suite was not run for this fault, or every selected test skipped.

A fault is ``caught`` when its code ran (a marker fired) and a cell caught it; ``broken`` when its
code never ran, or no cell caught it and one is broken; ``missed`` otherwise; ``not-applied`` when its
patch does not apply to the target (said, run nowhere, and not counted). Each fault runs its
catalog selections (``Fault.suites``, the smallest that carry the evidence) unless the caller names
suites (``--suite``, or ``--all`` for every suite that asserts accounting: :data:`ACCOUNTING_SUITES`).
Paths are relative to the repository root.

Modules: :mod:`.matrix` (the runs), :mod:`.verdicts` (what the runs show, pure), :mod:`.render`
(JSON, the text table, the run page). The names are re-exported here.
"""

from harness.faultcheck.matrix import (
    ACCOUNTING_SUITES,
    DEFAULT_JOBS,
    DEFAULT_TIMEOUT_S,
    NEEDS,
    REPO_ROOT,
    check,
    clean_from_junit,
    parse_junit,
    run_clean,
    run_suites,
    target_lacks,
    share_server_fork_server,
    start_order,
    starts_servers_any,
    submission_order,
    targets_for,
)
from harness.faultcheck.render import page_groups, page_table, render, table, to_dict, write_page
from harness.faultcheck.verdicts import (
    BROKEN,
    CAUGHT,
    CLEAN,
    MISSED,
    NOT_APPLICABLE,
    NOT_APPLIED,
    Cell,
    Matrix,
    SuiteRun,
    TestOutcome,
    Verdict,
    build_cells,
    has_evidence,
    suite_file,
    verdict,
)

__all__ = [
    "ACCOUNTING_SUITES",
    "DEFAULT_JOBS",
    "DEFAULT_TIMEOUT_S",
    "NEEDS",
    "REPO_ROOT",
    "check",
    "clean_from_junit",
    "parse_junit",
    "run_clean",
    "run_suites",
    "target_lacks",
    "share_server_fork_server",
    "start_order",
    "starts_servers_any",
    "submission_order",
    "targets_for",
    "page_groups",
    "page_table",
    "render",
    "table",
    "to_dict",
    "write_page",
    "BROKEN",
    "CAUGHT",
    "CLEAN",
    "MISSED",
    "NOT_APPLICABLE",
    "NOT_APPLIED",
    "Cell",
    "Matrix",
    "SuiteRun",
    "TestOutcome",
    "Verdict",
    "build_cells",
    "has_evidence",
    "suite_file",
    "verdict",
]
