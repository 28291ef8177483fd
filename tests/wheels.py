"""sglang release wheels for tests that read a release's source without installing it: downloaded once
(``pip download --no-deps``) into the harness's targets cache, which the release installs share."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.targets.sglang.resolve import cache_dir


def sglang_wheel(version: str) -> Path:
    """The cached wheel of sglang ``version``, downloaded on first use (a failed download fails the test)."""
    into = cache_dir() / "wheels"
    found = sorted(into.glob(f"sglang-{version}-*.whl"))
    if not found:
        into.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "-q",
                "-d",
                str(into),
                f"sglang=={version}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"pip download sglang=={version}: {done.stderr[-1500:]}"
        found = sorted(into.glob(f"sglang-{version}-*.whl"))
    return found[-1]
