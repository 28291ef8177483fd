"""Real sglang ``Req`` objects as a PD decode worker holds them after prefill handed them over."""

from __future__ import annotations

from array import array
from typing import Any

#: Token ids of received output tokens start here, so prompts (0..n) and outputs never collide.
_OUTPUT_TOKEN_BASE = 100_000


def make_req(rid: str, prompt_len: int, output_len: int = 1, *, max_new_tokens: int = 16) -> Any:
    """Build a real ``Req`` carrying the output tokens it received from prefill.

    PD decode receives the first output token from prefill, so a decode-side request normally has
    ``output_len == 1``; its prealloc fill length is then ``prompt_len + max(output_len - 1, 0)``.

    Args:
        rid: request id.
        prompt_len: prompt tokens (ids 0..prompt_len-1).
        output_len: output tokens already received.
        max_new_tokens: the request's sampling limit.

    Returns:
        The request.

    Raises:
        ValueError: a negative length.
    """
    if prompt_len < 0 or output_len < 0:
        raise ValueError(f"lengths must be >= 0, got prompt_len={prompt_len} output_len={output_len}")
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=array("q", range(prompt_len)),
        sampling_params=SamplingParams(max_new_tokens=max_new_tokens),
    )
    for i in range(output_len):
        req.output_ids.append(_OUTPUT_TOKEN_BASE + i)
    return req


def mark_finished(req: Any) -> None:
    """Mark a request finished by length, as the decode loop does before releasing it.

    Args:
        req: the request.
    """
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
