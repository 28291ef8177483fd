"""What the harness knows of each sglang release before it imports one: the static half of the adapter's
version differences (the capability probes and shims, which import sglang, are :mod:`.compat`).

Read while a target is resolved, so nothing here imports sglang: :func:`release_refused`,
:func:`core_missing`, :data:`RELEASE_DEPS`, :func:`process_env`. Detail: docs/modules.md.
"""

from __future__ import annotations

import re
from pathlib import Path

#: The supported releases, as shown in messages.
SUPPORTED_RANGE = "0.5.16 … 0.5.23"

#: The oldest release the adapter drives. Every release from 0.5.15 floors the SWA window start to a
#: page exactly as 0.5.23 does (``_swa_tail_len``) and ships ``runtime_context``; what 0.5.19 added are
#: the two evict-floor asserts (sglang#35286 / #35396), which the harness's oracle does not lean on
#: (the ledger's ``evicted-unaligned`` rule is its own), so 0.5.16 … 0.5.18 are driven, with what
#: differs probed in :mod:`.compat` (their request KV state: :func:`compat.req_kv`). 0.5.15 is not:
#: its decode prealloc is written out inside ``DecodePreallocQueue._pre_alloc``, with no module-level
#: ``alloc_for_decode_prealloc`` for the adapter to hand a caller-chosen SWA tail (``alloc_with_tail``)
#: without copying sglang's code, and its runtime context cannot override server arguments
#: (``override_server_args`` came in 0.5.16), which is how the adapter publishes a decode worker's settings.
OLDEST_RELEASE = (0, 5, 16)

#: Why a release older than :data:`OLDEST_RELEASE` is refused, in one line.
_TOO_OLD = (
    "its PD decode prealloc is inline in DecodePreallocQueue._pre_alloc (no module-level "
    "alloc_for_decode_prealloc, first in 0.5.16)"
)

#: The newest release checked against; newer ones are tried (capabilities decide what runs).
NEWEST_CHECKED = (0, 5, 23)

#: sglang 0.5.16 … 0.5.19 (0.5.15 too) register their own ``qwen3_asr`` config, which transformers >= 5.13 also
#: defines ("'qwen3_asr' is already used by a Transformers config" at import); their own pin 5.12.1
#: needs huggingface_hub 1.x (httpx-based) and tokenizers <= 0.23.0. 0.5.20 renamed the config.
_TRANSFORMERS_5_12 = (
    "transformers==5.12.1",
    "huggingface_hub==1.33.0",
    "httpx==0.28.1",
    "httpcore==1.0.9",
    "h11==0.16.0",
    "tokenizers==0.22.2",
)

#: Module-level dependency pins a release needs where the venv's (sglang 0.5.23's set) differ,
#: found by importing each release on the venv. Installed with the release into its cache.
RELEASE_DEPS: dict[str, tuple[str, ...]] = {
    release: _TRANSFORMERS_5_12 for release in ("0.5.16", "0.5.17", "0.5.18", "0.5.19")
}


# (file under sglang/srt, source pattern, what it is) the adapter cannot run without.
_CORE: tuple[tuple[str, str, str], ...] = (
    ("disaggregation/decode.py", r"^class DecodePreallocQueue\b", "PD decode DecodePreallocQueue"),
    ("disaggregation/decode.py", r"^\s+def _swa_tail_len\(", "DecodePreallocQueue._swa_tail_len"),
    ("disaggregation/decode.py", r"^def alloc_for_decode_prealloc\(", "alloc_for_decode_prealloc"),
    ("mem_cache/allocator/swa.py", r"^class SWATokenToKVPoolAllocator\b", "SWATokenToKVPoolAllocator"),
    ("runtime_context.py", r"^def get_context\(", "runtime_context.get_context"),
    ("runtime_context.py", r"^\s+def override_server_args\(", "RuntimeContext.override_server_args"),
)


def core_missing(root: Path) -> str | None:
    """What of the adapter's core the tree at ``root`` lacks (reads source; imports nothing).

    Args:
        root: the directory holding ``sglang/``.

    Returns:
        A short description of the first missing piece, or None when the core is there.
    """
    srt = Path(root) / "sglang" / "srt"
    texts: dict[str, str | None] = {}
    for rel, pattern, what in _CORE:
        if rel not in texts:
            path = srt / rel
            texts[rel] = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None
        text = texts[rel]
        if text is None:
            return f"no sglang/srt/{rel}"
        if not re.search(pattern, text, re.MULTILINE):
            return f"no {what} in sglang/srt/{rel}"
    return None


def release_refused(version: str) -> str | None:
    """Why a release cannot be a target (before anything is downloaded), or None.

    Args:
        version: a release like ``0.5.21``.

    Returns:
        One line, or None when the release is in (or above) the supported range.
    """
    found = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    if found and tuple(int(p) for p in found.groups()) < OLDEST_RELEASE:
        return f"sglang {version} is older than the supported range {SUPPORTED_RANGE}: {_TOO_OLD}; pass 0.5.16 or newer"
    return None


def release_deps(version: str) -> tuple[str, ...]:
    """The pinned module-level dependencies to install next to a release (see :data:`RELEASE_DEPS`).

    Args:
        version: the release.

    Returns:
        pip requirement strings (empty when the venv's serve).
    """
    return RELEASE_DEPS.get(version, ())


def server_option(root: Path, dest: str) -> bool:
    """Whether the target at ``root`` has a server option: its ``ServerArgs`` field, declared in
    ``srt/server_args.py`` (up to 0.5.22) or ``srt/arg_groups/fields/*.py`` (0.5.23); imports nothing.
    E.g. ``disaggregation_decode_retraction_backup`` (``--disaggregation-decode-retraction-backup``)
    is first in 0.5.18.

    Args:
        root: the directory holding ``sglang/``.
        dest: the option's field name.
    """
    field = re.compile(rf"^\s+{re.escape(dest)}\s*:", re.MULTILINE)
    fields = Path(root) / "sglang" / "srt" / "arg_groups" / "fields"
    texts = [
        source_text(root, "server_args.py"),
        *(p.read_text(encoding="utf-8", errors="replace") for p in sorted(fields.glob("*.py"))),
    ]
    return any(field.search(text) for text in texts)


def source_text(root: Path, rel: str) -> str:
    path = root / "sglang" / "srt" / rel
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""


def process_env(root: Path, *, gpu_driver: bool | None = None) -> dict[str, str]:
    """Environment a process needs, set before it imports the target at ``root`` (read from its source).

    ``TRITON_INTERPRET=1`` for releases whose paged allocator runs only Triton kernels (up to
    0.5.21; see :func:`device_missing`) on a machine with no GPU driver: Triton decorates sglang's
    kernels at import time, and in interpreter mode runs the real kernels on CPU tensors, so the
    suites drive sglang's own allocation code there. Never set where a GPU driver is present.
    Remove with 0.5.21.

    Args:
        root: the target's root.
        gpu_driver: whether this machine has an NVIDIA driver (default: ``/dev/nvidiactl`` exists).

    Returns:
        Variables to set (empty when none is needed).
    """
    if gpu_driver is None:
        gpu_driver = Path("/dev/nvidiactl").exists()
    if gpu_driver or "use_triton_kernels" in source_text(root, "mem_cache/allocator/paged.py"):
        return {}
    return {"TRITON_INTERPRET": "1"}
