"""Fault catalog: named, deliberate breakages of the code under test, used to prove suites catch bugs.

Two forms (:mod:`.sglang` and :mod:`.pd` list them, :mod:`.names` looks them up):

* **source patches** (every sglang fault): a small unified diff against sglang's source, what a bad
  PR would do (``harness/faults/patches/<name>.diff``), applied to a scratch copy of the target's
  sglang tree (:mod:`harness.faults.source`) put first on the import path of every process. Each
  patch adds a marker line, so a run proves the broken code ran (:data:`source.FIRED_ENV`).
* **runtime wrappers**, only where a patch cannot express the fault (the harness's own KV
  transfer): the ``module:Qual.name`` attribute is replaced in the running process by
  ``make(original)``.

Either way a fault is active only when asked for: by name in env ``HARNESS_FAULTS`` (comma-separated),
which the pytest option ``--inject-fault NAME`` (``harness/plugins/faults.py``) sets after building
the scratch copy and putting it on ``sys.path`` / ``PYTHONPATH``, so Ray workers and server
subprocesses run the same code. Every process that runs engine code applies them
(:func:`activate_from_env`, :mod:`.runtime`: runtime wrappers put in place, the imported sglang
checked to carry every named patch): the pytest plugin, a PD rank's payload, a server's
``sitecustomize``. Nothing applies a fault on import.

Each :class:`Fault` names the *evidence* its catch must show — the ledger rules or general
invariants (``[swa-tail-short]``, ``KVCorruption``, ...) of which one must appear in a failing test's
report — and the suite selections that carry it (``suites``), which the kill matrix
(:mod:`harness.faultcheck.matrix`) runs.

Failure modes: an unknown name raises :class:`FaultError` naming it and the known names; a runtime
target missing from the engine, or a patch fault whose patch is not in the imported sglang, raises
:class:`FaultError`; the suites never run silently unbroken.

This package is below every other layer of the harness: it imports nothing of it (a patch's tree is
given by the caller; a runtime fault names its target by import string).
"""

from harness.faults.model import ENV_VAR, Fault, FaultError
from harness.faults.names import catalog, get, parse_names
from harness.faults.runtime import activate, activate_from_env, active, deactivate

__all__ = ["ENV_VAR", "Fault", "FaultError", "activate", "activate_from_env", "active", "catalog", "deactivate",
           "get", "parse_names"]
