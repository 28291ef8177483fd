"""Token ids and content seeds of a request: prompts of one prefix group share ids (and so KV),
outputs are the request's own."""

from __future__ import annotations

import zlib
from array import array

from harness.engines.sim.kvfill import seed_of


def prompt_ids(group: str, n: int) -> array:
    """Prompt token ids of a prefix group: the same group gives the same prefix (radix cache hits)."""
    base = zlib.crc32(group.encode()) % 40_000
    return array("q", ((base + 7 * i) % 50_000 for i in range(n)))


def seeds(group: str, rid: str, shard: int) -> tuple[int, int]:
    """``(prompt_seed, output_seed)``: prompt KV depends on the group, output KV on the request."""
    return seed_of(f"prompt:{group}", shard), seed_of(f"out:{rid}", shard)
