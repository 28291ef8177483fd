"""pytest plugin concern: which engine the suites run against, and which models real servers get.

Options ``--engine {all,sim,sglang-server}`` and ``--model NAME=PATH``; marker ``engine(name, *, models,
gpu_topologies, server_args)`` (unmarked tests count as ``sim``). The real-server fixtures are
:mod:`harness.plugins.servers`. Each option and the marker's arguments: docs/modules.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import pytest

ENGINES = ("sim", "sglang-server")
CHOICES = ("all", *ENGINES)
DEFAULT_ENGINE = "all"
SERVER_ENGINE = "sglang-server"

engine_key = pytest.StashKey[str]()
models_key = pytest.StashKey[dict]()

MODEL_OPTION = "--model"
MODEL_ENV_PREFIX = "HARNESS_MODEL_"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pd-harness")
    group.addoption(
        "--engine",
        default=None,
        choices=CHOICES,
        help="engine the suites run against: sim, sglang-server (real servers) or all (default)",
    )
    group.addoption(
        MODEL_OPTION,
        action="append",
        default=None,
        dest="harness_models",
        metavar="NAME=PATH",
        help="local model directory for a real-server suite's model NAME (tiny-llama, tiny-mellum-swa, "
        "dsv4); repeatable; env HARNESS_MODEL_<NAME> too; required on GPU topologies (no hub)",
    )
    parser.addini("harness_engine", "default for --engine (all, sim, sglang-server)", default=DEFAULT_ENGINE)


def _validate(value: str, where: str) -> str:
    if value not in CHOICES:
        raise pytest.UsageError(f"engine {value!r} from {where} is not one of {', '.join(CHOICES)}")
    return value


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "engine(name, *, models=(), gpu_topologies=(), server_args=()): the engine a "
        "test needs (sim or sglang-server); for sglang-server the logical models it "
        "serves, GPU topologies it also runs on when --topology asks, flags of its servers",
    )
    opt = config.getoption("--engine", None)
    config.stash[engine_key] = (
        _validate(opt, "--engine") if opt else _validate(config.getini("harness_engine"), "ini harness_engine")
    )
    config.stash[models_key] = _given_models(config.getoption("harness_models", None), os.environ)


def _given_models(values: Sequence[str] | None, environ: Mapping[str, str]) -> dict[str, Path]:
    """``--model`` values and ``HARNESS_MODEL_*`` vars, validated (one clear UsageError line)."""
    if not values and not any(k.startswith(MODEL_ENV_PREFIX) for k in environ):
        return {}  # nothing given: do not import the sglang adapter into every pytest run
    from harness.engines.server import modelmap

    try:
        return modelmap.overrides(values, environ)
    except modelmap.ModelError as e:
        raise pytest.UsageError(str(e)) from None


def _test_engine(item: pytest.Item) -> str:
    m = item.get_closest_marker("engine")
    if m is None:
        return "sim"
    if len(m.args) != 1 or m.args[0] not in ENGINES:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.engine needs one of {', '.join(ENGINES)}")
    return str(m.args[0])


def server_kwargs(node: Any) -> dict[str, tuple[str, ...]]:
    """The ``sglang-server`` engine marker's kwargs closest to ``node`` (each as a tuple of strings)."""
    m = node.get_closest_marker("engine")
    if m is None or not m.args or m.args[0] != SERVER_ENGINE:
        return {}
    out = {}
    for key in ("models", "gpu_topologies", "server_args"):
        value = m.kwargs.get(key, ())
        out[key] = (value,) if isinstance(value, str) else tuple(str(v) for v in value)
    return out


def _also_on_topology(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A real-server test whose marker lists ``--topology`` in ``gpu_topologies`` runs on it."""
    from harness.plugins.options import settings

    chosen = settings(config).topology
    if not chosen:
        return
    for item in items:
        extra = server_kwargs(item).get("gpu_topologies", ())
        name = next((n for n in extra if n in (chosen, Path(chosen).stem)), None)
        if name is not None:
            item.add_marker(pytest.mark.topology(name))  # the item's own marker is the closest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _also_on_topology(config, items)
    chosen = config.stash[engine_key]
    if chosen == "all":
        for item in items:
            _test_engine(item)  # still validate the markers
        return
    keep, drop = [], []
    for item in items:
        (keep if _test_engine(item) == chosen else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config: pytest.Config) -> list[str]:
    models = config.stash[models_key]
    given = (
        ", ".join(f"{k}={v}" for k, v in sorted(models.items())) if models else "none given (cpu: tiny, built locally)"
    )
    return [f"harness engine: {config.stash[engine_key]}", f"harness models: {given}"]
