"""Result files are written whole or not at all (harness/atomic.py), and every result writer uses it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness import atomic
from harness.rundir import REPO_ROOT


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path):
    target = atomic.write_json(tmp_path / "durations.json", {"a": 1.0})
    with pytest.raises(TypeError):
        atomic.write_text(target, 123)  # type: ignore[arg-type]  # fails mid-write
    assert target.read_text() == '{\n  "a": 1.0\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["durations.json"]


def test_no_result_file_is_written_with_a_plain_write_text():
    # A JSON, Markdown, XML or HTML result written with write_text can be left truncated by a killed run.
    plain = re.compile(r"""\(\s*\w+\s*/\s*["'][\w.-]+\.(json|md|xml|html)["']\s*\)\.write_text\(""")
    found = [
        f"{p.relative_to(REPO_ROOT)}:{i}"
        for p in (REPO_ROOT / "harness").rglob("*.py")
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if plain.search(line)
    ]
    assert not found, found


def test_modes_follow_the_umask_and_a_replaced_file_keeps_its_own(tmp_path: Path):
    new = atomic.write_text(tmp_path / "new.json", "{}\n")
    assert new.stat().st_mode & 0o777 == atomic.NEW_FILE_MODE
    private = tmp_path / "private.json"
    private.write_text("{}")
    private.chmod(0o600)
    atomic.write_text(private, "[]\n")
    assert private.stat().st_mode & 0o777 == 0o600
    long = atomic.write_text(tmp_path / ("n" * 250 + ".json"), "{}\n")  # the temporary's name stays short
    assert long.read_text() == "{}\n"
