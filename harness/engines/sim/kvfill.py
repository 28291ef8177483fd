"""Deterministic KV content and page moves (pure torch; no sglang).

Every token's KV bytes are ``content(seed(rid, shard), buffer, position)``, so the decode side verifies each
byte it received or kept without seeing the prefill side. :func:`pack_pages` and :func:`unpack_pages` move
whole pages. The byte layout: docs/modules.md.
"""

from __future__ import annotations

import functools
import warnings
import zlib
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch


@dataclass(frozen=True)
class Mismatch:
    """The first byte run that differs from the expected content (``index``: its row in the input)."""

    buffer: int
    position: int
    page: int
    slot: int
    index: int = 0

    def __str__(self) -> str:
        return f"buffer {self.buffer} position {self.position} (page {self.page}, slot {self.slot})"


#: One content seed for every position, or an int64 tensor of one seed per position.
Seeds = Union[int, torch.Tensor]


def seed_of(rid: str, shard: int) -> int:
    """The content seed of one request on one TP shard (a rank→rank mix-up shows as a mismatch)."""
    return zlib.crc32(f"{rid}|{shard}".encode()) & 0x7FFFFFFF


def _token_view(view: torch.Tensor, page_size: int) -> torch.Tensor:
    pages, page_bytes = view.shape
    tb = page_bytes // page_size
    return view.as_strided((pages, page_size, tb), (page_bytes, tb, 1))


def content(seed: Seeds, buffer: int, positions: torch.Tensor, token_bytes: int) -> torch.Tensor:
    """Expected bytes of ``positions`` in one buffer: ``[len(positions), token_bytes]`` uint8 (CPU).

    Args:
        seed: one seed for every position, or an int64 tensor of one seed per position (many
            requests checked in one call).
        buffer: the buffer index.
        positions: token positions.
        token_bytes: bytes per token in the buffer.
    """
    pos = positions.to("cpu", torch.int64)
    if isinstance(seed, torch.Tensor):
        seed = seed.to("cpu", torch.int64)
    # A wrapping uint8 add of a per-row term and a per-column term (the column term shifted per
    # row by the seed): regenerated for every verification, so it is a table lookup, not arithmetic
    # over every byte.
    row = ((seed + buffer * 1_000_003 + pos * 7_919) % 251).to(torch.uint8)
    shift = (seed * 13 + buffer * 101) % 251
    table = _column_table(token_bytes)
    if isinstance(seed, torch.Tensor):
        return row[:, None] + table.index_select(0, shift)
    return row[:, None] + table[int(shift)][None, :]


@functools.lru_cache(maxsize=32)
def _column_table(token_bytes: int) -> torch.Tensor:
    """``[251, token_bytes]`` uint8: row ``s`` is ``(31 * j + s) % 251`` for byte ``j`` of a token."""
    cols = torch.arange(token_bytes, dtype=torch.int64) * 31
    return ((cols[None, :] + torch.arange(251, dtype=torch.int64)[:, None]) % 251).to(torch.uint8)


def write(
    views: list[torch.Tensor],
    page_size: int,
    buffer0: int,
    seed: Seeds,
    positions: torch.Tensor,
    pages: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write the content of ``positions`` at (page, slot) into every view; view ``i`` is buffer ``buffer0 + i``.

    ``seed`` is one seed, or one per position (several requests written in one call).
    """
    if positions.numel() == 0:
        return
    for i, v in enumerate(views):
        tv = _token_view(v, page_size)
        data = content(seed, buffer0 + i, positions, tv.shape[2]).to(v.device)
        tv[pages.to(v.device), slots.to(v.device)] = data


def verify(
    views: list[torch.Tensor],
    page_size: int,
    buffer0: int,
    seed: Seeds,
    positions: torch.Tensor,
    pages: torch.Tensor,
    slots: torch.Tensor,
) -> Mismatch | None:
    """Compare every byte of ``positions`` at (page, slot) with the expected content.

    ``seed`` is one seed, or one per position (several requests checked in one call).

    Returns:
        The first :class:`Mismatch` (in buffer, then input row order), or None when all match.
    """
    if positions.numel() == 0:
        return None
    for i, v in enumerate(views):
        tv = _token_view(v, page_size)
        got = tv[pages.to(v.device), slots.to(v.device)].cpu()
        want = content(seed, buffer0 + i, positions, tv.shape[2])
        if torch.equal(got, want):
            continue
        bad = (got != want).any(dim=1)
        if bool(bad.any()):
            j = int(bad.nonzero()[0, 0])
            return Mismatch(buffer0 + i, int(positions[j]), int(pages[j]), int(slots[j]), j)
    return None


def _runs(page_ids: list[int]) -> list[tuple[int, int, int]]:
    """Ascending runs of consecutive page ids as ``(first page, offset in the list, length)``.

    sglang's allocators hand out sorted free lists (``need_sort``), so a request's pages are mostly
    a few long runs: each run moves as one slice copy instead of a gather by index.
    """
    runs: list[tuple[int, int, int]] = []
    for i, p in enumerate(page_ids):
        if runs and p == runs[-1][0] + runs[-1][2]:
            first, off, n = runs[-1]
            runs[-1] = (first, off, n + 1)
        else:
            runs.append((p, i, 1))
    return runs


def _long_runs(runs: list[tuple[int, int, int]], n_pages: int) -> bool:
    """Whether the pages are few enough runs (≥ 4 pages each on average) to move as slice copies."""
    return len(runs) * 4 <= n_pages


def pack_pages(views: list[torch.Tensor], page_ids: list[int]) -> list[np.ndarray]:
    """Whole pages of every view for a transfer: one ``[len(page_ids), page_bytes]`` uint8 array per view.

    Pages that form one run of consecutive ids on a CPU buffer come back as a view of the buffer,
    not a copy: Ray copies the returned arrays into its object store once, when the actor method
    returns (before the buffer can change). Other pages are gathered into a new array (on a GPU
    buffer: one device-to-host copy).
    """
    runs = _runs(page_ids)
    slices = _long_runs(runs, len(page_ids))
    out = []
    for v in views:
        if len(runs) == 1 and v.device.type == "cpu":
            first, _, n = runs[0]
            out.append(v[first : first + n].numpy())
        elif slices:  # slice copies into one array
            arr = np.empty((len(page_ids), v.shape[1]), np.uint8)
            dst = torch.from_numpy(arr)
            for first, at, n in runs:
                dst[at : at + n].copy_(v[first : first + n])
            out.append(arr)
        else:
            idx = torch.as_tensor(page_ids, dtype=torch.int64, device=v.device)
            out.append(v.index_select(0, idx).cpu().numpy())
    return out


def unpack_pages(views: list[torch.Tensor], page_ids: list[int], arrays: list[np.ndarray]) -> int:
    """Write :func:`pack_pages` output into ``page_ids`` of the same views (other page ids allowed).

    Returns:
        Bytes written.

    Raises:
        ValueError: the arrays do not have the shapes these views and pages need.
    """
    want = [(len(page_ids), int(v.shape[1])) for v in views]
    got = [tuple(a.shape) for a in arrays]
    if got != want:
        raise ValueError(f"chunk arrays have shapes {got}, {len(page_ids)} page(s) of these buffers need {want}")
    runs = _runs(page_ids)
    slices = _long_runs(runs, len(page_ids))
    with warnings.catch_warnings():
        # Ray hands the receiver read-only arrays (zero-copy); they are only read here.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        sources = [torch.from_numpy(a) for a in arrays]
    for v, src in zip(views, sources):
        if slices:  # slice copies
            for first, at, n in runs:
                v[first : first + n].copy_(src[at : at + n])
        else:
            idx = torch.as_tensor(page_ids, dtype=torch.int64, device=v.device)
            v.index_copy_(0, idx, src.to(v.device))
    return sum(int(a.nbytes) for a in arrays)
