"""Validation helpers shared by the TOML-file loaders (topologies, gates).

Every problem becomes one error line ``FILE: KEY: PROBLEM; FIX`` of the loader's own error class,
so a user sees which file, which key and what to do (pytest-timeout's ``where`` idea).
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any


def fail(error: type[Exception], where: str, key: str, problem: str, fix: str) -> Exception:
    """Build (not raise) the one-line error ``where: key: problem; fix`` of class ``error``."""
    return error(f"{where}: {key}: {problem}; {fix}")


def take(
    error: type[Exception],
    table: dict[str, Any],
    key: str,
    kind: type | tuple[type, ...],
    default: Any,
    where: str,
    ctx: str,
) -> Any:
    """Return ``table[key]`` checked against ``kind``, or ``default`` when the key is absent.

    Raises:
        error: the value has the wrong type (a bool is never accepted where a number is meant).
    """
    if key not in table:
        return default
    value = table[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int subclass; never accept it where a number is meant.
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        names = "/".join(k.__name__ for k in kinds)
        raise fail(error, where, f"{ctx}{key}", f"expected {names}, got {value!r}", f"set {ctx}{key} to a {names}")
    return value


def number(error: type[Exception], value: float, where: str, key: str, low: float, high: float, fix: str) -> float:
    """``value`` when it is finite and in ``[low, high]``; else the one-line ``error`` naming the range.

    >>> number(ValueError, 5, "g.toml", "timeout", 1, 86400, "set seconds")
    5
    >>> number(ValueError, float("nan"), "g.toml", "timeout", 1, 86400, "set seconds")
    Traceback (most recent call last):
    ValueError: g.toml: timeout: must be a finite number from 1 to 86400, got nan; set seconds
    """
    if not (isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high):
        raise fail(error, where, key, f"must be a finite number from {low:g} to {high:g}, got {value!r}", fix)
    return value


def read(error: type[Exception], path: Path, kind: str, listing: str) -> dict[str, Any]:
    """The TOML document in ``path``, or one error line naming the file and the fix (missing, a directory,
    unreadable, not UTF-8, not TOML). ``listing`` is the command that lists the shipped ones."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise error(f"{path}: file not found; pass an existing {kind} file or a name from `{listing}`") from None
    except IsADirectoryError:
        raise error(
            f"{path}: is a directory, not a {kind} file; pass a .toml file or a name from `{listing}`"
        ) from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror}); check its permissions") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path.name}: not UTF-8 text (byte {e.start}); save the file as UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"{path.name}: not valid TOML ({e}); fix the syntax") from None


def check_unknown(error: type[Exception], table: dict[str, Any], allowed: set[str], where: str, ctx: str) -> None:
    """Raise ``error`` naming the first key of ``table`` not in ``allowed``, with the allowed keys as the fix."""
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise fail(
            error, where, f"{ctx}{unknown[0]}", "unknown key", f"remove it or use one of: {', '.join(sorted(allowed))}"
        )


def names(directory: Path) -> list[str]:
    """Names of the ``*.toml`` files in ``directory`` (files starting with ``_`` are not entries), sorted."""
    return sorted(p.stem for p in directory.glob("*.toml") if not p.stem.startswith("_"))


def find(error: type[Exception], kind: str, name_or_path: str | Path, directory: Path) -> Path:
    """The file for a name (``directory/NAME.toml``) or a path (anything ending in .toml or with a /).

    Raises:
        error: an unknown name, listing the known ones.
    """
    s = str(name_or_path)
    if s.endswith(".toml") or "/" in s:
        return Path(s)
    path = directory / f"{s}.toml"
    if not path.is_file():
        known = ", ".join(names(directory)) or "none"
        raise error(f"unknown {kind} {s!r}; use one of: {known} (or a path to a .toml file)")
    return path
