"""The version of a sglang tree, read from its files (never by importing it).

A release or wheel records it in ``sglang/_version.py`` (written by setuptools-scm when the wheel is
built) and in its ``sglang-<version>.dist-info``; a git checkout has neither, so ``git describe``
names it (``v0.5.21-12-gabc`` -> ``0.5.21.dev12+gabc``). Reading ``importlib.metadata`` instead
would name the *installed* distribution even when another tree is first on the path.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

#: What a tree without any version record reports.
UNKNOWN = "unknown"

_VERSION_LINE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.MULTILINE)
_DESCRIBE = re.compile(r"^v?(\d+\.\d+\.\d+)(?:-(\d+)-g([0-9a-f]+))?")


def read_version(root: str | Path) -> str:
    """The sglang version of the tree at ``root`` (the directory holding ``sglang/``).

    Args:
        root: the directory holding ``sglang/``.

    Returns:
        The version string, or :data:`UNKNOWN`.
    """
    root = Path(root)
    scm = root / "sglang" / "_version.py"
    if scm.is_file():
        found = _VERSION_LINE.search(scm.read_text(encoding="utf-8", errors="replace"))
        if found:
            return found.group(1)
    infos = sorted(root.glob("sglang-*.dist-info"))
    for info in infos:
        for line in (info / "METADATA").read_text(encoding="utf-8", errors="replace").splitlines()[:20]:
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return _git_describe(root) or UNKNOWN


def _git_describe(root: Path) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "describe", "--tags", "--match", "v[0-9]*"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = _DESCRIBE.match(done.stdout.strip()) if done.returncode == 0 else None
    if not found:
        return None
    base, ahead, sha = found.groups()
    return base if not ahead else f"{base}.dev{ahead}+g{sha}"


def release_tuple(version: str) -> tuple[int, int, int] | None:
    """``"0.5.21"`` / ``"0.5.21.dev3+gabc"`` -> ``(0, 5, 21)``; None for :data:`UNKNOWN` or junk.

    Args:
        version: a version string.

    Returns:
        The numeric release, or None.
    """
    found = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(p) for p in found.groups()) if found else None  # type: ignore[return-value]
