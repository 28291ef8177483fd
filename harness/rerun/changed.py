"""``rerun-test --coverage [--changed BASE]``: what the run executed of the target's ``sglang/`` lines.

``BASE`` is a git revision for a source tree in a checkout, else another TARGET; it is read before any
group starts. The groups' measurement is combined (:mod:`harness.changes.measure`) and joined with the
change (:mod:`harness.changes.report`). Detail: docs/modules.md.
"""

from __future__ import annotations

from pathlib import Path

from harness.changes import lines as change_lines
from harness.changes.lines import Change, ChangeError
from harness.changes.measure import Combined, Measurement
from harness.changes.report import ChangedCoverage, changed_coverage
from harness.targets.sglang import resolve as target_resolve
from harness.targets.sglang.resolve import Target


def read_change(target: Target, base: str) -> Change:
    """The changed lines of ``target`` against ``base`` (see the module docstring).

    Raises:
        ChangeError: ``base`` is neither a revision of the target's checkout nor a usable TARGET.
    """
    root = Path(target.root)
    if target.origin == "tree" and target.commit is not None:  # resolved inside a git checkout
        return change_lines.from_git(root, base)
    try:
        other = target_resolve.resolve(base)
    except target_resolve.TargetError as exc:
        raise ChangeError(f"--changed {base}: {exc}") from None
    if Path(other.root).resolve() == root.resolve():
        raise ChangeError(
            f"--changed {base}: that is the target itself ({target.label()}); pass the release or tree "
            "it is to be compared with"
        )
    return change_lines.between_trees(root, Path(other.root), other.label())


def measurement(run_dir: Path, target: Target) -> Measurement:
    """The run's measurement, under ``<run_dir>/coverage``."""
    return Measurement(run_dir / "coverage", Path(target.root))


def summarize(measure: Measurement, change: Change | None) -> tuple[Combined, ChangedCoverage | None]:
    """Combine the run's data; join it with ``change`` when there is one."""
    combined = measure.combine()
    if change is None:
        return combined, None
    return combined, changed_coverage(change, combined, measure.root, measure.statements)


def overall_line(combined: Combined) -> str:
    """Without ``--changed``: ``sglang lines executed: 4,210 in 96 files (… processes, … not measured)``."""
    ran = sum(len(v) for v in combined.lines.values())
    lost = f", {len(combined.unmeasured)} not measured" if combined.unmeasured else ""
    return (
        f"sglang lines executed: {ran:,} in {len(combined.lines)} files "
        f"({len(combined.processes)} processes measured{lost})"
    )
