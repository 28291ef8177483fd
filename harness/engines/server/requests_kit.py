"""What a real-server suite sends and reads back: deterministic prompts of token ids, unique request ids,
a client's answer from a future, and the finish reason of an answer. One place for what each real-server
suite had written again.
"""

from __future__ import annotations

import concurrent.futures
import random
import uuid
from typing import Any

from harness.engines.server.http_client import ServerHTTPError

#: The tiny local models' token ids a prompt draws from: no special tokens.
TINY_VOCAB = (4, 512)


def prompt_ids(n: int, seed: int, *, salt: int = 7919, vocab: tuple[int, int] = TINY_VOCAB) -> list[int]:
    """``n`` deterministic token ids for ``seed`` (``salt`` mixes seed and length: a suite keeps the one
    its expectations were written with).

    >>> prompt_ids(3, 1) == prompt_ids(3, 1) != prompt_ids(3, 2)
    True
    """
    rng = random.Random(seed * salt + n)
    return [rng.randrange(*vocab) for _ in range(n)]


def new_rid(what: str) -> str:
    """A request id of its own: ``harness-WHAT-<10 hex>`` (none is a prefix of another: sglang aborts by
    prefix while a request is live)."""
    return f"harness-{what}-{uuid.uuid4().hex[:10]}"


def answer_of(future: concurrent.futures.Future, timeout_s: float) -> Any:
    """A client's answer from its future: the Generation, or the :class:`ServerHTTPError` it raised
    (a failed request's answer is evidence, not an error of the test)."""
    try:
        return future.result(timeout=timeout_s)
    except ServerHTTPError as e:
        return e


def finish_reason(answer: Any) -> str:
    """An answer's finish reason (``length``, ``abort`` ...), or ``error: ...`` for an HTTP error."""
    if isinstance(answer, Exception):
        return f"error: {answer}"
    return str((answer.meta.get("finish_reason") or {}).get("type", ""))


def aborted(answer: Any) -> bool:
    """An answer that says its request was aborted: an abort finish reason, or an error naming the abort."""
    if isinstance(answer, Exception):
        return "abort" in str(answer).lower()
    return finish_reason(answer) == "abort"
