"""pytest plugin concern: seeds a failing test can be rerun with, and a record of what a failure touched.

``--workload-seed N`` and the fixtures ``workload_seed`` (derived per test, so a test rerun alone gets the
seed it had in a gate run) and ``workload_rng``; every failing test gets a line in
``<run_dir>/failed-tests.jsonl`` for the gate's repro bundle. Detail: docs/modules.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from pathlib import Path
from typing import Iterator

import pytest

from harness.plugins.failfast import owned_workers
from harness.plugins.state import state_key

ENV = "HARNESS_WORKLOAD_SEED"
RECORD_FILE = "failed-tests.jsonl"

base_seed_key = pytest.StashKey[int]()
_failed_key = pytest.StashKey[bool]()
_start_key = pytest.StashKey[float]()


def derive(base: int, path_name: str, suffix: str) -> int:
    """The per-test seed (pure, stable across machines and rootdirs).

    Args:
        base: the session's base seed.
        path_name: the test file's name (``test_x.py``).
        suffix: the node id after the file (``::TestC::test_y[p]``).
    """
    digest = hashlib.sha256(f"{base}:{path_name}{suffix}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pd-harness")
    group.addoption(
        "--workload-seed",
        type=int,
        default=None,
        metavar="N",
        help=f"base seed of workload generators (default: ${ENV}, ini harness_workload_seed, else random)",
    )
    parser.addini("harness_workload_seed", "default for --workload-seed", default="")


def _base(config: pytest.Config) -> int:
    value = config.getoption("workload_seed")
    if value is not None:
        return int(value)
    for text, where in (
        (os.environ.get(ENV, ""), f"${ENV}"),
        (config.getini("harness_workload_seed"), "ini harness_workload_seed"),
    ):
        if text:
            try:
                return int(text)
            except ValueError:
                raise pytest.UsageError(
                    f"workload seed {text!r} from {where} is not an integer; set a number"
                ) from None
    return random.SystemRandom().randrange(2**31)


def pytest_configure(config: pytest.Config) -> None:
    config.stash[base_seed_key] = _base(config)


def pytest_report_header(config: pytest.Config) -> str:
    hyp = config.getoption("hypothesis_seed", None)
    return f"seeds: workload base={config.stash[base_seed_key]} hypothesis={hyp if hyp is not None else 'random'}"


def _split(item: pytest.Item) -> tuple[str, str]:
    _, sep, rest = item.nodeid.partition("::")
    return Path(item.path).name, (sep + rest) if sep else ""


@pytest.fixture
def workload_seed(request: pytest.FixtureRequest) -> int:
    """This test's workload seed (see the module docstring)."""
    name, suffix = _split(request.node)
    return derive(request.config.stash[base_seed_key], name, suffix)


@pytest.fixture
def workload_rng(workload_seed: int) -> random.Random:
    """A private RNG seeded with :func:`workload_seed`."""
    return random.Random(workload_seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    report = yield
    if report.when == "setup":
        item.stash[_start_key] = call.start
    uses_seed = "workload_seed" in getattr(item, "fixturenames", ())
    if uses_seed and report.when == "setup":
        item.user_properties.append(("workload_seed", _seed_of(item)))
    if report.failed:
        item.stash[_failed_key] = True
        if uses_seed:
            base = item.config.stash[base_seed_key]
            report.sections.append(
                (
                    "workload seed",
                    f"workload_seed={_seed_of(item)} (base {base}); replay it with "
                    f"--workload-seed {base}, or rerun-test --from the gate's repro.json",
                )
            )
    if report.when == "teardown" and item.stash.get(_failed_key, False):
        _record(item)
    return report


def _seed_of(item: pytest.Item) -> int:
    name, suffix = _split(item)
    return derive(item.config.stash[base_seed_key], name, suffix)


def _record(item: pytest.Item) -> None:
    state = item.config.stash.get(state_key, None)
    if state is None:
        return
    name, suffix = _split(item)
    base = item.config.stash[base_seed_key]
    rec = {
        "path": str(Path(item.path).resolve()),
        "suffix": suffix,
        "workload_seed_base": base,
        "workload_seed": derive(base, name, suffix),
        "hypothesis_seed": item.config.getoption("hypothesis_seed", None),
        "workers": [w.name for w in owned_workers(item)],
        "start": item.stash.get(_start_key, None),
        "stop": time.time(),
    }
    out = Path(state.run_dir_path)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / RECORD_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
