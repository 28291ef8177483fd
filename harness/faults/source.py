"""Source-patch faults: a unified diff against the target's sglang tree, applied to a scratch copy.

:func:`scratch_copy` builds a copy of the target's ``sglang`` package (symlinks, the patched files real)
that the caller puts first on the import path, so the installed package is never touched. Every patch adds
a marker proving it ran (:func:`fired`); :func:`patch_errors` says why a patch does not apply. Detail:
docs/modules.md.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

#: Env var naming the file every patch's marker line appends the fault's name to.
FIRED_ENV = "HARNESS_FAULT_FIRED"
#: Where the catalog's diffs live.
PATCH_DIR = Path(__file__).resolve().parent / "patches"
#: File written at the top of a scratch copy listing the faults applied to it (one name a line).
STAMP = "HARNESS_FAULTS"
PACKAGE = "sglang"

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    """A patch is malformed or does not apply to the target tree (names file, hunk and line)."""


@dataclass(frozen=True)
class Hunk:
    """One hunk: where it starts in the old file (1-based) and its lines with their ``' '/'-'/'+'`` tag."""

    old_start: int
    lines: tuple[tuple[str, str], ...]

    @property
    def old(self) -> list[str]:
        return [text for tag, text in self.lines if tag in " -"]

    @property
    def new(self) -> list[str]:
        return [text for tag, text in self.lines if tag in " +"]


@dataclass(frozen=True)
class FilePatch:
    """The hunks of one file, its path relative to the tree (``sglang/...``)."""

    path: str
    hunks: tuple[Hunk, ...]


def imported_tree() -> Path:
    """The directory holding the ``sglang`` package this process would import (a patched scratch copy
    when one is first on the path; found without importing it).

    Returns:
        E.g. ``.../site-packages`` or the scratch directory; ``<it>/sglang`` is the package.

    Raises:
        PatchError: no ``sglang`` package is importable.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("no importable sglang package: install the target sglang (./dev install) first")
    return Path(list(spec.submodule_search_locations)[0]).resolve().parent


def parse(text: str, where: str = "patch") -> tuple[FilePatch, ...]:
    """Parse a unified diff (``---``/``+++`` headers with ``a/``/``b/`` prefixes, ``@@`` hunks).

    Args:
        text: the diff.
        where: its name, for messages.

    Returns:
        One :class:`FilePatch` per file.

    Raises:
        PatchError: no file in it, or a hunk whose line counts disagree with its header.
    """
    files: list[FilePatch] = []
    path: str | None = None
    hunks: list[Hunk] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- "):
            if path is not None:
                files.append(FilePatch(path, tuple(hunks)))
            new = lines[i + 1] if i + 1 < len(lines) else ""
            if not new.startswith("+++ "):
                raise PatchError(f"{where}: line {i + 2}: expected '+++' after '---'")
            path, hunks = new[4:].strip().split("\t")[0].removeprefix("b/"), []
            i += 2
            continue
        m = _HUNK.match(line)
        if m:
            if path is None:
                raise PatchError(f"{where}: line {i + 1}: hunk before any file header")
            old_n = int(m.group(2) or 1)
            new_n = int(m.group(4) or 1)
            body: list[tuple[str, str]] = []
            i += 1
            while i < len(lines) and (old_n > 0 or new_n > 0):
                tag, rest = lines[i][:1], lines[i][1:]
                if tag == "\\":  # "\ No newline at end of file"
                    i += 1
                    continue
                if tag not in " -+":
                    raise PatchError(f"{where}: line {i + 1}: hunk shorter than its header says")
                body.append((tag, rest))
                old_n -= tag in " -"
                new_n -= tag in " +"
                i += 1
            if old_n or new_n:
                raise PatchError(f"{where}: {path}: hunk at old line {m.group(1)} is truncated")
            hunks.append(Hunk(int(m.group(1)), tuple(body)))
            continue
        i += 1
    if path is not None:
        files.append(FilePatch(path, tuple(hunks)))
    if not files:
        raise PatchError(f"{where}: no file in the patch")
    return tuple(files)


def apply_text(text: str, patch: FilePatch) -> str:
    """The file ``text`` with ``patch`` applied: exact context, at the header's line or anywhere
    the context is unique (a release may have moved it), never fuzzy.

    Raises:
        PatchError: a hunk's context is not found exactly once.
    """
    lines = text.splitlines(keepends=True)
    offset = 0
    for n, hunk in enumerate(patch.hunks, 1):
        old = hunk.old
        at = hunk.old_start - 1 + offset
        if lines[at : at + len(old)] != old:
            hits = [k for k in range(len(lines) - len(old) + 1) if lines[k : k + len(old)] == old]
            if len(hits) != 1:
                why = "not found" if not hits else f"found {len(hits)} times"
                raise PatchError(
                    f"{patch.path}: hunk {n} (old line {hunk.old_start}) does not apply: its context is {why}"
                )
            at = hits[0]
        lines[at : at + len(old)] = hunk.new
        offset = at + len(hunk.new) - (hunk.old_start - 1 + len(old))
    return "".join(lines)


def load(name: str) -> tuple[FilePatch, ...]:
    """The parsed patch of fault ``name`` (``PATCH_DIR/<name>.diff``).

    Raises:
        PatchError: the file is missing or malformed.
    """
    path = PATCH_DIR / f"{name}.diff"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PatchError(f"fault {name}: patch file {path.name} missing from harness/faults/patches/") from None
    return parse(text, path.name)


def patch_errors(name: str, tree: Path) -> list[str]:
    """Why fault ``name``'s patch does not apply to ``tree`` (empty: it applies). Changes nothing.

    Args:
        name: a patch fault.
        tree: the directory holding ``sglang``.
    """
    errors = []
    try:
        for fp in load(name):
            src = tree / fp.path
            if not src.is_file():
                errors.append(f"{fp.path}: not in the target tree {tree}")
                continue
            apply_text(src.read_text(encoding="utf-8"), fp)
    except PatchError as e:
        errors.append(str(e))
    return errors


def scratch_copy(names: list[str] | tuple[str, ...], dest: Path, tree: Path) -> Path:
    """Build ``dest/sglang``: the target's package with the named faults' patches applied.

    Only the directories on the way to a patched file are real; every other file or subtree is a
    symlink to the target's (byte-code caches included, still valid since those sources are
    unchanged), so a copy of sglang's ~10,000 files takes a few hundred symlinks. A patched file
    is a real file, its stale byte-code removed.

    Args:
        names: patch faults, applied in order (two patching one file stack).
        dest: an empty or missing directory; put it first on the import path afterwards.
        tree: the directory holding ``sglang``.

    Returns:
        ``dest``.

    Raises:
        PatchError: a patch does not apply (nothing is left at ``dest/sglang``).
    """
    patched: dict[str, str] = {}
    for name in names:
        for fp in load(name):
            src = tree / fp.path
            if fp.path not in patched:
                if not src.is_file():
                    raise PatchError(f"fault {name}: {fp.path} is not in the target tree {tree}")
                patched[fp.path] = src.read_text(encoding="utf-8")
            try:
                patched[fp.path] = apply_text(patched[fp.path], fp)
            except PatchError as e:
                raise PatchError(f"fault {name}: {e}") from None
    scratch_files(patched, dest, tree, names)
    logger.info("scratch sglang with %s at %s (from %s)", ", ".join(names), dest, tree)
    return dest


def put_patched_copy_first(names: list[str], tree: Path, *, prefix: str, overlay_env: str, children: bool) -> Path:
    """Build a scratch copy of ``tree``'s sglang with the patch faults ``names`` (:func:`scratch_copy`) and put it
    first on this process's import path; ``overlay_env`` names it, so a process that activates the target again
    keeps it first; with ``children`` it also leads ``PYTHONPATH`` for the processes this one starts.

    Returns:
        The scratch directory (the caller removes it).

    Raises:
        PatchError: a patch does not apply (the scratch directory is removed).
    """
    scratch = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        scratch_copy(names, scratch, tree)
    except PatchError:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    sys.path.insert(0, str(scratch))
    os.environ[overlay_env] = str(scratch)
    if children:
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join([str(scratch), *inherited])
    os.environ.setdefault(FIRED_ENV, str(scratch / "fired.txt"))
    return scratch


def scratch_files(patched: dict[str, str], dest: Path, tree: Path, names: list[str] | tuple[str, ...]) -> Path:
    """Build ``dest/sglang``: the target's package with the files of ``patched`` replaced by its texts
    (what :func:`scratch_copy` does with a catalog patch's result; a mutant's file comes here too).

    Args:
        patched: ``sglang/...`` path -> the file's new text.
        dest: an empty or missing directory.
        tree: the directory holding ``sglang``.
        names: what the copy carries, written to its stamp (:func:`applied_in`).

    Returns:
        ``dest``.
    """
    _link_tree(tree / PACKAGE, dest / PACKAGE, {Path(rel).relative_to(PACKAGE) for rel in patched})
    for rel, text in patched.items():
        target = dest / rel
        target.unlink()
        target.write_text(text, encoding="utf-8")
        for pyc in (target.parent / "__pycache__").glob(f"{target.stem}.*.pyc"):
            pyc.unlink()
    (dest / STAMP).write_text("".join(f"{n}\n" for n in names), encoding="utf-8")
    return dest


def _link_tree(src: Path, out: Path, patched: set[Path]) -> None:
    """Mirror ``src`` at ``out``: a directory on the way to a patched file is real (and so is its
    ``__pycache__``), every other entry is one symlink to the original (a whole subtree at once)."""
    on_path = {parent for rel in patched for parent in rel.parents} | {Path(".")}
    out.mkdir(parents=True, exist_ok=True)
    for rel in sorted(on_path, key=lambda p: len(p.parts)):
        real = out / rel
        real.mkdir(parents=True, exist_ok=True)
        for entry in os.scandir(src / rel):
            child = rel / entry.name
            if child in on_path or (real / entry.name).exists():
                continue
            if entry.name == "__pycache__" and entry.is_dir():
                (real / entry.name).mkdir()  # patched files' byte-code must not be shared
                for pyc in os.scandir(entry.path):
                    os.symlink(pyc.path, real / entry.name / pyc.name)
                continue
            os.symlink(entry.path, real / entry.name)


def applied_in(package_dir: Path) -> list[str]:
    """The faults a scratch copy was built with (empty for an ordinary install).

    Args:
        package_dir: the ``sglang`` package directory an import would use.
    """
    stamp = package_dir.parent / STAMP
    return stamp.read_text(encoding="utf-8").split() if stamp.is_file() else []


def fired(path: Path) -> set[str]:
    """The fault names the markers wrote to ``path`` (empty when the file does not exist)."""
    try:
        return set(Path(path).read_text(encoding="utf-8").split())
    except FileNotFoundError:
        return set()
