"""``harness.api``, the one surface suites import from: it is cheap and changes nothing on import, every
name it lists resolves, and ``suites/`` imports nothing else of ``harness`` (suites are not a package,
so the import contract cannot see them: this test reads their source instead).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

from harness.rundir import REPO_ROOT

pytestmark = pytest.mark.est_time(8)

SUITES = REPO_ROOT / "suites"
#: A string that is an import path of a harness module (``InProcess("harness.x:Y")``) is an import too
#: (prose that names one, in a docstring, is not).
_NAMED = re.compile(r"^(harness(?:\.[A-Za-z_]\w*)+)(?::[A-Za-z_][\w.]*)?$")


def harness_imports(source: str, where: str = "<source>") -> list[str]:
    """Every import of a ``harness`` module other than ``harness.api`` in ``source``, at any depth
    (inside functions too), and every string naming one: ``"file:line: what"`` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "harness" else [f"harness.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [m.group(1)] if (m := _NAMED.match(node.value.strip())) else []
        for name in names:
            if (name == "harness" or name.startswith("harness.")) and name != "harness.api":
                found.append(f"{where}:{node.lineno}: {name}")
    return found


def test_suites_import_only_harness_api():
    found = [
        line
        for path in sorted(SUITES.rglob("*.py"))
        for line in harness_imports(path.read_text(encoding="utf-8"), str(path.relative_to(REPO_ROOT)))
    ]
    assert not found, "suites must import the harness only through harness.api:\n" + "\n".join(found)


def test_the_scan_sees_imports_inside_functions_and_in_strings():
    code = (
        "from harness import api\nfrom harness.api import run\n"
        "def test_x():\n    from harness.engines.sim.driver import run\n    import harness.workers\n"
        "    return InProcess('harness.workers.suiterun:SuiteRunner'), 'see harness.ledger.check'\n"
    )
    assert harness_imports(code) == [
        "<source>:4: harness.engines.sim.driver",
        "<source>:5: harness.workers",
        "<source>:6: harness.workers.suiterun",
    ]


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


def test_importing_the_api_imports_no_engine_and_applies_no_fault():
    code = (
        "import sys, harness.api; "
        "print(sorted(m for m in ('sglang', 'ray', 'torch', 'harness.faults.runtime', 'harness.targets.sglang') "
        "if m in sys.modules))"
    )
    done = _python(code, HARNESS_FAULTS="corrupt-kv-page")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_what_a_simulated_suite_imports_at_collection_loads_no_torch():
    # Collecting a PD suite takes its names from the api; torch (2 s to import on this machine) is
    # loaded by the workers that run it, not by every pytest process that only collects it.
    names = "KVSpec, PDRequest, PDError, KVCorruption, WindowLost, expect, ledger, run, topology"
    done = _python(
        f"import sys\nfrom harness.api import {names}\n"
        "print(sorted(m for m in ('torch', 'numpy', 'ray', 'sglang') if m in sys.modules))"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_every_name_of_the_api_resolves():
    done = _python("import harness.api as api\nfor n in api.__all__:\n    getattr(api, n)\nprint(len(api.__all__))")
    assert done.returncode == 0, done.stderr[-2000:]
    from harness import api

    assert int(done.stdout.strip()) == len(api.NAMES)


def test_an_unknown_name_says_where_names_come_from():
    from harness import api

    with pytest.raises(AttributeError, match="harness.api.NAMES"):
        api.no_such_name  # noqa: B018
