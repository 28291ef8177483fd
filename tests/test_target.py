"""The sglang target: resolution (installed, tree, release floor), activation, the adapter's static
checks, bad targets refused by every entry point (one line, exit 2, nothing run), the matrix tables.

Nothing here imports sglang in this process; trees are small fakes holding only the files the
static checks read (a "0.4" tree lacks the decode SWA tail), except where the installed one is meant.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.rerun import version_matrix as versions
from harness.targets.sglang import compat
from harness.targets.sglang import resolve as resolve_mod
from harness.targets.sglang import selection as target
from harness.targets.sglang.version import UNKNOWN, read_version

pytestmark = pytest.mark.est_time(20)

REPO = Path(__file__).resolve().parent.parent
pytest_plugins = ["pytester"]
BIN = Path(sys.executable).parent

_CORE_SOURCES = {
    "disaggregation/decode.py": (
        "class DecodePreallocQueue:\n    def _swa_tail_len(self, seq_len):\n        pass\n\n"
        "def alloc_for_decode_prealloc(allocator):\n    pass\n"
    ),
    "mem_cache/allocator/swa.py": "class SWATokenToKVPoolAllocator:\n    pass\n",
    "runtime_context.py": (
        "class RuntimeContext:\n    def override_server_args(self, **fields):\n        pass\n\n"
        "def get_context():\n    pass\n"
    ),
}


def fake_tree(root: Path, version: str | None = "0.5.21", *, core: bool = True) -> Path:
    """A directory holding a ``sglang/`` package with the files the static checks read."""
    pkg = root / "sglang"
    (pkg / "srt").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    if version:
        (pkg / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    for rel, text in _CORE_SOURCES.items():
        if not core and rel == "disaggregation/decode.py":
            text = "class DecodePreallocQueue:\n    pass\n"  # a 0.4-era queue: no SWA tail
        path = pkg / "srt" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _touch(path: Path) -> Path:
    path.write_text("")
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (target.ENV_VAR, "HARNESS_FAULTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env.update(extra)
    return env


# ---------------------------------------------------------------------------------------- versions


def test_version_read_from_the_trees_files(tmp_path):
    assert read_version(fake_tree(tmp_path / "scm", "0.5.20")) == "0.5.20"
    info = fake_tree(tmp_path / "dist", None) / "sglang-0.5.19.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.19\n")
    assert read_version(tmp_path / "dist") == "0.5.19"
    assert read_version(fake_tree(tmp_path / "bare", None)) == UNKNOWN


# ---------------------------------------------------------------------------------------- resolve


def test_installed_is_the_importable_sglang_and_puts_nothing_on_the_path():
    found = target.resolve("installed")
    assert found.origin == "installed" and found.paths == ()
    assert (Path(found.root) / "sglang" / "__init__.py").is_file()
    assert found.version == importlib.metadata.version("sglang")
    assert found.label() == f"sglang {found.version} (installed)"


def test_tree_resolves_a_checkout_root_to_its_python_dir_and_records_git_state(tmp_path):
    checkout = tmp_path / "sglang-checkout"
    fake_tree(checkout / "python", "0.5.22")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "tree"], check=True)
    clean = target.resolve(str(checkout))
    assert (clean.origin, clean.version, clean.root) == ("tree", "0.5.22", str((checkout / "python").resolve()))
    assert clean.commit and len(clean.commit) == 40 and clean.dirty is False
    with (checkout / "python" / "sglang" / "srt" / "runtime_context.py").open("a") as edit:
        edit.write("# edited\n")
    dirty = target.resolve(str(checkout / "python"))
    assert dirty.commit == clean.commit and dirty.dirty is True
    assert dirty.label().endswith(f"@ {clean.commit[:12]}, dirty)")
    assert target.Target.from_dict(json.loads(json.dumps(dirty.to_dict()))) == dirty
    assert dirty.properties()["sglang_dirty"] == "true"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: str(tmp / "missing"), "no such file or directory"),
        (lambda tmp: str((tmp / "empty").mkdir() or tmp / "empty"), "holds no sglang/ package"),
        (lambda tmp: str(fake_tree(tmp / "old", "0.4.10", core=False)), "lacks the core the harness drives"),
        (lambda tmp: "0.4.10", "older than the supported range"),
        (lambda tmp: str(_touch(tmp / "x.txt")), "is a file but not a wheel"),
    ],
    ids=["missing-path", "no-sglang-dir", "tree-without-core", "release-0.4", "not-a-wheel"],
)
def test_bad_targets_are_refused_in_one_line(tmp_path, make, message):
    with pytest.raises(target.TargetError) as raised:
        target.resolve(make(tmp_path))
    assert message in str(raised.value) and "\n" not in str(raised.value)


def _fake_index(root: Path, versions: list[str]) -> str:
    """A package index (PEP 503 simple layout, as a directory) listing sglang ``versions``."""
    page = root / "simple" / "sglang" / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text(
        "".join(f'<a href="sglang-{v}-py3-none-any.whl">sglang-{v}-py3-none-any.whl</a>\n' for v in versions)
    )
    return (root / "simple").as_uri()


def test_a_release_the_index_does_not_have_is_refused_before_installing(tmp_path, monkeypatch):
    monkeypatch.setenv(target.CACHE_ENV, str(tmp_path / "cache"))
    said: list[str] = []
    with pytest.raises(target.TargetError, match=r"sglang 0\.5\.999 is not on the package index") as raised:
        target.resolve("0.5.999", progress=said.append)
    assert said == [] and "\n" not in str(raised.value), "refused before anything is said or written"
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir()), "no lock file, no directory"


def test_a_release_newer_than_checked_is_tried_with_a_warning(tmp_path, monkeypatch):
    # An index that has 0.5.24 (its wheel file missing, so the install itself fails, leaving nothing).
    monkeypatch.setenv("PIP_INDEX_URL", _fake_index(tmp_path / "index", ["0.5.23", "0.5.24"]))
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv(target.CACHE_ENV, str(tmp_path / "cache"))
    assert resolve_mod.index_versions("sglang") == ("0.5.24", "0.5.23")
    said: list[str] = []
    with pytest.raises(target.TargetError, match=r"sglang 0\.5\.24 is not on the package index|could not|pip"):
        target.resolve("0.5.24", progress=said.append)
    assert said[0].startswith(
        "warning: sglang 0.5.24 is newer than the newest release the harness was checked against (0.5.23)"
    )
    assert any("installing" in line for line in said[1:])
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [], (
        "a failed install leaves no lock and no directory"
    )
    with pytest.raises(
        target.TargetError, match=r"sglang 0\.5\.22 is not on the package index \(its newest release is 0\.5\.24\)"
    ):
        target.resolve("0.5.22")


# ---------------------------------------------------------------------------------------- activate


def test_activation_reaches_subprocesses_and_refuses_a_second_sglang(tmp_path):
    tree = fake_tree(tmp_path / "tree", "0.5.21")
    code = (
        "import os, sys; from harness.targets.sglang import selection as t; found = t.select(sys.argv[1]); "
        "import sglang; print(sglang.__file__); "
        "import subprocess; print(subprocess.run([sys.executable, '-c', 'import sglang; print(sglang.__file__)'], "
        "capture_output=True, text=True).stdout.strip()); print(os.environ['HARNESS_SGLANG'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tree)], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    here, child, spec = done.stdout.split()
    assert here == child == str(tree.resolve() / "sglang" / "__init__.py")
    assert spec == str(tree)
    # Another sglang imported first (a second small tree: the refusal does not depend on which one,
    # and the installed package would take seconds to import).
    other = fake_tree(tmp_path / "other", "0.5.22")
    late = "import sglang, sys; from harness.targets.sglang import selection as t; t.select(sys.argv[1])"
    done = subprocess.run(
        [sys.executable, "-c", late, str(tree)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(PYTHONPATH=os.pathsep.join([str(other), _env()["PYTHONPATH"]])),
    )
    last = done.stderr.splitlines()[-1]
    assert (
        done.returncode != 0
        and f"sglang was imported from {other.resolve()} before the target sglang 0.5.21 (tree" in last
    ), last


def test_sglang_imported_first_from_the_overlay_is_the_target(tmp_path):
    # A fault or mutant run on a release or tree target: its Ray ranks preload sglang from the patched
    # copy ($HARNESS_SGLANG_OVERLAY) before they select the target (`harness faults check --sglang
    # 0.5.22` on a simulated PD suite refused every rank before this was accepted).
    tree = fake_tree(tmp_path / "tree", "0.5.21")
    patched = fake_tree(tmp_path / "patched", "0.5.21")
    late = (
        "import sglang, sys; from harness.targets.sglang import selection as t; t.select(sys.argv[1]); "
        "print(sglang.__file__)"
    )
    env = _env(PYTHONPATH=os.pathsep.join([str(patched), _env()["PYTHONPATH"]]))
    done = subprocess.run(
        [sys.executable, "-c", late, str(tree)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, target.OVERLAY_ENV: str(patched)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(patched.resolve() / "sglang" / "__init__.py")


def test_a_tree_of_links_imported_first_is_that_tree(tmp_path):
    # A forked rank imported sglang from the tree before it selects it; the tree's files are links
    # to another tree's (the tests' unpacked release): it is still the target, not the linked-to tree.
    real = fake_tree(tmp_path / "real", "0.5.21")
    links = tmp_path / "links"
    shutil.copytree(real, links, copy_function=os.symlink)
    code = "import sglang, sys; from harness.targets.sglang import selection as t; t.select(sys.argv[1]); print('ok')"
    done = subprocess.run(
        [sys.executable, "-c", code, str(links)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(PYTHONPATH=os.pathsep.join([str(links), _env()["PYTHONPATH"]])),
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-1500:]


# ---------------------------------------------------------------------------------------- compat


def test_core_and_release_checks_read_source_only(tmp_path):
    assert compat.core_missing(fake_tree(tmp_path / "ok")) is None
    assert "DecodePreallocQueue._swa_tail_len" in compat.core_missing(fake_tree(tmp_path / "old", core=False))
    assert compat.release_refused("0.5.15") and compat.release_refused("0.4.10")
    assert all(compat.release_refused(v) is None for v in ("0.5.16", "0.5.18", "0.5.19", "0.5.24"))
    assert compat.release_deps("0.5.16") and compat.release_deps("0.5.19") and compat.release_deps("0.5.23") == ()


def test_release_before_the_module_level_prealloc_is_refused_with_the_reason():
    """0.5.15 is refused for what it lacks (its prealloc is inline in the queue), not for its SWA tail,
    which floors the window start exactly as the supported releases do."""
    refusal = compat.release_refused("0.5.15")
    assert "\n" not in refusal and "inline in DecodePreallocQueue._pre_alloc" in refusal
    assert "no module-level alloc_for_decode_prealloc" in refusal and "pass 0.5.16 or newer" in refusal
    assert compat.release_refused("0.5.16") is None


def test_a_tree_whose_runtime_context_cannot_override_server_args_lacks_the_core(tmp_path):
    tree = fake_tree(tmp_path / "t")
    (tree / "sglang/srt/runtime_context.py").write_text("def get_context():\n    pass\n")  # 0.5.15's shape
    assert compat.core_missing(tree) == "no RuntimeContext.override_server_args in sglang/srt/runtime_context.py"


def test_triton_only_paged_allocator_runs_interpreted_without_a_gpu_driver(tmp_path, monkeypatch):
    old = fake_tree(tmp_path / "old")
    (old / "sglang/srt/mem_cache/allocator/paged.py").write_text("def alloc_extend(): kernel[(1,)]()\n")
    new = fake_tree(tmp_path / "new")
    (new / "sglang/srt/mem_cache/allocator/paged.py").write_text("use_triton_kernels = False\n")
    assert compat.process_env(old, gpu_driver=False) == {"TRITON_INTERPRET": "1"}
    assert compat.process_env(old, gpu_driver=True) == {} and compat.process_env(new, gpu_driver=False) == {}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert compat.device_missing("cpu", page_size=64, hisparse=False, root=old)[0] == "paged-allocator-without-triton"
    assert compat.device_missing("cpu", page_size=1, hisparse=False, root=old) is None
    assert compat.device_missing("cuda:0", page_size=64, hisparse=True, root=old) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert compat.device_missing("cpu", page_size=64, hisparse=False, root=old) is None
    assert (
        compat.device_missing("cpu", page_size=256, hisparse=True, root=old)[0] == "device-module-without-accelerator"
    )


# ---------------------------------------------------------------------------------------- entry points


def _bad_target_cases(tmp_path: Path) -> list[str]:
    (tmp_path / "empty").mkdir(parents=True)
    return [
        str(tmp_path / "missing"),
        str(tmp_path / "empty"),
        "0.4.10",
        str(fake_tree(tmp_path / "old-tree", "0.4.10", core=False)),
    ]


@pytest.mark.parametrize("entry", ["rerun-test", "gate", "faults", "doctor", "matrix"])
def test_every_entry_point_refuses_a_bad_target_in_one_line_before_running(tmp_path, entry):
    for i, bad in enumerate(_bad_target_cases(tmp_path / entry)):
        run_dir = tmp_path / f"run-{i}"
        argv = {
            "rerun-test": [
                str(BIN / "rerun-test"),
                "--sglang",
                bad,
                "--run-dir",
                str(run_dir),
                "test_decode_reservation.py",
            ],
            "gate": [str(BIN / "harness"), "gate", "run", "per-commit", "--sglang", bad, "--run-dir", str(run_dir)],
            "faults": [str(BIN / "harness"), "faults", "check", "--sglang", bad, "--run-dir", str(run_dir)],
            "doctor": [str(BIN / "harness"), "doctor", "cpu", "--sglang", bad, "--run-dir", str(run_dir)],
            "matrix": [
                str(BIN / "harness"),
                "matrix",
                "--sglang",
                f"0.5.23,{bad}",
                "--run-dir",
                str(run_dir),
                "test_decode_reservation.py",
            ],
        }[entry]
        done = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (bad, done.stdout[-500:], done.stderr[-1500:])
        assert len(lines) == 1 and "sglang" in lines[0], (bad, lines)
        assert not (run_dir / "junit").exists() and not (run_dir / "report").exists(), f"{bad}: something ran"


def test_pytest_refuses_a_bad_target_before_collecting(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "suites/unit/disaggregation/test_decode_reservation.py",
            "-p",
            "no:cacheprovider",
            "--sglang",
            str(tmp_path / "missing"),
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    assert "no such file or directory" in done.stderr and "collected" not in done.stdout


def test_report_header_and_junit_name_the_target(pytester, tmp_path):
    tree = fake_tree(tmp_path / "tree", "0.5.21")
    pytester.makepyfile("def test_ok():\n    pass\n")
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--sglang", str(tree), f"--junitxml={tmp_path / 'j.xml'}"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"harness: sglang 0.5.21 (tree {tree.resolve()}), root {tree.resolve()}"])
    xml = (tmp_path / "j.xml").read_text()
    assert 'name="sglang_version" value="0.5.21"' in xml and 'name="sglang_origin" value="tree"' in xml


# ---------------------------------------------------------------------------------------- matrix


def test_matrix_tables_count_outcomes_per_target_and_file(tmp_path):
    summary = {
        "groups": [
            {
                "name": "cpu",
                "note": "",
                "cases": [
                    {"nodeid": "suites/a/test_a.py::t1", "outcome": "passed", "message": ""},
                    {"nodeid": "suites/a/test_a.py::t2", "outcome": "skipped", "message": "lacks capability 'x': y"},
                    {"nodeid": "suites/b/test_b.py::t1", "outcome": "failed", "message": "AssertionError: evicted"},
                ],
            }
        ]
    }
    cells = versions.summarize(summary)
    assert cells["suites/a/test_a.py"].text() == "1 passed, 1 skipped"
    assert cells["suites/b/test_b.py"].reasons == ("failed: AssertionError: evicted",)
    runs = [
        versions.TargetRun("0.5.21", "sglang 0.5.21 (release)", tmp_path, 1, 12.0, cells),
        versions.TargetRun("0.5.22", "sglang 0.5.22 (release)", tmp_path, 0, 3.0, {}),
    ]
    text = versions.render_text(runs)
    assert "test_a.py" in text.splitlines()[0] and "1 passed, 1 skipped" in text
    assert "sglang 0.5.21 (release) · test_a.py: skipped: lacks capability 'x': y" in text
    md = versions.render_markdown(runs)
    assert md.splitlines()[0] == "| target | wall | `test_a.py` | `test_b.py` |"
    assert versions.to_json(runs)["targets"][0]["files"]["suites/b/test_b.py"]["counts"] == {"failed": 1}
    assert versions.parse_targets("0.5.21, 0.5.21,,/x") == ["0.5.21", "/x"]
    assert versions.slug("/src/sglang/python") == "tree-python" and versions.slug("0.5.21") == "0.5.21"


def test_a_ray_worker_imports_the_target_the_driver_selected(pytester, tmp_path):
    tree = fake_tree(tmp_path / "tree", "0.5.21")
    pytester.makepyfile(f"""
        from harness.targets.sglang import selection
        from harness.workers import InProcess, Probe, WorkerSpec, start_worker

        def test_worker_sees_the_tree(ray_cluster, tmp_path):
            spec = selection.worker_spec(WorkerSpec("probe", InProcess(Probe), run_dir=tmp_path, ready_timeout=120))
            w = start_worker(spec)
            try:
                assert w.call("module_file", "sglang") == {str(tree.resolve() / "sglang" / "__init__.py")!r}
                assert w.call("env", "HARNESS_SGLANG") == {str(tree)!r}
            finally:
                w.stop()
    """)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--sglang", str(tree), "--run-dir", str(tmp_path / "run"), timeout=600
    )
    result.assert_outcomes(passed=1)


def test_rerun_test_refuses_a_release_the_index_does_not_have(tmp_path):
    env = _env(**{target.CACHE_ENV: str(tmp_path / "cache")})
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [str(BIN / "rerun-test"), "--sglang", "0.5.999", "--run-dir", str(run_dir), "test_decode_reservation.py"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-1500:]
    # One error line, before anything is installed or any run directory made.
    assert len(lines) == 1 and "sglang 0.5.999 is not on the package index" in lines[0], lines
    assert not run_dir.exists() and not list((tmp_path / "cache").glob(".*lock"))


def test_a_server_option_is_read_from_either_place_a_release_declares_it(tmp_path):
    """``--disaggregation-decode-retraction-backup`` (first in 0.5.18) is passed to a CPU decode server
    only where the target declares it: in ``server_args.py`` up to 0.5.22, ``arg_groups/fields`` in 0.5.23."""
    option = "disaggregation_decode_retraction_backup"
    old, flat, grouped = (fake_tree(tmp_path / name) for name in ("old", "flat", "grouped"))
    (old / "sglang/srt/server_args.py").write_text("class ServerArgs:\n    page_size: int = 1\n")
    (flat / "sglang/srt/server_args.py").write_text(f"class ServerArgs:\n    {option}: A[str] = None\n")
    (grouped / "sglang/srt/arg_groups/fields").mkdir(parents=True)
    (grouped / "sglang/srt/arg_groups/fields/disagg.py").write_text(f"class Disagg:\n    {option}: A[\n        str]\n")
    assert [compat.server_option(t, option) for t in (old, flat, grouped)] == [False, True, True]
