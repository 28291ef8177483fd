"""Apply catalog faults to this process before it imports sglang: a runtime wrapper in place, a source patch
as a scratch copy of the target's sglang put first on the import path (what ``--inject-fault`` does for a
pytest session, :mod:`harness.plugins.faults`)."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

from harness import faults
from harness.faults import runtime, source
from harness.targets.sglang import selection as target_mod


def apply(names: list[str], *, children: bool = False) -> Path | None:
    """Apply ``names`` (and the faults they require) to this process (and, with ``children``, to the
    processes it starts: real servers).

    Returns:
        The scratch copy holding the patched sglang (None: runtime faults only); :func:`undo` removes it.

    Raises:
        FaultError: an unknown name, sglang already imported while a patch is asked for, or a patch that
            does not apply to the target.
    """
    names = faults.parse_names(",".join(names))
    patches = [n for n in names if faults.get(n).is_patch]
    scratch = None
    if patches:
        if "sglang" in sys.modules:
            raise faults.FaultError(
                f"{', '.join(patches)}: sglang is already imported, a patched copy cannot take its place"
            )
        try:
            scratch = source.put_patched_copy_first(
                patches,
                target_mod.sglang_root().resolve(),
                prefix="harness-explore-fault-",
                overlay_env=target_mod.OVERLAY_ENV,
                children=children,
            )
        except source.PatchError as e:
            raise faults.FaultError(f"{e}; the patch does not apply to this sglang") from None
    _env_before.append(os.environ.get(faults.ENV_VAR))
    os.environ[faults.ENV_VAR] = ",".join(names)
    faults.activate(names)
    return scratch


_env_before: list[str | None] = []  # the fault variable before each apply, restored by undo


def undo(scratch: Path | None) -> None:
    """Undo the runtime faults, restore the fault variable and remove the scratch copy (the imported modules
    stay as they are)."""
    faults.deactivate()
    if _env_before:
        before = _env_before.pop()
        if before is None:
            os.environ.pop(faults.ENV_VAR, None)
        else:
            os.environ[faults.ENV_VAR] = before
    if scratch is not None:
        if str(scratch) in sys.path:
            sys.path.remove(str(scratch))
        shutil.rmtree(scratch, ignore_errors=True)


def rearm() -> None:
    """Put the active runtime faults in place afresh before a schedule, so each starts with the fault's
    state new: a wrapper that fires once (corrupt-kv-page flips the first page it packs) fires once per
    schedule, and shrinking and a replay see what the first run saw (not a flaky failure)."""
    names = faults.active()
    if not names:
        return
    log = logging.getLogger(runtime.__name__)
    level = log.level
    log.setLevel(logging.ERROR)  # not two warnings per schedule
    try:
        faults.deactivate(names)
        faults.activate(names)
    finally:
        log.setLevel(level)
