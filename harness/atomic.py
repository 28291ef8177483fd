"""Every result file the harness writes (JSON, Markdown, XML, HTML) is written whole or not at all.

A run killed mid-write used to leave a truncated ``durations.json`` that broke every later run. The text goes to
a temporary file beside the target, is flushed to disk, and replaces the target with one ``os.replace`` (atomic
on POSIX), so a reader sees the old file or the new one. No library fits: ``atomicwrites`` is archived, and
this is the whole recipe.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: The mode a new file gets: what a plain open() would give under this process's umask.
NEW_FILE_MODE = 0o666 & ~_umask()


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically, creating its directory; returns the path.

    >>> import tempfile; p = Path(tempfile.mkdtemp()) / "a" / "x.json"
    >>> write_text(p, "{}\\n").read_text(), sorted(q.name for q in p.parent.iterdir())
    ('{}\\n', ['x.json'])
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:64]}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            mode = os.stat(path).st_mode & 0o777  # a file replaced keeps its mode
        except FileNotFoundError:
            mode = NEW_FILE_MODE
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | Path, data: Any, *, indent: int | None = 2, sort_keys: bool = False) -> Path:
    """Write ``data`` as JSON (and a final newline) to ``path`` atomically; returns the path."""
    return write_text(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")
