"""Per-rank, per-head KV digests on a real server of unequal prefill/decode TP: which head's bytes each rank holds.

The ledger's KV digests (:mod:`.kv_digest`) are written by a server's attention-TP rank 0 only (its other ranks
mirror its pages), and per whole page. Unequal TP needs every rank and every head: each prefill rank records,
as its sender is handed a chunk, the digest of each of its head slots per buffer and page (``side: prefill``),
and each decode rank records the same of its destination pages as decode commits the room (``side: decode``).
A check (:mod:`harness.ledger.head_slices`) then says, per room and decode rank, whose head the bytes are.

Each process writes its own JSONL (``<dir>/<worker>.rank<R>.<pid>.jsonl``, dir from ``HARNESS_KV_HEADS``): the
ranks are separate processes and the ledger's ``seq`` is per writer, so they never share a file. The hooks are
:mod:`.kv_digest`'s (it calls :meth:`HeadsRecorder.record`); the launcher turns this on only for a topology whose
prefill and decode attention TP differ.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Mapping

from harness.ledger.content import digest_rows

log = logging.getLogger(__name__)

#: The directory the per-rank files go to; unset: nothing is recorded.
HEADS_ENV = "HARNESS_KV_HEADS"


def slot_digests(views: list[Any], pages: list[int], slots: int, page_size: int) -> list[list[list[int]]]:
    """Per buffer, per head slot, the digest of each page's bytes of that slot (``[buffers][slots][pages]``).

    A buffer's page is ``page_size`` token rows of ``slots`` heads each (sglang's MHA layout, ``[token, head,
    dim]``), so slot ``s`` of a page is the ``s``-th of ``slots`` equal parts of every token row."""
    import torch

    out: list[list[list[int]]] = []
    for v in views:
        if not pages:
            out.append([[] for _ in range(slots)])
            continue
        idx = torch.as_tensor(pages, dtype=torch.int64, device=v.device)
        block = v.index_select(0, idx).view(len(pages), page_size, slots, -1)
        out.append(
            [digest_rows(block[:, :, s, :].contiguous().reshape(len(pages), -1).cpu().numpy()) for s in range(slots)]
        )
    return out


class HeadsRecorder:
    """One rank's writer of head-slot digests (its file opened at the first record).

    A record it cannot make (a pool without ``head_num``, a KV manager without ``attn_tp_size``, a read that
    fails) never reaches sglang's call it rides on: the first one is written as a ``side: unreadable`` line
    naming what was missing, and the recorder stops, so the check reports the room as unrecorded."""

    def __init__(self, directory: str | Path, worker: str) -> None:
        self.directory = Path(directory)
        self.worker = worker
        self._lock = threading.Lock()
        self._files: dict[int, Any] = {}
        self.stopped = False

    def path(self, rank: int) -> Path:
        """This process's file for ``rank`` (and pid: with DP attention two processes share an attention-TP rank)."""
        return self.directory / f"{self.worker}.rank{rank}.{os.getpid()}.jsonl"

    def record(
        self,
        side: str,
        *,
        room: int,
        kv_args: Any,
        tp: int | None,
        views: list[Any],
        pages: list[int],
        slots: int | None,
        page_size: int,
        at: int = 0,
    ) -> None:
        """Write one line: ``side`` (prefill or decode), the room, this rank and its attention TP, the pages and
        their per-slot digests. A line per call, flushed, so a reader sees whole records only."""
        if self.stopped:
            return
        rank = 0
        try:
            rank = int(kv_args.engine_rank) % max(1, int(tp or 1))
            if tp is None or slots is None:
                raise AttributeError("attn_tp_size" if tp is None else "the KV pool's head_num")
            line: dict[str, Any] = {
                "side": side,
                "room": int(room),
                "rank": rank,
                "tp": int(tp),
                "at": int(at),
                "pages": [int(p) for p in pages],
                "slots": int(slots),
                "digests": slot_digests(views, pages, int(slots), page_size),
            }
        except Exception as e:  # noqa: BLE001 - never into sglang's send or commit: said once, then off
            self.stopped = True
            line = {"side": "unreadable", "room": int(room), "rank": rank, "what": f"{side}: {e!r}"}
        try:
            self._write(rank, line)
        except OSError as e:  # the run directory gone or full: the check then finds the room unrecorded
            self.stopped = True
            log.warning("kv heads: cannot write %s (%s); recording stops in pid %d", self.path(rank), e, os.getpid())

    def _write(self, rank: int, line: dict[str, Any]) -> None:
        with self._lock:
            fh = self._files.get(rank)
            if fh is None:
                self.directory.mkdir(parents=True, exist_ok=True)
                fh = self._files[rank] = open(self.path(rank), "a", encoding="utf-8")
            fh.write(json.dumps(line) + "\n")
            fh.flush()


def from_env(worker: str, environ: Mapping[str, str] | None = None) -> HeadsRecorder | None:
    """The recorder of ``worker`` (its probe's worker name) that ``HARNESS_KV_HEADS`` asks for, or None."""
    env = os.environ if environ is None else environ
    directory = (env.get(HEADS_ENV) or "").strip()
    return HeadsRecorder(directory, worker) if directory else None
