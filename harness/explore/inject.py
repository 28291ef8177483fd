"""Apply catalog faults to this process before it imports sglang: a runtime wrapper in place, a source patch
as a scratch copy of the target's sglang put first on the import path (what ``--inject-fault`` does for a
pytest session, :mod:`harness.plugins.faults`)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from harness import faults
from harness.faults import source
from harness.targets.sglang import selection as target_mod


def apply(names: list[str]) -> Path | None:
    """Apply ``names`` (and the faults they require) to this process.

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
                children=False,
            )
        except source.PatchError as e:
            raise faults.FaultError(f"{e}; the patch does not apply to this sglang") from None
    os.environ[faults.ENV_VAR] = ",".join(names)
    faults.activate(names)
    return scratch


def undo(scratch: Path | None) -> None:
    """Undo the runtime faults and remove the scratch copy (the imported modules stay as they are)."""
    faults.deactivate()
    if scratch is not None:
        if str(scratch) in sys.path:
            sys.path.remove(str(scratch))
        shutil.rmtree(scratch, ignore_errors=True)
