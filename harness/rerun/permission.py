"""Who may trigger a rerun from a PR comment.

Rule: a commenter with write, maintain or admin access may; the PR's author may on a PR from a
branch of the repository itself. A PR from a fork runs its code on our runners, so there even the
author needs write access.
"""

from __future__ import annotations

from dataclasses import dataclass

WRITE_LEVELS = frozenset({"write", "maintain", "admin"})


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str


def may_rerun(commenter: str, pr_author: str, permission: str, is_fork: bool) -> Decision:
    """Decide whether ``commenter`` may rerun tests on the PR.

    Args:
        commenter: login of the comment's author.
        pr_author: login of the PR's author.
        permission: the commenter's repository permission (``admin``, ``maintain``, ``write``,
            ``triage``, ``read``, ``none``), as GitHub's collaborator-permission API reports it.
        is_fork: the PR's head lives in another repository.

    Returns:
        The :class:`Decision` with a one-line reason.
    """
    level = (permission or "none").lower()
    if level in WRITE_LEVELS:
        return Decision(True, f"@{commenter} has {level} access")
    if commenter.lower() == pr_author.lower() and not is_fork:
        return Decision(True, f"@{commenter} is the PR author (branch in this repository)")
    if commenter.lower() == pr_author.lower():
        return Decision(
            False,
            f"@{commenter} is the author of a fork PR without write access; ask a maintainer to comment /rerun-test",
        )
    return Decision(False, f"@{commenter} has {level} access and is not the PR author; ask the author or a maintainer")
