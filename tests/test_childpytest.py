"""The pytest child's command line and environment (harness.workers.childpytest), and its three callers."""

from __future__ import annotations

import sys
from pathlib import Path

from harness.mutation import run as mutation_run
from harness.workers import childpytest


def test_command_puts_the_callers_options_around_the_junit_and_run_dir_core():
    cmd = childpytest.command(
        ["suites/a.py", "suites/b.py::test_x"],
        junit=Path("out/j.xml"),
        run_dir=Path("out/r"),
        before=["-q"],
        after=["--simulate"],
        python="py",
    )
    assert cmd == [
        "py",
        "-m",
        "pytest",
        "suites/a.py",
        "suites/b.py::test_x",
        "-q",
        "--junitxml=out/j.xml",
        "-o",
        "junit_family=xunit1",
        "--run-dir=out/r",
        "--simulate",
    ]
    assert childpytest.command([], junit=Path("j"), run_dir=Path("r"))[0] == sys.executable


def test_environment_drops_then_updates(monkeypatch):
    monkeypatch.setenv("CHILDPYTEST_A", "1")
    monkeypatch.setenv("CHILDPYTEST_B", "2")
    env = childpytest.environment({"CHILDPYTEST_C": "3", "CHILDPYTEST_A": "4"}, drop=["CHILDPYTEST_A", "CHILDPYTEST_B"])
    assert env["CHILDPYTEST_A"] == "4" and "CHILDPYTEST_B" not in env and env["CHILDPYTEST_C"] == "3"
    assert childpytest.environment()["CHILDPYTEST_B"] == "2"


def test_mutation_command_is_unchanged():
    cmd = mutation_run.pytest_command(["suites/unit"], Path("j.xml"), Path("r"))
    assert cmd == [
        sys.executable,
        "-m",
        "pytest",
        "suites/unit",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        "--junitxml=j.xml",
        "-o",
        "junit_family=xunit1",
        "--run-dir=r",
    ]
    assert "-x" not in mutation_run.pytest_command(["suites/unit"], Path("j.xml"), Path("r"), first_failure=False)
