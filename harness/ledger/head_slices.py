"""Whose KV head each decode rank of an unequal-TP pair holds, read from every rank's per-head digests.

The records are :mod:`harness.engines.server.kv_heads`'s (``kv_heads/<worker>.rank<R>.<pid>.jsonl``): a prefill rank's
per head slot digests of the pages its sender was handed (per chunk), and a decode rank's of its destination
pages at the commit. The caller says, derived by hand from the model's KV heads and the two TPs, which global
head each slot of each rank holds (``holds``); this module only matches digests, page by page, and names the
prefill head whose bytes a wrong slot holds instead.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

#: ``holds(side, rank, tp)``: the global KV head in each head slot of that rank (None: a padded slot).
Holds = Callable[[str, int, int], Sequence["int | None"]]


@dataclass(frozen=True)
class Misroute:
    """One decode rank's head slot whose bytes are not those of the head it holds."""

    room: int
    rank: int
    slot: int
    want: int | None  # the head the slot holds by the caller's derivation
    got: int | None  # the prefill head whose bytes it has (None: none of them)
    what: str = ""  # a record missing, where there is nothing to compare

    def line(self) -> str:
        if self.what:
            return f"room {self.room}: {self.what}"
        got = "no prefill head's" if self.got is None else f"KV head {self.got}'s"
        return (
            f"room {self.room}: decode rank {self.rank} slot {self.slot} holds {got} bytes, not KV head {self.want}'s"
        )


def read(directory: Path, worker: str) -> tuple[dict[int, dict[int, list[dict]]], list[str]]:
    """Room -> rank -> the worker's records (in the order written), and the lines that are not a record
    (``file:line``: a writer stopped mid-line)."""
    out: dict[int, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    bad: list[str] = []
    for path in sorted(Path(directory).glob(f"{worker}.rank*.jsonl")):
        for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
                out[int(rec["room"])][int(rec["rank"])].append(rec)
            except (ValueError, KeyError, TypeError):
                bad.append(f"{path.name}:{n}")
    return out, bad


def _chunks(recs: list[dict]) -> list[dict]:
    """A rank's records of one room in chunk order, one per chunk start (a room sent again keeps its last)."""
    return sorted({int(r["at"]): r for r in recs}.values(), key=lambda r: int(r["at"]))


def _by_head(records: dict[int, list[dict]], holds: Holds) -> dict[int, list[list[int]]]:
    """Prefill's digests per global head: per buffer, the pages of the room in chunk order."""
    heads: dict[int, list[list[int]]] = {}
    for rank, recs in records.items():
        chunks = _chunks(recs)
        slots = int(chunks[0]["slots"])
        for slot, head in enumerate(holds("prefill", rank, int(chunks[0]["tp"]))[:slots]):
            if head is None:
                continue
            buffers = len(chunks[0]["digests"])
            heads[head] = [[d for c in chunks for d in c["digests"][b][slot]] for b in range(buffers)]
    return heads


def check(directory: Path, prefill: str, decode: str, rooms: Iterable[int], holds: Holds) -> list[Misroute]:
    """Every decode rank's every held slot, for each room: its bytes equal prefill's of the head it holds.

    Args:
        directory: the run's ``kv_heads`` directory.
        prefill, decode: the two servers' worker names.
        rooms: the bootstrap rooms to check (each must have records on both sides).
        holds: the head in each slot of a rank, derived by the caller.

    Returns:
        The misroutes (empty: every rank holds what it should).
    """
    (sent, bad_sent), (landed, bad_landed) = read(directory, prefill), read(directory, decode)
    out: list[Misroute] = []
    rooms = list(rooms)
    if bad_sent or bad_landed:
        first = (bad_sent + bad_landed)[0]
        out.append(Misroute(rooms[0] if rooms else -1, -1, -1, None, None, what=f"not a record: {first}"))
    for room in rooms:
        said = [r for side in (sent, landed) for recs in side.get(room, {}).values() for r in recs]
        broken = [r["what"] for r in said if r.get("side") == "unreadable"]
        if broken:
            out.append(Misroute(room, -1, -1, None, None, what=f"a rank could not record its heads: {broken[0]}"))
            continue
        if not sent.get(room) or not landed.get(room):
            side = "prefill" if not sent.get(room) else "decode"
            out.append(Misroute(room, -1, -1, None, None, what=f"no {side} record (kv_heads/{prefill}, {decode})"))
            continue
        prefill_tp = int(next(iter(sent[room].values()))[0]["tp"])
        missing = [r for r in range(prefill_tp) if not sent[room].get(r)]
        if missing:
            out.append(Misroute(room, -1, -1, None, None, what=f"prefill rank {missing[0]} recorded no send"))
            continue
        by_head = _by_head(sent[room], holds)
        tp = int(next(iter(landed[room].values()))[0]["tp"])
        for rank in range(tp):
            recs = landed[room].get(rank)
            if not recs:
                out.append(Misroute(room, rank, -1, None, None, what=f"decode rank {rank} recorded no commit"))
                continue
            rec = recs[-1]
            held = holds("decode", rank, tp)
            if len(held) != int(rec["slots"]):
                what = f"decode rank {rank} has {rec['slots']} head slots, the derivation {len(held)}"
                out.append(Misroute(room, rank, -1, None, None, what=what))
                continue
            for slot, want in enumerate(held):
                if want is None:
                    continue
                got = [buf[slot] for buf in rec["digests"]]
                n = len(got[0])

                def same(head: int) -> bool:
                    return head in by_head and all(b[:n] == g for b, g in zip(by_head[head], got))

                if not same(want):
                    match = next((h for h in sorted(by_head) if same(h)), None)
                    out.append(Misroute(room, rank, slot, want, match))
    return out
