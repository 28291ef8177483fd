"""The bot's status comment: one markdown line per runner group, edited in place.

Each group line ends with a hidden marker ``<!-- rerun-test:group=NAME -->``; an update replaces the
line carrying its group's marker (or appends it), so applying the same update twice changes
nothing and concurrent jobs each touch only their own line. The comment starts with a header line
carrying ``<!-- rerun-test:status -->`` so the bot can find its own comment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from harness import atomic
from harness.report.results import MESSAGE_CHARS, GroupResult

STATUS_MARKER = "<!-- rerun-test:status -->"
LINK_PLACEHOLDER = "{run_url}"
ICONS = {"queued": "⏳", "running": "🔄", "passed": "✅", "failed": "❌"}
MAX_FAILURES_SHOWN = 10
#: Name prefix of the artifact each group's CI job uploads (``ci/workflows/rerun-test.yml``).
ARTIFACT_PREFIX = "rerun-"


def group_marker(name: str) -> str:
    """The hidden marker of one group's line."""
    return f"<!-- rerun-test:group={name} -->"


@dataclass(frozen=True)
class GroupStatus:
    """What one group's line shows.

    Attributes:
        name: group name (``cpu``, ``8-gpu-h200-1of2``).
        runner: runner label.
        state: ``queued`` | ``running`` | ``passed`` | ``failed``.
        passed, failed, skipped, xfailed: counts so far (``xfailed``: expected failures).
        link: URL of the job's logs (``{run_url}`` placeholder until known).
        failures: (node id, one-line reason) of failing tests.
        note: one line about the group itself (crash, not runnable here).
        report: where the group's HTML report is, inside the job's artifacts (``""``: none yet).
        more_failures: failing tests beyond ``failures`` (a line read back shows only the first few).
    """

    name: str
    runner: str
    state: str = "queued"
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    xfailed: int = 0
    link: str = LINK_PLACEHOLDER
    failures: tuple[tuple[str, str], ...] = ()
    note: str = ""
    report: str = ""
    more_failures: int = 0

    def __post_init__(self) -> None:
        if self.state not in ICONS:
            raise ValueError(f"unknown state {self.state!r}; use one of {', '.join(ICONS)}")


def report_path(group: str) -> str:
    """Where a group's HTML report is in the run's artifacts: ``<artifact>/report/index.html``.

    The artifact is the one ``ci/workflows/rerun-test.yml`` uploads per group (``rerun-<group>``,
    holding the group's run directory).
    """
    return f"{ARTIFACT_PREFIX}{group}/report/index.html"


def from_result(result: GroupResult, link: str = LINK_PLACEHOLDER) -> GroupStatus:
    """The final status line of a finished group (linking its HTML report in the run's artifacts)."""
    return GroupStatus(
        name=result.name,
        runner=result.runner,
        state="passed" if result.ok else "failed",
        passed=result.count("passed"),
        failed=result.count("failed") + result.count("error"),
        skipped=result.count("skipped"),
        xfailed=result.count("xfailed"),
        link=link,
        failures=tuple((c.nodeid, c.message or c.outcome) for c in result.failures),
        note=result.note,
        report=report_path(result.name),
    )


def _clean(text: str) -> str:
    """One safe markdown line: no newlines, no HTML comments (they would fake a marker), no pipes."""
    text = " ".join(text.split())
    text = text.replace("<!--", "<!−−").replace("-->", "−−>").replace("`", "'")
    return text[:MESSAGE_CHARS]


def render_line(s: GroupStatus) -> str:
    """One group's line, marker last.

    Example: ``- ❌ **cpu** (`ubuntu-latest`): 3 passed, 1 failed, 0 skipped · [logs](URL) · failing:
    `suites/a.py::test_x` — AssertionError: … <!-- rerun-test:group=cpu -->``
    """
    parts = [f"- {ICONS[s.state]} **{_clean(s.name)}** (`{_clean(s.runner)}`): {s.state}"]
    if s.state != "queued":
        parts[0] += f" — {s.passed} passed, {s.failed} failed, {s.skipped} skipped"
        if s.xfailed:
            parts[0] += f", {s.xfailed} xfailed"
    parts.append(f"[logs]({_clean(s.link)})")
    if s.report:
        # GitHub links a run's artifacts, not a file inside one: the link goes to the list, the path says where.
        parts.append(f"[report]({_clean(s.link)}#artifacts) `{_clean(s.report)}`")
    if s.note:
        parts.append(_clean(s.note))
    if s.failures:
        shown = [f"`{_clean(nid)}` — {_clean(why)}" for nid, why in s.failures[:MAX_FAILURES_SHOWN]]
        more = max(0, len(s.failures) - MAX_FAILURES_SHOWN) + s.more_failures
        parts.append("failing: " + "; ".join(shown) + (f"; and {more} more" if more > 0 else ""))
    return " · ".join(parts) + " " + group_marker(s.name)


def note_line(name: str, text: str) -> str:
    """A line of the comment that is no group's status (e.g. ``changed-lines``: what the run executed of
    the PR's changed lines), kept in place by :func:`apply_lines` like a group's.

    >>> note_line("changed-lines", "changed lines executed: 7 of 9 (vs main)")
    '- 📏 changed lines executed: 7 of 9 (vs main) <!-- rerun-test:group=changed-lines -->'
    """
    return f"- 📏 {_clean(text)} {group_marker(name)}"


def write_note(path: Path, name: str, text: str) -> None:
    """Put the note line ``name`` (:func:`note_line`) into the comment file at ``path`` (created when missing)."""
    body = path.read_text(encoding="utf-8") if path.exists() else ""
    atomic.write_text(path, apply_lines(body, {name: note_line(name, text)}))


def header(title: str = "rerun-test") -> str:
    return f"### {title} {STATUS_MARKER}"


def apply(body: str, statuses: list[GroupStatus], title: str = "rerun-test") -> str:
    """Apply status updates to a comment body.

    Args:
        body: the current comment (``""`` for a new one).
        statuses: the groups to (re)write; other groups' lines are kept as they are.
        title: header text for a new comment.

    Returns:
        The new body. ``apply(apply(b, s), s) == apply(b, s)``.
    """
    return apply_lines(body, {s.name: render_line(s) for s in statuses}, title)


def apply_lines(body: str, lines_by_group: dict[str, str], title: str = "rerun-test") -> str:
    """Like :func:`apply` with already rendered lines (e.g. read back from a ``--comment-out`` file).

    Raises:
        ValueError: a line does not end with its group's marker.
    """
    lines = body.splitlines() if body.strip() else []
    if not any(STATUS_MARKER in ln for ln in lines):
        lines = [header(title), ""] + lines
    for name, new in lines_by_group.items():
        marker = group_marker(name)
        if not new.endswith(marker) or "\n" in new:
            raise ValueError(f"line for group {name!r} must be one line ending with {marker}")
        idx = [i for i, ln in enumerate(lines) if ln.endswith(marker)]
        if idx:
            lines[idx[0]] = new
            for extra in reversed(idx[1:]):  # a duplicated line (a lost race) collapses into one
                del lines[extra]
        else:
            last = max((i for i, ln in enumerate(lines) if _GROUP_RE.search(ln)), default=None)
            if last is None:
                lines.append(new)
            else:
                lines.insert(last + 1, new)
    return "\n".join(lines) + "\n"


_GROUP_RE = re.compile(r"<!-- rerun-test:group=(.*?) -->$")
_STATE_RE = re.compile(r"^- \S+ \*\*.*?\*\* \(`.*?`\): (" + "|".join(ICONS) + r")\b")


def state_of(line: str) -> str:
    """The state a rendered group line shows (``""`` for no line or a foreign one)."""
    m = _STATE_RE.match(line)
    return m.group(1) if m else ""


def parse(body: str) -> dict[str, str]:
    """Group name → its current line, read back from a comment body."""
    out = {}
    for ln in body.splitlines():
        m = _GROUP_RE.search(ln)
        if m:
            out[m.group(1)] = ln
    return out


# ---------------------------------------------------------------- lines from a PR's code, re-rendered

#: Markdown that could format, link, open HTML or reference an issue: backslash-escaped in text a PR's run wrote.
_MD_SPECIAL = re.compile(r"([\\*_\[\]()<>#|~])")
#: Note lines (not groups) a run job may hand out: the changed-lines coverage and the mutation phase.
NOTE_LINES = ("changed-lines", "mutation")
MAX_COUNT = 10_000_000
_HEAD_RE = re.compile(
    r"^- \S+ \*\*(?P<name>[^*]*)\*\* \(`[^`]*`\): (?P<state>" + "|".join(ICONS) + r")"
    r"(?: — (?P<p>\d{1,8}) passed, (?P<f>\d{1,8}) failed, (?P<s>\d{1,8}) skipped"
    r"(?:, (?P<x>\d{1,8}) xfailed)?)?(?= · | <!--)"
)
_FAILURE_RE = re.compile(r"^`(?P<nid>[^`]*)` — (?P<why>.*)$")
_MORE_RE = re.compile(r"^and (\d{1,8}) more$")
_NOTE_RE = re.compile(r"^- 📏 (?P<text>.*) <!-- rerun-test:group=[^>]* -->$")


def escape(text: str) -> str:
    """Text from a PR's run as inert markdown: one line (:func:`_clean`), every markdown punctuation that
    could format, link, embed or open HTML backslash-escaped, and a word joiner after each ``@`` (no mention)."""
    text = _clean(text)
    return _MD_SPECIAL.sub(r"\\\1", text).replace("@", "@\u2060")


def parse_line(name: str, line: str) -> GroupStatus | None:
    """The fields of a group line a run job wrote (:func:`render_line`'s format), strictly: the state and
    counts, the failing tests and one note. Anything else (its link, its runner, its report path, unknown
    parts) is dropped. None when the line is not a group line of ``name``.
    """
    if not line.endswith(" " + group_marker(name)):
        return None
    m = _HEAD_RE.match(line)
    if not m or m.group("name") != name:
        return None
    body = line[m.end() : -len(group_marker(name)) - 1]
    counts = {k: min(int(m.group(k) or 0), MAX_COUNT) for k in ("p", "f", "s", "x")}
    failures: list[tuple[str, str]] = []
    more, note = 0, ""
    for part in body.split(" · ")[1:]:
        if part.startswith("[logs](") or part.startswith("[report]("):
            continue  # the link and the report path are the trusted side's to write
        if part.startswith("failing: "):
            for item in part[len("failing: ") :].split("; "):
                if (f := _FAILURE_RE.match(item)) and len(failures) < MAX_FAILURES_SHOWN:
                    failures.append((f.group("nid"), f.group("why")))
                elif mm := _MORE_RE.match(item):
                    more = min(int(mm.group(1)), MAX_COUNT)
        elif not note:
            note = part
    return GroupStatus(
        name=name,
        runner="",
        state=m.group("state"),
        passed=counts["p"],
        failed=counts["f"],
        skipped=counts["s"],
        xfailed=counts["x"],
        failures=tuple(failures),
        note=note,
        more_failures=more,
    )


def rerender(name: str, line: str, runner: str, link: str) -> str | None:
    """A group line a run job wrote, rebuilt from its parsed fields (:func:`parse_line`) with the matrix's
    runner label, the trusted logs link and the group's report path; its free text escaped (:func:`escape`).
    A note line (:data:`NOTE_LINES`) keeps only its escaped text. None when nothing parses."""
    if name in NOTE_LINES:
        m = _NOTE_RE.match(line) if line.endswith(" " + group_marker(name)) else None
        return note_line(name, escape(m.group("text"))) if m else None
    s = parse_line(name, line)
    if s is None:
        return None
    final = s.state in ("passed", "failed")
    return render_line(
        GroupStatus(
            name=name,
            runner=runner,
            state=s.state,
            passed=s.passed,
            failed=s.failed,
            skipped=s.skipped,
            xfailed=s.xfailed,
            link=link,
            note=escape(s.note),
            report=report_path(name) if final else "",
            failures=tuple((_clean(nid), escape(why)) for nid, why in s.failures),
            more_failures=s.more_failures,
        )
    )
