"""The registry: which suite files exist, which tests they hold, where they run and how long they take.

Read statically with :mod:`ast`, never by importing a suite (that would import sglang, take seconds and
run a PR's module-level code). Markers ``topology``, ``est_time`` and ``engine`` say where a test runs and
how long; :data:`PAIRS` pairs a simulated suite with its real-server counterpart; measured durations
replace the estimates. The marker rules: docs/modules.md.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

DEFAULT_TOPOLOGY = "cpu"
SIM_ENGINE, SERVER_ENGINE = "sim", "sglang-server"
ENGINES = (SIM_ENGINE, SERVER_ENGINE)

#: Simulated PD suite -> the real server-stack suites covering the same behaviour (display paths).
#: ``test_disaggregation_basic.py`` runs hybrid-SWA pools, so both the basic (full attention) and
#: the SWA stack suites are its real-engine side.
PAIRS: dict[str, tuple[str, ...]] = {
    "suites/disaggregation/test_disaggregation_basic.py": (
        "suites/disaggregation/test_disaggregation_basic_server.py",
        "suites/disaggregation/test_disaggregation_swa_server.py",
    ),
    "suites/disaggregation/test_disaggregation_dsv4.py": ("suites/disaggregation/test_disaggregation_dsv4_server.py",),
    "suites/disaggregation/test_disaggregation_soak.py": ("suites/disaggregation/test_disaggregation_soak_server.py",),
}
DEFAULT_TEST_EST = 10.0  # seconds for a test nobody estimated: small, so unknown tests are not starved
DURATIONS_FILE = "durations.json"  # under suites/ and under <run_dir>/report/


class RegistryError(ValueError):
    """A suite file's registration cannot be read. One line naming the file and the fix."""


@dataclass(frozen=True)
class TestEntry:
    """One test function (parametrized cases included) as the registry sees it.

    Attributes:
        names: the node id path inside the file, e.g. ``("TestC", "test_y")``.
        topologies: where it runs.
        est_time: seconds (measured when known, else estimated).
        measured: True when ``est_time`` came from an earlier run.
        engine: ``sim`` or ``sglang-server`` (its ``engine`` marker).
    """

    __test__ = False  # not a pytest class, despite the name

    names: tuple[str, ...]
    topologies: tuple[str, ...]
    est_time: float
    measured: bool = False
    engine: str = SIM_ENGINE

    @property
    def suffix(self) -> str:
        return "".join(f"::{n}" for n in self.names)


@dataclass(frozen=True)
class SuiteFile:
    """A registered suite file.

    Attributes:
        path: absolute path.
        rel: the display path and node-id prefix, e.g. ``suites/pd/test_x.py``.
        tests: its tests in file order.
        kind: ``"pytest"`` (markers) or ``"upstream"`` (``register_*_ci`` calls).
        classes: names of test classes (to resolve ``file::Class``).
        disabled: why upstream disabled it (left out of "run everything", still runnable by name).
        error: why its registration cannot be used (raised when the file is selected).
    """

    path: Path
    rel: str
    tests: tuple[TestEntry, ...]
    kind: str = "pytest"
    classes: tuple[str, ...] = ()
    disabled: str | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def topologies(self) -> tuple[str, ...]:
        seen: list[str] = []
        for t in self.tests:
            seen.extend(x for x in t.topologies if x not in seen)
        return tuple(seen)

    @property
    def est_time(self) -> float:
        return sum(t.est_time for t in self.tests)


# --------------------------------------------------------------------------------------------
# static marker reading
# --------------------------------------------------------------------------------------------


def _mark_call(node: ast.AST) -> tuple[str, list[ast.expr]] | None:
    """``pytest.mark.NAME(args)`` / ``mark.NAME(args)`` → (NAME, args); anything else → None."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return None
    owner = node.func.value
    is_mark = (isinstance(owner, ast.Attribute) and owner.attr == "mark") or (
        isinstance(owner, ast.Name) and owner.id == "mark"
    )
    return (node.func.attr, list(node.args)) if is_mark else None


def _marks(nodes: list[ast.expr], where: str) -> dict[str, object]:
    """Read topology/est_time from decorator or ``pytestmark`` expressions."""
    found: dict[str, object] = {}
    for node in nodes:
        items = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
        for item in items:
            mc = _mark_call(item)
            if mc is None:
                continue
            name, args = mc
            if name == "topology":
                values = [a.value for a in args if isinstance(a, ast.Constant)]
                if not values or len(values) != len(args) or not all(isinstance(v, str) for v in values):
                    raise RegistryError(
                        f'{where}: pytest.mark.topology needs literal topology names; write topology("cpu")'
                    )
                found["topology"] = tuple(values)
            elif name == "est_time":
                if (
                    len(args) != 1
                    or not isinstance(args[0], ast.Constant)
                    or isinstance(args[0].value, bool)
                    or not isinstance(args[0].value, (int, float))
                    or args[0].value < 0
                ):
                    raise RegistryError(
                        f"{where}: pytest.mark.est_time needs one literal number of seconds; write est_time(60)"
                    )
                found["est_time"] = float(args[0].value)
            elif name == "explicit":  # runs only when named: left out of the default run
                found["explicit"] = str(args[0].value) if args and isinstance(args[0], ast.Constant) else "explicit"
            elif name == "engine":
                if not args or not isinstance(args[0], ast.Constant) or args[0].value not in ENGINES:
                    raise RegistryError(
                        f"{where}: pytest.mark.engine needs a literal engine first, one of "
                        f'{", ".join(ENGINES)}; write engine("sglang-server")'
                    )
                found["engine"] = args[0].value
    return found


def _pytestmark(body: list[ast.stmt]) -> list[ast.expr]:
    out = []
    for stmt in body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets):
            out.append(stmt.value)
    return out


def _is_test_class(node: ast.ClassDef) -> bool:
    if node.name.startswith("Test"):
        return True
    # unittest style: class Foo(unittest.TestCase) / (CustomTestCase)
    for b in node.bases:
        name = b.attr if isinstance(b, ast.Attribute) else b.id if isinstance(b, ast.Name) else ""
        if name.endswith("TestCase"):
            return True
    return False


@dataclass(frozen=True)
class _Raw:
    names: tuple[str, ...]
    topology: tuple[str, ...] | None
    est: float | None
    engine: str | None = None


def read_tests(tree: ast.Module, where: str) -> tuple[list[_Raw], list[str], dict[str, object]]:
    """List test functions with their closest markers.

    Returns:
        (tests, class names, module-level marks).
    """
    module_marks = _marks(_pytestmark(tree.body), where)
    raws: list[_Raw] = []
    classes: list[str] = []
    # (scope marks, indices of tests in that scope without their own est_time) for est sharing
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            m = _marks(node.decorator_list, f"{where}::{node.name}")
            raws.append(_Raw((node.name,), m.get("topology"), m.get("est_time"), m.get("engine")))
        elif isinstance(node, ast.ClassDef) and _is_test_class(node):
            classes.append(node.name)
            cm = _marks(node.decorator_list + _pytestmark(node.body), f"{where}::{node.name}")
            members = [
                n
                for n in node.body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")
            ]
            own = [(_marks(f.decorator_list, f"{where}::{node.name}::{f.name}"), f.name) for f in members]
            share = None
            if "est_time" in cm:
                unmarked = sum(1 for m, _ in own if "est_time" not in m)
                share = cm["est_time"] / unmarked if unmarked else None
            for m, fname in own:
                topo = m.get("topology", cm.get("topology"))
                est = m.get("est_time", share)
                raws.append(_Raw((node.name, fname), topo, est, m.get("engine", cm.get("engine"))))
    return raws, classes, module_marks


def read_suite(path: Path, rel: str, require_marker: bool = False) -> SuiteFile | None:
    """Read one pytest suite file statically.

    Args:
        path: the file.
        rel: its display path / node-id prefix.
        require_marker: return None when the file has no ``topology`` marker at all (for external
            trees, where an unmarked file is not ours to run) instead of defaulting to ``cpu``.

    Returns:
        The :class:`SuiteFile` (est_time estimated, not yet measured), or None (see above).

    Raises:
        RegistryError: the file is not valid Python or a marker is not literal.
    """
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError) as e:
        raise RegistryError(f"{rel}: cannot be parsed ({e.__class__.__name__}: {e}); fix the file") from None
    raws, classes, mm = read_tests(tree, rel)
    if require_marker and "topology" not in mm and not any(r.topology for r in raws):
        return None
    module_topo = mm.get("topology") or (DEFAULT_TOPOLOGY,)
    unestimated = [r for r in raws if r.est is None]
    module_share = mm["est_time"] / len(unestimated) if "est_time" in mm and unestimated else None
    tests = tuple(
        TestEntry(
            names=r.names,
            topologies=r.topology or module_topo,
            est_time=r.est if r.est is not None else (module_share if module_share is not None else DEFAULT_TEST_EST),
            engine=str(r.engine or mm.get("engine") or SIM_ENGINE),
        )
        for r in raws
    )
    explicit = f"runs only when named ({mm['explicit']})" if "explicit" in mm else None
    return SuiteFile(path=path, rel=rel, tests=tests, kind="pytest", classes=tuple(classes), disabled=explicit)


def is_test_file(path: Path) -> bool:
    """pytest's default discovery pattern (``test_*.py`` or ``*_test.py``)."""
    return path.suffix == ".py" and (path.name.startswith("test_") or path.stem.endswith("_test"))


def discover(root: Path, prefix: str) -> list[tuple[Path, str]]:
    """All test files under ``root`` as (path, display path ``prefix/relative``), sorted.

    Hidden directories, ``__pycache__`` and anything starting with ``_`` are skipped.
    """
    out = []
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root).parts
        if any(part.startswith((".", "_")) for part in parts[:-1]) or not is_test_file(p):
            continue
        out.append((p, f"{prefix}/{'/'.join(parts)}" if prefix else "/".join(parts)))
    return out


def counterparts(rel: str) -> tuple[str, ...]:
    """The display paths of the files paired with ``rel`` in :data:`PAIRS` (either direction).

    Args:
        rel: a suite file's display path, e.g. ``suites/disaggregation/test_disaggregation_basic.py``.

    Returns:
        Its counterparts in :data:`PAIRS` order (empty when it pairs with nothing).
    """
    if rel in PAIRS:
        return PAIRS[rel]
    return tuple(sim for sim, real in PAIRS.items() if rel in real)


# --------------------------------------------------------------------------------------------
# measured durations
# --------------------------------------------------------------------------------------------


def load_durations(files: list[Path], tolerant: Sequence[Path] = ()) -> dict[str, float]:
    """Merge duration files (later files win); parametrized cases are summed into their function.

    Args:
        files: JSON files mapping node ids to seconds; missing files are skipped.
        tolerant: those of ``files`` a bad copy of which is skipped with a one-line warning on stderr
            naming it (a past run's, which a killed run may have left truncated), not refused.

    Returns:
        ``{"suites/x/test_a.py::TestC::test_y": seconds}`` without ``[param]`` parts.

    Raises:
        RegistryError: a file not in ``tolerant`` exists but is not such a mapping.
    """
    merged: dict[str, float] = {}
    for f in files:
        if not f.is_file():
            continue
        problem = ""
        data: Any = None
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            problem = f"not valid JSON ({e})"
        except OSError as e:  # removed since the glob (another run's retention), or unreadable
            if f in tolerant:
                continue
            raise RegistryError(f"{f.name}: cannot be read ({e.strerror}); delete it or fix it") from None
        if not problem and (
            not isinstance(data, dict)
            or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                for v in data.values()
            )
        ):
            problem = "must map test ids to seconds"
        if problem and f in tolerant:
            print(f"warning: {f}: {problem}; skipped (delete it to silence this)", file=sys.stderr)
            continue
        if problem:
            raise RegistryError(f"{f.name}: {problem}; delete it or fix it")
        per_file: dict[str, float] = {}
        for nodeid, secs in data.items():
            base = nodeid.split("[", 1)[0]
            per_file[base] = per_file.get(base, 0.0) + float(secs)
        merged.update(per_file)
    return merged


def recent_run_durations(runs_dir: Path, keep: int = 20) -> list[Path]:
    """Durations files of the ``keep`` newest runs under ``runs_dir``, oldest first (so newer win)."""
    if not runs_dir.is_dir():
        return []
    found = sorted(runs_dir.glob(f"*/report/{DURATIONS_FILE}"), key=_mtime)
    return found[-keep:]


def _mtime(path: Path) -> float:
    """A file's mtime, 0 when another run's retention removed it since the glob."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def apply_durations(suite: SuiteFile, durations: dict[str, float]) -> SuiteFile:
    """Replace estimates by measured durations where ``durations`` names a test of ``suite``."""
    tests = []
    for t in suite.tests:
        measured = durations.get(suite.rel + t.suffix)
        tests.append(replace(t, est_time=measured, measured=True) if measured is not None else t)
    return replace(suite, tests=tuple(tests))
