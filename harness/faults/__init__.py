"""Fault catalog: named, deliberate breakages of the code under test, used to prove suites catch bugs.

Three forms: source patches of sglang applied to a scratch copy, runtime wrappers where a patch cannot
express the fault, and sglang's own test-hook variables (fault sources the check does not run). A fault is
active only when named in ``HARNESS_FAULTS``, and then in every process that runs engine code; each names
the evidence its catch must show. This package imports nothing of the harness. Forms, activation and
failure modes: docs/modules.md.
"""

from harness.faults.fault import ENV_VAR, STOP_AT_CATCH_LINE, Fault, FaultError
from harness.faults.names import catalog, get, parse_names
from harness.faults.runtime import activate, activate_from_env, active, deactivate

__all__ = [
    "ENV_VAR",
    "STOP_AT_CATCH_LINE",
    "Fault",
    "FaultError",
    "activate",
    "activate_from_env",
    "active",
    "catalog",
    "deactivate",
    "get",
    "parse_names",
]
