"""Gate files: the shipped ones load; every bad file gives one line naming the file, the key and the fix."""

from __future__ import annotations

import textwrap

import pytest

from harness.gates import model
from harness.gates.model import FlakyPolicy, GateError

TOPOS = ["cpu", "2-gpu-h100", "8-gpu-h200", "2-node-16-gpu-h200"]

GOOD = """
name = "g"
sglang_version = "0.5.23"
min_pass_rate = 0.9
timeout = 120
[flaky]
reruns = 2
[[suites]]
name = "unit"
select = ["suites/unit/", "test_x.py::TestA::test_b"]
[[suites]]
name = "pd"
select = ["suites/pd/test_pd.py"]
required = false
topologies = ["2-gpu-h100"]
timeout = 30
min_pass_rate = 1.0
engine = "sim"
"""


def _load(tmp_path, text, name="g"):
    p = tmp_path / f"{name}.toml"
    p.write_text(textwrap.dedent(text))
    return model.load(p, topo_names=TOPOS)


def test_shipped_gates_load():
    assert model.names() == ["per-commit", "release"]
    for name in model.names():
        g = model.get(name)
        assert g.name == name and g.suites and g.sglang_version == "0.5.23"
        assert all(c in model.FLAKY_ELIGIBLE for c in g.flaky.classes)
    # per-commit never runs real servers; release runs everything
    assert all(s.engine in (None, "sim") for s in model.get("per-commit").suites)
    assert any(s.engine == "all" for s in model.get("release").suites)


def test_good_file_defaults_and_overrides(tmp_path):
    g = _load(tmp_path, GOOD)
    unit, pd = g.suites
    assert (unit.required, unit.timeout, unit.min_pass_rate, unit.engine, unit.topologies) == (
        True,
        120.0,
        0.9,
        None,
        (),
    )
    assert (pd.required, pd.timeout, pd.min_pass_rate, pd.topologies) == (False, 30.0, 1.0, ("2-gpu-h100",))
    assert pd.pytest_args() == ("--engine", "sim") and unit.pytest_args() == ()
    assert g.flaky == FlakyPolicy(reruns=2, classes=("accuracy", "timing"))
    assert g.hypothesis_seed is None and g.suite("pd") is pd


@pytest.mark.parametrize(
    "body, message",
    [
        ('name = "g"\n', "g.toml: suites: no [[suites]] entries; add at least one [[suites]] with name and select"),
        (
            'name = "other"\n[[suites]]\nname = "a"\nselect = ["t.py"]\n',
            "g.toml: name: 'other' differs from the file name; set name = \"g\" or rename the file",
        ),
        (
            'name = "g"\ncolour = 1\n[[suites]]\nname = "a"\nselect = ["t.py"]\n',
            "g.toml: colour: unknown key; remove it or use one of: description, flaky, min_pass_rate, name, seeds, "
            "sglang_version, suites, timeout",
        ),
        (
            'name = "g"\nmin_pass_rate = 1.5\n[[suites]]\nname = "a"\nselect = ["t.py"]\n',
            "g.toml: min_pass_rate: must be in (0, 1], got 1.5; use a fraction such as 1.0 or 0.95",
        ),
        (
            'name = "g"\n[[suites]]\nname = "a"\nselect = []\n',
            'g.toml: suites[0].select: is empty or missing; name what to run, e.g. select = ["suites/unit/"]',
        ),
        (
            'name = "g"\n[[suites]]\nname = "a"\nselect = ["t.py; rm -rf x.py"]\n',
            "g.toml: suites[0].select: refused 't.py; rm -rf x.py': whitespace inside a spec; "
            "give test files like test_x.py or file.py::Class::test; use rerun-test specs or a directory ending in '/'",
        ),
        (
            'name = "g"\n[[suites]]\nname = "a"\nselect = ["../up/"]\n',
            "g.toml: suites[0].select: '../up/' is not a directory inside the repository; "
            'use a relative directory such as "suites/unit/"',
        ),
        (
            'name = "g"\n[[suites]]\nname = "a"\nselect = ["t.py"]\ntopologies = ["4-gpu-a100"]\n',
            "g.toml: suites[0].topologies: unknown topology '4-gpu-a100'; "
            "use one of: cpu, 2-gpu-h100, 8-gpu-h200, 2-node-16-gpu-h200",
        ),
        (
            'name = "g"\n[[suites]]\nname = "a"\nselect = ["t.py"]\nrequired = "yes"\n',
            "g.toml: suites[0].required: expected bool, got 'yes'; set suites[0].required to a bool",
        ),
        (
            'name = "g"\n[[suites]]\nname = "a"\nselect = ["t.py"]\ntimeout = 0\n',
            "g.toml: suites[0].timeout: must be > 0 seconds, got 0; set it to the suite's worst-case seconds",
        ),
        (
            'name = "g"\n[[suites]]\nname = "a"\nselect = ["t.py"]\nengine = "vllm"\n',
            "g.toml: suites[0].engine: unknown engine 'vllm'; use one of: all, sim, sglang-server",
        ),
        (
            'name = "g"\n[[suites]]\nname = "a"\nselect = ["t.py"]\n[[suites]]\nname = "a"\nselect = ["u.py"]\n',
            "g.toml: suites[1].name: duplicate suite name 'a'; give every entry its own name",
        ),
        (
            'name = "g"\n[flaky]\nclasses = ["crash"]\n[[suites]]\nname = "a"\nselect = ["t.py"]\n',
            "g.toml: flaky.classes: 'crash' failures are never rerun (only accuracy, timing are flaky); "
            "keep only accuracy, timing",
        ),
        (
            'name = "g"\n[flaky]\nreruns = 99\n[[suites]]\nname = "a"\nselect = ["t.py"]\n',
            "g.toml: flaky.reruns: must be in 0..10, got 99; rerun a flaky failure a few times at most",
        ),
        (
            'name = "g"\n[seeds]\nhypothesis = -1\n[[suites]]\nname = "a"\nselect = ["t.py"]\n',
            "g.toml: seeds.hypothesis: must be from 0 to 2**64-1, got -1; use a non-negative integer",
        ),
        # before: accepted, and the group then never timed out
        (
            'name = "g"\ntimeout = nan\n[[suites]]\nname = "a"\nselect = ["t.py"]\n',
            "g.toml: timeout: must be a finite number from 0 to 86400, got nan; "
            "set it to the suite's worst-case seconds",
        ),
        (
            'name = "g"\n[[suites]]\nname = "a"\ntimeout = inf\nselect = ["t.py"]\n',
            "g.toml: suites[0].timeout: must be a finite number from 0 to 86400, got inf; "
            "set it to the suite's worst-case seconds",
        ),
        # before: the suite's directory escaped the run directory
        (
            'name = "g"\n[[suites]]\nname = "../.."\nselect = ["t.py"]\n',
            "g.toml: suites[0].name: '../..' is not a plain name; "
            "use letters, digits, '-', '_' and '.', starting with a letter or digit, at most 64",
        ),
        ('name = "g"\nsuites = [1]\n', "g.toml: suites[0]: must be a table; write each entry as [[suites]]"),
    ],
)
def test_bad_gate_files(tmp_path, body, message):
    with pytest.raises(GateError) as e:
        _load(tmp_path, body)
    assert str(e.value) == message


def test_a_gate_file_that_is_not_utf8_or_is_a_directory_is_one_line(tmp_path):
    (tmp_path / "g.toml").write_bytes(b'name = "g\xff"\n')
    with pytest.raises(GateError, match=r"^g\.toml: not UTF-8 text \(byte 9\); save the file as UTF-8$"):
        model.load(tmp_path / "g.toml")
    (tmp_path / "d.toml").mkdir()
    with pytest.raises(GateError, match=r"d\.toml: is a directory, not a gate file; pass a \.toml file"):
        model.load(tmp_path / "d.toml")


def test_bad_toml_and_unknown_name(tmp_path):
    with pytest.raises(GateError, match=r"^g.toml: not valid TOML \(.*\); fix the syntax$"):
        _load(tmp_path, "name = \n")
    with pytest.raises(
        GateError, match=r"^unknown gate 'nightly'; use one of: per-commit, release \(or a path to a .toml file\)$"
    ):
        model.get("nightly")


def test_flaky_policy_reruns_only_flaky_classes_up_to_the_limit():
    policy = FlakyPolicy(reruns=2)
    for cls in ("crash", "import", "timeout", "accounting", "assertion", "error"):
        assert not policy.may_rerun(cls, 1), cls
    assert policy.may_rerun("timing", 1) and policy.may_rerun("accuracy", 2)
    assert not policy.may_rerun("timing", 3)  # 1 run + 2 reruns done
    assert not FlakyPolicy(reruns=0).may_rerun("timing", 1)
    assert not FlakyPolicy(reruns=3, classes=("accuracy",)).may_rerun("timing", 1)


def test_bad_directory_selector(tmp_path):
    with pytest.raises(
        GateError, match=r"^g.toml: suites\[0\].select: 'a b/' is not a directory inside the repository"
    ):
        _load(tmp_path, 'name = "g"\n[[suites]]\nname = "a"\nselect = ["a b/"]\n')
