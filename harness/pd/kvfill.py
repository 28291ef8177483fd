"""Deterministic KV content and page moves (pure torch; no sglang).

Every token's KV bytes in every buffer are ``content(seed(rid, shard), buffer, position)``, so the
decode side can verify each byte it received or kept without seeing the prefill side. A buffer is
viewed as ``[pages, page_bytes]`` uint8 (a view, never a copy); token ``s`` of a page owns bytes
``[s * token_bytes, (s + 1) * token_bytes)`` with ``token_bytes = page_bytes // page_size`` (any
padding at the end of a page is not content).

Transfers move whole pages: :func:`gather_pages` packs pages of several buffers into one flat
numpy array (zero-copy through Ray's object store), :func:`scatter_pages` unpacks it.
"""

from __future__ import annotations

import warnings
import zlib
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Mismatch:
    """The first byte run that differs from the expected content."""

    buffer: int
    position: int
    page: int
    slot: int

    def __str__(self) -> str:
        return f"buffer {self.buffer} position {self.position} (page {self.page}, slot {self.slot})"


def seed_of(rid: str, shard: int) -> int:
    """The content seed of one request on one TP shard (a rank→rank mix-up shows as a mismatch)."""
    return zlib.crc32(f"{rid}|{shard}".encode()) & 0x7FFFFFFF


def byte_view(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """View a KV buffer as ``[pages, page_bytes]`` uint8 (no copy).

    Args:
        buf: a contiguous buffer whose first dimension is token rows (a multiple of ``page_size``)
            or pages (2-D uint8 page buffers).
        page_size: tokens per page.

    Returns:
        The byte view.
    """
    b = buf.view(torch.uint8) if buf.dtype != torch.uint8 else buf
    if buf.dim() == 2 and buf.dtype == torch.uint8:
        return b  # already page rows
    rows = buf.shape[0]
    return b.reshape(rows // page_size, -1)


def _token_view(view: torch.Tensor, page_size: int) -> torch.Tensor:
    pages, page_bytes = view.shape
    tb = page_bytes // page_size
    return view.as_strided((pages, page_size, tb), (page_bytes, tb, 1))


def content(seed: int, buffer: int, positions: torch.Tensor, token_bytes: int) -> torch.Tensor:
    """Expected bytes of ``positions`` in one buffer: ``[len(positions), token_bytes]`` uint8 (CPU)."""
    pos = positions.to("cpu", torch.int64)
    # One small int64 computation per row and per column, then a wrapping uint8 add: cheap enough
    # to regenerate for every verification.
    row = ((seed + buffer * 1_000_003 + pos * 7_919) % 251).to(torch.uint8)
    col = ((torch.arange(token_bytes, dtype=torch.int64) * 31 + seed * 13 + buffer * 101) % 251).to(torch.uint8)
    return row[:, None] + col[None, :]


def write(views: list[torch.Tensor], page_size: int, buffer0: int, seed: int, positions: torch.Tensor,
          pages: torch.Tensor, slots: torch.Tensor) -> None:
    """Write the content of ``positions`` at (page, slot) into every view; view ``i`` is buffer ``buffer0 + i``."""
    if positions.numel() == 0:
        return
    for i, v in enumerate(views):
        tv = _token_view(v, page_size)
        data = content(seed, buffer0 + i, positions, tv.shape[2]).to(v.device)
        tv[pages.to(v.device), slots.to(v.device)] = data


def verify(views: list[torch.Tensor], page_size: int, buffer0: int, seed: int, positions: torch.Tensor,
           pages: torch.Tensor, slots: torch.Tensor) -> Mismatch | None:
    """Compare every byte of ``positions`` at (page, slot) with the expected content.

    Returns:
        The first :class:`Mismatch` (in buffer, then position order), or None when all match.
    """
    if positions.numel() == 0:
        return None
    for i, v in enumerate(views):
        tv = _token_view(v, page_size)
        got = tv[pages.to(v.device), slots.to(v.device)].cpu()
        bad = (got != content(seed, buffer0 + i, positions, tv.shape[2])).any(dim=1)
        if bool(bad.any()):
            j = int(bad.nonzero()[0, 0])
            return Mismatch(buffer0 + i, int(positions[j]), int(pages[j]), int(slots[j]))
    return None


def gather_pages(views: list[torch.Tensor], page_ids: list[int]) -> np.ndarray:
    """Pack whole pages of every view into one flat uint8 array (view order, then page order)."""
    if not page_ids:
        return np.zeros(0, np.uint8)
    out = np.empty(sum(v.shape[1] for v in views) * len(page_ids), np.uint8)
    flat = torch.from_numpy(out)
    off = 0
    for v in views:
        n = v.shape[1] * len(page_ids)
        idx = torch.as_tensor(page_ids, dtype=torch.int64, device=v.device)
        dst = flat[off:off + n].view(len(page_ids), v.shape[1])
        if v.device.type == "cpu":
            torch.index_select(v, 0, idx, out=dst)  # one copy, straight into the array Ray ships
        else:
            dst.copy_(v.index_select(0, idx))
        off += n
    return out


def scatter_pages(views: list[torch.Tensor], page_ids: list[int], data: np.ndarray) -> None:
    """Unpack :func:`gather_pages` output into the same pages of ``views`` (other page ids allowed).

    Raises:
        ValueError: ``data`` does not have the size the views and pages need.
    """
    need = sum(v.shape[1] for v in views) * len(page_ids)
    if data.size != need:
        raise ValueError(f"chunk has {data.size} bytes, {len(page_ids)} page(s) of these buffers need {need}")
    if not page_ids:
        return
    with warnings.catch_warnings():
        # Ray hands the receiver a read-only array (zero-copy); it is only read here.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        flat = torch.from_numpy(np.ascontiguousarray(data))
    off = 0
    for v in views:
        n = v.shape[1] * len(page_ids)
        idx = torch.as_tensor(page_ids, dtype=torch.int64, device=v.device)
        v.index_copy_(0, idx, flat[off:off + n].view(len(page_ids), v.shape[1]).to(v.device))
        off += n
