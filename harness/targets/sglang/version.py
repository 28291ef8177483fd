"""The supported sglang version, checked from package metadata before any sglang import."""

from __future__ import annotations

import importlib.metadata

#: The one sglang release the adapter drives; its private paths change between releases.
SUPPORTED_VERSION = "0.5.23"


class SglangVersionError(ImportError):
    """The installed sglang is missing or is not the supported version."""


def installed_version() -> str | None:
    """The installed sglang version from package metadata (imports nothing from sglang).

    Returns:
        The version string, or None when no sglang distribution is installed.
    """
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version(installed: str | None = None) -> str:
    """Refuse any sglang but the supported one.

    Args:
        installed: the version to check; read from package metadata when None.

    Returns:
        The installed version (equal to :data:`SUPPORTED_VERSION`).

    Raises:
        SglangVersionError: one line naming the installed and the supported versions and the fix.
    """
    found = installed if installed is not None else installed_version()
    if found != SUPPORTED_VERSION:
        shown = "no sglang" if found is None else f"sglang {found}"
        raise SglangVersionError(
            f"{shown} is installed but harness.targets.sglang supports only sglang {SUPPORTED_VERSION}; "
            f"install it with ./dev install (requirements/sglang-cpu.txt pins sglang=={SUPPORTED_VERSION})"
        )
    return found
