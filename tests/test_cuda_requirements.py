"""The CUDA set ``./dev`` installs on a machine with a GPU (``requirements/cuda/sglang.txt``) resolves.

No GPU here, so the set is never installed by the tests: instead uv resolves the pinned lock against
the registry for the GPU machines' platform (linux x86_64, Python 3.11) without downloading a wheel
(metadata only: about 10 s, some 50 MB of index pages into uv's cache). A pin the registry no longer
has, one with no wheel for the platform, or two pins that conflict fail it; so does a lock that
misses a dependency (uv's answer then names a package the lock does not pin, which ``./dev`` would
install unpinned).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "cuda" / "sglang.txt"
#: The GPU machines' platform: sglang 0.5.23's wheels are manylinux_2_34 (x86_64 and aarch64 only).
PLATFORM = ("--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_34")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", re.M)


def pins(text: str) -> dict[str, str]:
    """``name -> version`` of every ``name==version`` line (names normalized as PEP 503 does)."""
    return {re.sub(r"[-_.]+", "-", m[1]).lower(): m[2] for m in _PIN.finditer(text)}


def _uv() -> str:
    uv = Path(sys.executable).with_name("uv")
    if not uv.exists():
        pytest.fail(f"no uv beside {sys.executable}: run ./dev install", pytrace=False)
    return str(uv)


@pytest.mark.est_time(12)
def test_cuda_set_resolves_against_the_registry(tmp_path):
    locked = pins(LOCK.read_text(encoding="utf-8"))
    assert locked["sglang"] and locked["mooncake-transfer-engine"], (
        "the CUDA lock must pin sglang and mooncake's CUDA build"
    )
    out = tmp_path / "resolved.txt"
    proc = subprocess.run(
        [
            _uv(),
            "pip",
            "compile",
            str(LOCK),
            *PLATFORM,
            "--system-certs",
            "--no-header",
            "--no-annotate",
            "-q",
            "-o",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"the CUDA set does not resolve:\n{proc.stderr[-3000:]}"
    resolved = pins(out.read_text(encoding="utf-8"))
    assert resolved == locked, (
        f"resolution differs from the lock: unpinned {sorted(set(resolved) - set(locked))}, "
        f"changed {sorted(k for k in resolved.keys() & locked.keys() if resolved[k] != locked[k])}; "
        f"recompile it (the command is in requirements/cuda/sglang.in)"
    )


def test_cuda_set_tests_the_same_sglang_and_torch_as_the_cpu_set():
    """The two sets differ in how sglang is installed, never in which sglang (or torch) is under test."""
    locked = pins(LOCK.read_text(encoding="utf-8"))
    cpu = pins((ROOT / "requirements" / "sglang-cpu.txt").read_text(encoding="utf-8"))
    torch_cpu = re.search(r'"torch==([^"]+)"', (ROOT / "dev").read_text(encoding="utf-8"))
    assert torch_cpu, './dev no longer pins torch for the CPU set as "torch==VERSION"'
    assert locked["sglang"] == cpu["sglang"]
    assert locked["torch"] == torch_cpu[1]
    assert "mooncake-transfer-engine-non-cuda" not in locked, "the CUDA set must use mooncake's CUDA build"


@pytest.mark.parametrize(
    "smi, forced, expected",
    [
        ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)", None, "cuda"),
        ("No devices were found", None, "cpu"),
        pytest.param(
            None,
            None,
            "cpu",
            marks=pytest.mark.skipif(
                bool(shutil.which("nvidia-smi", path="/usr/bin:/bin")), reason="this machine has an nvidia-smi"
            ),
        ),
        ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)", "cpu", "cpu"),
        (None, "cuda", "cuda"),
    ],
)
def test_dev_picks_the_cuda_set_where_nvidia_smi_lists_a_gpu(tmp_path, smi, forced, expected):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if smi is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\necho '{smi}'\n", encoding="utf-8")
        fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    if forced:
        env["HARNESS_INSTALL_SET"] = forced
    proc = subprocess.run([str(ROOT / "dev"), "install-set"], env=env, capture_output=True, text=True, timeout=30)
    assert (proc.returncode, proc.stdout.strip()) == (0, expected), proc.stderr


def test_dev_refuses_an_unknown_install_set():
    proc = subprocess.run(
        [str(ROOT / "dev"), "install-set"],
        env={"PATH": "/usr/bin:/bin", "HARNESS_INSTALL_SET": "gpu"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "dev: HARNESS_INSTALL_SET=gpu: use cpu or cuda (or leave it unset: cuda where nvidia-smi lists a GPU)"
    ]
