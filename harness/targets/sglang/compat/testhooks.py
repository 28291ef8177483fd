"""sglang's own test hooks (env vars its PD code reads to break itself on purpose), by capability: which
variable the target reads for each, where, and the log line that shows it fired; or why it has none.

Read from the target's source (imports nothing). The facts, per release checked (0.5.18, 0.5.21, 0.5.22,
0.5.23): docs/sglang-targets.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from harness.targets.sglang import selection
from harness.targets.sglang.releases import source_text


@dataclass(frozen=True)
class Hook:
    """One of sglang's test hooks as one release spells it.

    Attributes:
        env: the variable sglang reads.
        reads: the module (under ``sglang/srt/``) that reads it, where its presence is probed.
        fired: a regex of the log line sglang writes when the hook took effect (``{rid}``: the request's id).
        note: the release or PR that brought it, and what it needs to act.
    """

    env: str
    reads: str
    fired: str
    note: str


#: Capability -> the spellings releases have had, newest first. A capability no release checked has
#: is listed with the upstream change that brings it, so :func:`hook_missing` can say where it lives.
HOOKS: dict[str, tuple[Hook, ...]] = {
    # A poll answered Failed at random, on either side (disaggregation/utils._poll_with_failure_injection,
    # every release checked). The side that fails the request says so in the request's error answer; its
    # log has the line only at debug level: the receiver itself saw no failure, so sglang calls the failure
    # "from another rank" ("Failed due to an unknown reason from another rank") and mutes it.
    "transfer-failure": (
        Hook(
            "SGLANG_TEST_DISAGG_FAILURE_PROB",
            "disaggregation/utils.py",
            r"(Decode|Prefill) transfer failed for request .*{rid}.*unknown reason from another rank",
            "every release checked (0.5.18 on); also fails warm-up and /health probes, which poll the same way",
        ),
    ),
    # A retraction every SGLANG_TEST_RETRACT_INTERVAL forwards (managers/scheduler.update_running_batch,
    # every release checked); read once, at the scheduler module's import. A batch of one is never retracted.
    "forced-retraction": (
        Hook(
            "SGLANG_TEST_RETRACT",
            "managers/scheduler.py",
            r"Testing retraction\. #retracted_reqs: [1-9]",
            "every release checked (0.5.18 on); read at import; needs two or more requests decoding",
        ),
    ),
    # A landed KV row corrupted before decode verifies it. Upstream main (after 0.5.23):
    # SGLANG_TEST_DISAGG_KV_CORRUPT_PROB (checksum.corrupt_one_kv_row_for_test). 0.5.23 has only the
    # digest flip SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB (the KV is not touched), and both act only
    # with --disaggregation-enable-kv-checksum, whose digest is a CUDA kernel (adler32_strided_checksum).
    "landed-kv-corruption": (
        Hook(
            "SGLANG_TEST_DISAGG_KV_CORRUPT_PROB",
            "disaggregation/checksum.py",
            r"KV checksum mismatch req={rid}",
            "upstream main after 0.5.23; needs --disaggregation-enable-kv-checksum (CUDA)",
        ),
        Hook(
            "SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB",
            "disaggregation/decode.py",
            r"KV checksum mismatch req={rid}",
            "0.5.23: flips the computed digest, not the KV; needs --disaggregation-enable-kv-checksum (CUDA)",
        ),
    ),
    # Decode's metadata corrupted while it is read (an upstream PR's e2e test; in no release checked).
    "metadata-corruption": (
        Hook(
            "SGLANG_PD_TEST_INJECT_METADATA_CORRUPTION",
            "disaggregation/decode.py",
            r"metadata",
            "in no release checked (an upstream PR test sets it with a restore delay, ..._RESTORE_DELAY_MS)",
        ),
    ),
}


def _root(root: Path | None) -> Path:
    return root if root is not None else selection.sglang_root()


def hook_of(capability: str, root: Path | None = None) -> Hook | None:
    """The hook the target at ``root`` (default: the selected one) has for ``capability``; None if none.

    Raises:
        KeyError: an unknown capability.
    """
    for hook in HOOKS[capability]:
        if hook.env in source_text(_root(root), hook.reads):
            return hook
    return None


def hook_missing(capability: str, root: Path | None = None) -> str | None:
    """None when the target has a hook for ``capability``, else one line saying so and where one lives."""
    if hook_of(capability, root) is not None:
        return None
    known = "; ".join(f"{h.env} ({h.note})" for h in HOOKS[capability])
    return f"this sglang has no {capability} test hook (known: {known})"


def fired_lines(hook: Hook, text: str, rid: str = "") -> list[str]:
    """The lines of ``text`` (a server's log, a request's error answer) that show ``hook`` took effect (for
    request ``rid``, where the line names one)."""
    pattern = re.compile(hook.fired.replace("{rid}", re.escape(rid) if rid else ""))
    return [line for line in text.splitlines() if pattern.search(line)]
