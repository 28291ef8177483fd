"""Source-patch faults (``harness.faults.source``): parsing and applying diffs, the scratch copy of
sglang, markers, and one catalog patch run for real through ``--inject-fault``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import faults
from harness.faults import source
from harness import faultcheck
from harness.targets.sglang import selection

pytestmark = pytest.mark.est_time(12)

PKG_FILE = """def tail(seq, window, page):
    start = max(0, seq - window)
    start = start // page * page
    return seq - start
"""

PATCH = """--- a/sglang/mod.py
+++ b/sglang/mod.py
@@ -1,4 +1,5 @@
 def tail(seq, window, page):
     start = max(0, seq - window)
-    start = start // page * page
+    if __import__("os").environ.get("HARNESS_FAULT_FIRED"):
+        open(__import__("os").environ["HARNESS_FAULT_FIRED"], "a").write("fake\\n")
     return seq - start
"""


def _tree(tmp_path: Path) -> Path:
    tree = tmp_path / "site"
    (tree / "sglang" / "sub").mkdir(parents=True)
    (tree / "sglang" / "__init__.py").write_text("")
    (tree / "sglang" / "mod.py").write_text(PKG_FILE)
    (tree / "sglang" / "sub" / "__init__.py").write_text("X = 1\n")
    return tree


def test_parse_and_apply_exact_context():
    [fp] = source.parse(PATCH)
    assert fp.path == "sglang/mod.py" and len(fp.hunks) == 1
    out = source.apply_text(PKG_FILE, fp)
    assert "start // page" not in out and "HARNESS_FAULT_FIRED" in out
    # a release that moved the function down still matches its (unique) context
    assert source.apply_text("import os\n\n" + PKG_FILE, fp).startswith("import os\n\ndef tail")


def test_a_patch_that_does_not_apply_names_the_file_and_hunk():
    [fp] = source.parse(PATCH)
    with pytest.raises(source.PatchError, match=r"sglang/mod.py: hunk 1 .* not found"):
        source.apply_text(PKG_FILE.replace("// page * page", "// page * page  # floored"), fp)
    with pytest.raises(source.PatchError, match="truncated|shorter"):
        source.parse(PATCH.rsplit("\n", 2)[0])


def test_scratch_copy_links_the_tree_patches_a_copy_and_leaves_the_original(tmp_path: Path, monkeypatch):
    tree = _tree(tmp_path)
    monkeypatch.setattr(source, "PATCH_DIR", tmp_path)
    (tmp_path / "fake.diff").write_text(PATCH)
    dest = source.scratch_copy(["fake"], tmp_path / "scratch", tree)

    assert (dest / "sglang" / "sub").is_symlink() and not (dest / "sglang" / "mod.py").is_symlink()
    assert (tree / "sglang" / "mod.py").read_text() == PKG_FILE
    assert source.applied_in(dest / "sglang") == ["fake"] and source.applied_in(tree / "sglang") == []
    fired = tmp_path / "fired.txt"
    code = "import sglang.mod as m, sglang.sub as s; print(m.tail(300, 100, 64), s.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(dest), source.FIRED_ENV: str(fired)},
    )
    assert out.returncode == 0, out.stderr
    tail, path = out.stdout.split()
    assert tail == "100" and path.startswith(str(dest))  # unfloored: 300 - 200; the subpackage from the copy too
    assert source.fired(fired) == {"fake"}
    assert source.patch_errors("fake", tree) == []
    (tree / "sglang" / "mod.py").write_text(PKG_FILE.replace("page * page", "page*page"))
    assert "hunk 1" in source.patch_errors("fake", tree)[0]


def test_every_catalog_patch_applies_to_the_target_and_marks_itself():
    tree = selection.sglang_root().resolve()
    for name, fault in faults.catalog().items():
        if not fault.is_patch:
            continue
        assert source.patch_errors(name, tree) == [], name
        added = "".join(text for fp in source.load(name) for h in fp.hunks for tag, text in h.lines if tag == "+")
        assert source.FIRED_ENV in added and f'write("{name}\\n")' in added, f"{name}: no marker line"


def test_a_patch_fault_named_without_its_copy_refuses_to_run():
    with pytest.raises(faults.FaultError, match="does not carry them; inject them with --inject-fault"):
        faults.activate(["swa-tail-unaligned"])


@pytest.mark.timeout(900)
def test_inject_fault_runs_a_suite_on_the_patched_copy_and_the_ledger_names_the_rule(tmp_path: Path):
    """For real: the ledger suite with the unfloored window start fails naming ``[evicted-unaligned]``,
    the marker fired, and the installed sglang is untouched (a clean import still floors)."""
    junit = tmp_path / "j.xml"
    fired = tmp_path / "fired.txt"
    env = {**os.environ, source.FIRED_ENV: str(fired)}
    env.pop(faults.ENV_VAR, None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "suites/unit/disaggregation/test_decode_prealloc_ledger.py",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "page64",
            "--inject-fault",
            "swa-tail-unaligned",
            f"--junitxml={junit}",
            "-o",
            "junit_family=xunit1",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        cwd=faultcheck.REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    [case] = faultcheck.parse_junit(junit)
    assert case.outcome == "failed" and faultcheck.has_evidence(case, faults.get("swa-tail-unaligned").evidence)
    assert "[evicted-unaligned]" in case.text
    assert source.fired(fired) == {"swa-tail-unaligned"}
    assert "faults injected for this session: swa-tail-unaligned" in out.stderr
    installed = textwrap.dedent("""
        from pathlib import Path
        from harness.targets.sglang import selection
        text = (selection.sglang_root().resolve() / "sglang/srt/disaggregation/decode.py").read_text()
        print("window_start = (window_start // page_size) * page_size" in text)
    """)
    check = subprocess.run(
        [sys.executable, "-c", installed], cwd=faultcheck.REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert check.stdout.strip() == "True", check.stderr
