"""A PR's sglang checkout for the changed-line and mutation tests, made in a temp dir.

``make(repo, edits)``: ``repo/python/sglang`` is the installed sglang as a tree of links to its files
(nothing copied), with ``sglang/srt/disaggregation/decode.py`` a real file committed as the release
has it, then edited in the working tree by ``edits`` (each ``(old, new)`` found exactly once), its
stale byte-code dropped; ``files`` are written under ``repo`` and committed too (an sglang-style
``test/registered/``). ``git diff HEAD`` of the result is the PR's change.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

DECODE = "sglang/srt/disaggregation/decode.py"


def git(root: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(root), "-c", "user.email=t@t", "-c", "user.name=t", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def make(repo: Path, edits: tuple[tuple[str, str], ...], files: dict[str, str] | None = None) -> tuple[Path, str]:
    """Build the checkout; returns ``(repo/python, the edited decode.py's text)``."""
    installed = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]).parent
    tree = repo / "python"
    shutil.copytree(installed / "sglang", tree / "sglang", copy_function=os.symlink)
    path = tree / DECODE
    text = path.read_text()
    path.unlink()
    path.write_text(text)
    for name, body in (files or {}).items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(textwrap.dedent(body))
    (repo / ".gitignore").write_text("/python/sglang/\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "add", "-f", f"python/{DECODE}")
    git(repo, "commit", "-qm", "the release's decode.py")
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path.write_text(text)
    for pyc in (path.parent / "__pycache__").glob("decode.*.pyc"):
        pyc.unlink()
    return tree, text
