"""Waiting on many probe calls at once, with one deadline: each answers, raises, or hangs
(:class:`Outcome`), so a stuck node is a ``hung`` row, never a stuck doctor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable


@dataclass(frozen=True)
class Outcome:
    """One probe call's answer: ``value``, or ``error`` (it raised / the actor died), or ``hung``."""

    value: Any = None
    error: str | None = None
    hung: bool = False

    @property
    def ok(self) -> bool:
        return not self.hung and self.error is None


def gather(calls: dict[Hashable, Any], timeout_s: float) -> dict[Hashable, Outcome]:
    """Wait for all ``calls`` (key -> ObjectRef) together, at most ``timeout_s`` seconds.

    Args:
        calls: the outstanding calls.
        timeout_s: one deadline for all of them.

    Returns:
        key -> :class:`Outcome`; calls still running at the deadline are ``hung``.
    """
    import ray

    if not calls:
        return {}
    refs = list(calls.values())
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    out: dict[Hashable, Outcome] = {}
    for key, ref in calls.items():
        if ref not in done:
            out[key] = Outcome(hung=True)
            continue
        try:
            out[key] = Outcome(value=ray.get(ref, timeout=5.0))
        except ray.exceptions.RayActorError as e:
            out[key] = Outcome(error=f"probe actor died: {_first_line(e)}")
        except ray.exceptions.RayTaskError as e:
            out[key] = Outcome(error=_first_line(e.cause if getattr(e, "cause", None) else e))
        except ray.exceptions.GetTimeoutError:
            out[key] = Outcome(hung=True)
    return out


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
