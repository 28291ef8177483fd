"""The prose a newcomer reads stays true: the README stays short, and every ``HARNESS_*`` variable the code
names is in the table of docs/env-vars.md."""

from __future__ import annotations

import re

from harness.rundir import REPO_ROOT

#: The README's budget (issue 45: what it is, the two commands, a sglang change, a failure, the commands, the layout).
README_WORDS = 2000


def test_the_readme_reads_in_one_sitting():
    words = len((REPO_ROOT / "README.md").read_text(encoding="utf-8").split())
    assert words <= README_WORDS, f"README.md has {words} words; move detail to docs/ (at most {README_WORDS})"


def test_every_harness_variable_is_in_the_env_var_table():
    pattern = re.compile(r"HARNESS_[A-Z0-9_]+")
    named: set[str] = set()
    for top in ("harness", "bench", "tests", "suites", "ci", ".ci"):
        for path in (REPO_ROOT / top).rglob("*"):
            if (
                path.is_file()
                and path.suffix in (".py", ".yml", ".toml", ".sh", ".md", "")
                and "__pycache__" not in path.parts
            ):
                named |= set(pattern.findall(path.read_text(encoding="utf-8", errors="replace")))
    named |= set(pattern.findall((REPO_ROOT / "dev").read_text(encoding="utf-8")))
    table = (REPO_ROOT / "docs" / "env-vars.md").read_text(encoding="utf-8")
    listed = {m for m in re.findall(r"^\| `(HARNESS_[A-Z0-9_<>]+)`", table, re.M)}
    missing = sorted(
        n
        for n in named
        if n not in listed
        and not any(
            lst.endswith("<NAME>`") or (lst.endswith("_<NAME>") and n.startswith(lst[: -len("<NAME>")]))
            for lst in listed
        )
    )
    assert not missing, f"name these in docs/env-vars.md: {missing}"
