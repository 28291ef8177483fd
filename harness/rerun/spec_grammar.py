"""Parse rerun specs: what a user or a PR comment asked to run.

Accepted: file names, paths, ``file::Class::test`` and parametrize ids, or a ``/rerun-test …`` comment
line. Anything else is refused with :class:`SpecError` before anything runs, because the text is echoed
into logs, comments and pytest's command line. The grammar: docs/modules.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

COMMAND = "/rerun-test"

# A path segment: starts with a letter, digit or underscore (so never an option or a dot file).
_SEGMENT = r"[A-Za-z0-9_][A-Za-z0-9_.\-]*"
_PATH_RE = re.compile(rf"^/?(?:{_SEGMENT}/)*{_SEGMENT}\.py$")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PARAM_RE = re.compile(r"^\[[A-Za-z0-9_.,=+\-]+\]$")
_SHELL_CHARS = set(";|&$`<>(){}*?!~'\"\\#%^")


class SpecError(ValueError):
    """A spec or comment body is not a test spec. The message is one line: what and what to do."""


@dataclass(frozen=True)
class Spec:
    """One parsed spec.

    Attributes:
        path: the file part as written (bare name, relative or absolute path); never contains ``..``.
        names: the test path inside the file, e.g. ``("TestX", "test_y")``; empty for the whole file.
        param: a parametrize id including brackets (``"[a-1]"``) or ``""``.
        text: the spec as given, for messages.
    """

    path: str
    names: tuple[str, ...] = ()
    param: str = ""
    text: str = ""

    @property
    def is_bare(self) -> bool:
        """True for a bare file name (no directory part)."""
        return "/" not in self.path

    def suffix(self) -> str:
        """The ``::Class::test[param]`` part of a pytest node id (``""`` for the whole file)."""
        return "".join(f"::{n}" for n in self.names) + (self.param if self.names else "")


#: The most specs one command or comment may name, and the longest one spec may be: a comment is
#: untrusted input, and the plan, the bot's reply and the dedup all grow with it.
MAX_SPECS = 200
MAX_SPEC_LEN = 400


def _capped(specs: list[Spec]) -> list[Spec]:
    if len(specs) > MAX_SPECS:
        raise SpecError(f"more than {MAX_SPECS} tests named; name a directory or a file instead of each test")
    return specs


def _refuse(token: str, why: str) -> SpecError:
    shown = token if len(token) <= 60 else token[:57] + "..."
    return SpecError(f"refused {shown!r}: {why}; give test files like test_x.py or file.py::Class::test")


def parse_spec(token: str) -> Spec:
    """Parse one spec token.

    Args:
        token: e.g. ``test_x.py``, ``suites/a/test_x.py::TestC.test_y[p1]``.

    Returns:
        The :class:`Spec`.

    Raises:
        SpecError: the token is not a test spec (see the module docstring).
    """
    if len(token) > MAX_SPEC_LEN:
        raise _refuse(token, f"{len(token)} characters, at most {MAX_SPEC_LEN}")
    if not token:
        raise _refuse(token, "empty spec")
    if any(ord(c) < 32 or ord(c) == 127 for c in token) or not token.isascii():
        raise _refuse(token, "control or non-ASCII characters")
    if any(c.isspace() for c in token):
        raise _refuse(token, "whitespace inside a spec")
    if token.startswith("-"):
        raise _refuse(token, "options are not accepted in a spec")
    bad = sorted(set(token) & _SHELL_CHARS)
    if bad:
        raise _refuse(token, f"shell metacharacter {''.join(bad)!r}")
    if "://" in token:
        raise _refuse(token, "URLs are not test specs")
    path, sep, rest = token.partition("::")
    if ".." in path.split("/"):
        raise _refuse(token, "'..' is not allowed in a path")
    if "//" in path or path.endswith("/"):
        raise _refuse(token, "malformed path")
    if not _PATH_RE.match(path):
        if any(seg.startswith("-") for seg in path.split("/")):
            raise _refuse(token, "options are not accepted in a spec")
        raise _refuse(token, "not a Python test file path (letters, digits, _ . - / and a .py ending)")
    names: tuple[str, ...] = ()
    param = ""
    if sep:
        if not rest:
            raise _refuse(token, "nothing after '::'")
        bracket = rest.find("[")
        if bracket >= 0:
            rest, param = rest[:bracket], rest[bracket:]
            if not _PARAM_RE.match(param):
                raise _refuse(token, "malformed parametrize id")
        # file::Class.test is the unittest spelling of file::Class::test.
        parts = [p for chunk in rest.split("::") for p in chunk.split(".")]
        if len(parts) > 3 or not all(_NAME_RE.match(p) for p in parts):
            raise _refuse(token, "test names are identifiers: file.py::Class::test or file.py::test")
        names = tuple(parts)
    return Spec(path=path, names=names, param=param, text=token)


def parse_specs(tokens: list[str], options: dict | None = None) -> list[Spec]:
    """Parse several spec tokens; a token that is a whole ``/rerun-test`` comment is expanded.

    Args:
        tokens: the positional arguments of ``rerun-test``.
        options: where a whole comment's options go (:func:`parse_option`).

    Returns:
        The specs in order, duplicates removed.

    Raises:
        SpecError: any token is refused (nothing is returned then).
    """
    seen: dict[Spec, None] = {}  # in order, each once
    for token in tokens:
        if token.lstrip().startswith(COMMAND):
            seen.update(dict.fromkeys(_parse_comment(token, options if options is not None else {})))
        else:
            seen.setdefault(parse_spec(token))
        _capped(list(seen))  # stops at the first spec past the cap, so the work stays bounded
    return list(seen)


#: What a comment may ask besides tests: ``--coverage`` (changed-line coverage of the target),
#: ``--changed=REV`` (only the lines that differ from REV; implies ``--coverage``) and ``--mutate``
#: (after the tests, ``harness mutate`` on the changed functions, or on the default set).
OPTIONS = ("--coverage", "--changed=REV", "--mutate")
_REV_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/~^-]{0,99}$")


def parse_option(token: str, options: dict) -> None:
    """Fold one ``--option`` token of a comment into ``options`` (``coverage``, ``changed``, ``mutate``)."""
    name, eq, value = token.partition("=")
    if name == "--coverage" and not eq:
        options["coverage"] = True
    elif name == "--mutate" and not eq:
        options["mutate"] = True
    elif name == "--changed" and eq:
        if not _REV_RE.match(value):
            raise SpecError(
                f"{token!r}: REV must be a git revision (letters, digits, . _ / ~ ^ -); e.g. --changed=origin/main"
            )
        options["coverage"], options["changed"] = True, value
    else:
        raise SpecError(
            f"{token!r}: not an option of /rerun-test; it takes {', '.join(OPTIONS)} before or after the tests"
        )


def parse_command(body: str) -> tuple[list[Spec], dict]:
    """Parse a PR comment body into its specs and its options (see :data:`OPTIONS`).

    Raises:
        SpecError: as :func:`parse_comment`, or an option it does not know.
    """
    options: dict = {}
    specs = _parse_comment(body, options)
    return specs, options


def parse_comment(body: str) -> list[Spec]:
    """The specs of a PR comment (its options are checked and left out: :func:`parse_command`)."""
    return _parse_comment(body, {})


def _parse_comment(body: str, options: dict) -> list[Spec]:
    """Parse a PR comment body: the first non-empty line is ``/rerun-test SPEC…``, the rest ignored.

    Args:
        body: the whole comment text.

    Returns:
        The specs on the command line (at least one).

    Raises:
        SpecError: the first line is not a ``/rerun-test`` command, names no test, or a token is refused.
    """
    lines = [ln for ln in body.replace("\r\n", "\n").replace("\r", "\n").split("\n") if ln.strip()]
    if not lines:
        raise SpecError("empty comment; write /rerun-test followed by test files")
    first = lines[0].strip()
    command, *rest_list = first.split(None, 1)
    rest = rest_list[0] if rest_list else ""
    if command != COMMAND:
        raise SpecError(
            f"the first line must start with '{COMMAND} ' (got {first[:40]!r}); write /rerun-test test_x.py"
        )
    # Tabs and other separators count as spaces; everything else goes through parse_spec.
    tokens = []
    if len(rest) > MAX_SPECS * (MAX_SPEC_LEN + 1):
        raise SpecError(f"the /rerun-test line is {len(rest)} characters long; name at most {MAX_SPECS} tests")
    for t in rest.split():
        if t.startswith("--"):
            parse_option(t, options)
        else:
            tokens.append(t)
    if not tokens:
        raise SpecError("the comment names no tests; write /rerun-test test_x.py [more …]")
    return _capped(list(dict.fromkeys(parse_spec(t) for t in tokens)))
