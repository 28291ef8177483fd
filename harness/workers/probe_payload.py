"""A ready-made in-process payload that reports where it runs: the smoke suites, the overhead benchmark
and the harness's own tests start it (``InProcess(Probe)`` or ``InProcess("harness.workers:Probe")``)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from harness.workers.actor import current
from harness.workers.spec import WorkerContext


class Probe:
    """A payload that reports where it runs (smoke suites, the overhead benchmark, tests)."""

    def context(self) -> WorkerContext:
        return current()

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def pid(self) -> int:
        return os.getpid()

    def echo(self, value: Any) -> Any:
        return value

    def module_file(self, name: str) -> str | None:
        """Where this process would import top-level module ``name`` from (None: nowhere); e.g.
        which sglang a worker runs, without importing it."""
        spec = importlib.util.find_spec(name)
        return spec.origin if spec is not None else None

    def say(self, text: str) -> None:
        """Print ``text`` (it lands in the worker's log)."""
        print(text, flush=True)

    def fail(self, message: str) -> None:
        raise ValueError(message)
