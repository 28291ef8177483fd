"""pytest plugin concern: the harness's options and ini keys, and the settings they resolve to.

Options ``--topology``, ``--simulate``/``--no-simulate``, ``--ray-address``, ``--run-dir`` and ``--sglang``,
each with an ini key; the command line wins. This module is registered first, so it creates the
``pd-harness`` option group the other concerns add to. Each option: docs/modules.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# The help text lives with the target resolver (harness/targets/sglang/selection.py), which imports no sglang.
SGLANG_HELP = (
    "the sglang under test: 'installed' (default), a release like 0.5.21 (installed on demand), "
    "a source tree (a checkout's python/ dir or any dir holding sglang/) or a wheel file; "
    "env HARNESS_SGLANG"
)


@dataclass(frozen=True)
class Settings:
    """The plugin's settings after precedence (command line, then ini)."""

    topology: str | None
    simulate: bool
    ray_address: str | None
    run_dir: Path | None


settings_key = pytest.StashKey[Settings]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pd-harness", "PD-disaggregation harness")
    group.addoption(
        "--topology",
        default=None,
        metavar="NAME",
        help="run tests on this topology only (a name from `harness topology list` or a .toml path)",
    )
    group.addoption(
        "--simulate",
        action="store_true",
        default=None,
        help="allow Ray logical GPUs (simulated topologies) when this machine has no GPUs",
    )
    group.addoption(
        "--no-simulate",
        dest="simulate",
        action="store_false",
        help="never simulate GPUs: topologies that need missing GPUs are skipped",
    )
    group.addoption(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="join the Ray cluster at ADDR (host:port) instead of starting a local one",
    )
    group.addoption(
        "--run-dir",
        default=None,
        metavar="DIR",
        help="run directory for worker logs, ledgers and reports (default runs/<timestamp>-<pid>)",
    )
    group.addoption("--sglang", default=None, metavar="TARGET", help=SGLANG_HELP)
    parser.addini("harness_topology", "default for --topology", default="")
    parser.addini("harness_simulate", "default for --simulate", type="bool", default=False)
    parser.addini("harness_ray_address", "default for --ray-address", default="")
    parser.addini("harness_run_dir", "default for --run-dir", default="")
    parser.addini("harness_sglang", "default for --sglang (after env HARNESS_SGLANG)", default="")


def get_settings(config: pytest.Config) -> Settings:
    """Apply the precedence: command-line option, then ini key.

    Args:
        config: the session's config (options parsed).

    Returns:
        The resolved settings (not stored; :func:`settings` returns the stored ones).
    """

    def pick(opt: str, ini: str) -> Any:
        value = config.getoption(opt)
        return value if value not in (None, "") else (config.getini(ini) or None)

    simulate = config.getoption("simulate")
    run_dir = pick("run_dir", "harness_run_dir")
    return Settings(
        topology=pick("topology", "harness_topology"),
        simulate=bool(config.getini("harness_simulate")) if simulate is None else simulate,
        ray_address=pick("ray_address", "harness_ray_address"),
        run_dir=Path(run_dir) if run_dir else None,
    )


def settings(config: pytest.Config) -> Settings:
    """The session's settings.

    Args:
        config: the session's config.

    Returns:
        The settings stored at configure time.

    Raises:
        KeyError: before this plugin's ``pytest_configure`` (the plugin is not registered).
    """
    return config.stash[settings_key]


# tryfirst: the other concerns' pytest_configure (the session state) read the settings.
@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.stash[settings_key] = get_settings(config)
