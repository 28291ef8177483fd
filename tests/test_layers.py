"""The import contracts of pyproject.toml (``lint-imports``) hold, and they can fail: an upward import
planted inside a function of a low layer, or a cycle between two modules of one package, breaks them.

Each test copies ``harness/`` and ``pyproject.toml`` to a scratch directory and runs the repository's
own contracts there, so what fails is the planted import and nothing else. A third contract lets only
``harness.targets`` and ``harness.engines`` import sglang.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.rundir import REPO_ROOT

pytestmark = pytest.mark.est_time(2)

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _copy(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    shutil.copytree(REPO_ROOT / "harness", tree / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=120
    )


def _plant(path: Path, code: str) -> None:
    path.write_text(path.read_text() + "\n\n" + code)


def test_the_contracts_hold_on_the_tree(tmp_path: Path):
    done = _lint(_copy(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in done.stdout


def test_an_upward_import_inside_a_function_breaks_the_layers(tmp_path: Path):
    tree = _copy(tmp_path)
    # The ledger is the bottom layer; a lazy import of the rerun-test front end from it runs upward.
    _plant(
        tree / "harness" / "ledger" / "events.py",
        "def _planted():\n    from harness.commands import rerun  # noqa: F401\n",
    )
    done = _lint(tree)
    assert done.returncode != 0
    assert "BROKEN" in done.stdout
    assert "harness.ledger is not allowed to import harness.commands" in done.stdout
    assert "harness.ledger.events -> harness.commands.rerun" in done.stdout


def test_a_cycle_inside_a_package_breaks_the_acyclic_contract(tmp_path: Path):
    tree = _copy(tmp_path)
    # cluster.join imports cluster.nodes; nodes importing join back closes a cycle of siblings.
    _plant(
        tree / "harness" / "cluster" / "nodes.py",
        "def _planted():\n    from harness.cluster import join  # noqa: F401\n",
    )
    done = _lint(tree)
    assert done.returncode != 0
    assert "No cycles are allowed in harness.cluster" in done.stdout


def test_an_sglang_import_outside_targets_and_engines_breaks_the_forbidden_contract(tmp_path: Path):
    tree = _copy(tmp_path)
    # The report reads files only; a lazy import of sglang's scheduler there is the adapter's job leaking out.
    _plant(
        tree / "harness" / "report" / "junit.py",
        "def _planted():\n    from sglang.srt.managers import scheduler  # noqa: F401\n",
    )
    done = _lint(tree)
    assert done.returncode != 0
    assert "Only harness.targets and harness.engines import sglang BROKEN" in done.stdout
    assert "harness.report.junit -> sglang" in done.stdout


def test_a_new_top_level_module_must_be_given_a_layer(tmp_path: Path):
    tree = _copy(tmp_path)
    (tree / "harness" / "helpers.py").write_text('"""A module no layer names."""\n')
    done = _lint(tree)
    assert done.returncode != 0
    assert "harness.helpers" in done.stdout
