"""Heterogeneous PD on the simulated engine: prefill and decode with unequal attention TP and DP, each
request's KV moved as sglang's own mooncake code plans it (:mod:`harness.engines.sim.hetero_rank`).

:func:`start` puts one :class:`~harness.engines.sim.hetero_rank.HeteroRank` per rank of a topology's
first prefill and decode groups (refusing, in one line, a TP the model's KV heads cannot be sliced to);
:func:`transfer` runs requests through: dispatch, bind, pull from every prefill rank sglang names,
optionally retract and rebootstrap, and says per decode rank where its KV came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from harness.engines.sim.hetero_rank import HeteroModel, Refused, owned_heads
from harness.engines.sim.ranks import Ranks
from harness.topology import RoleSpec, Topology

RANK_PAYLOAD = "harness.engines.sim.hetero_rank:HeteroRank"


@dataclass(frozen=True)
class HeteroRequest:
    """One request: ``room`` is its bootstrap room; ``prefill_dp_rank`` the prefill DP rank a router chose
    itself (None: sglang's follow_bootstrap_room decides); ``retract`` retracts it once after its KV
    arrived and rebootstraps it."""

    rid: str
    prompt_len: int
    room: int
    prefill_dp_rank: int | None = None
    retract: bool = False


@dataclass
class Delivery:
    """Where one request's KV came from: the prefill DP rank that holds it, the decode ranks that got it,
    and per decode rank each bootstrap's bound prefill DP rank and the prefill TP ranks it pulled from."""

    rid: str
    prefill_dp_rank: int
    decode_ranks: list[int] = field(default_factory=list)
    bound: dict[int, list[int]] = field(default_factory=dict)
    pulled: dict[int, list[list[int]]] = field(default_factory=dict)
    bytes: int = 0


@dataclass(frozen=True)
class Shape:
    """One role's parallel shape as sglang sees it."""

    tp: int
    dp: int

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp


def shape(role: RoleSpec) -> Shape:
    """The role's attention shape: DP attention splits its TP group into ``dp`` attention-DP ranks."""
    return Shape(role.tp, role.dp if role.dp_attention else 1)


def check(model: HeteroModel, prefill: Shape, decode: Shape) -> None:
    """Refuse, in one line naming both sides, a pair whose TP the model's KV heads cannot be sliced to.

    Raises:
        Refused: the refusal.
    """
    for side, s in (("prefill", prefill), ("decode", decode)):
        try:
            owned_heads(model.kv_heads, s.attn_tp, 0)
        except Refused as e:
            raise Refused(
                f"hetero PD refused: {side} attention TP {s.attn_tp} (prefill TP {prefill.tp} DP {prefill.dp}, "
                f"decode TP {decode.tp} DP {decode.dp}): {e}"
            ) from None


@dataclass
class HeteroPair:
    """The started ranks of one heterogeneous pair."""

    prefill: Ranks
    decode: Ranks
    prefill_shape: Shape
    decode_shape: Shape
    model: HeteroModel

    def readback(self, role: str, rank: int, rid: str) -> dict[str, Any]:
        """One rank's KV of ``rid`` (:meth:`HeteroRank.readback`)."""
        ranks = self.prefill if role == "prefill" else self.decode
        return ranks.get([ranks.submit(rank, "readback", rid)], [rank])[0]

    def release(self, rids: Sequence[str]) -> None:
        for rid in rids:
            self.prefill.all("release", rid)
            self.decode.all("release", rid)


def payloads(topology: Topology, model: HeteroModel) -> dict[str, list[dict[str, Any]]]:
    """The keyword arguments of every rank's payload, per role kind (first group of each role).

    Raises:
        Refused: the model's KV heads cannot be sliced to a role's attention TP.
    """
    p_role, d_role = topology.roles_of("prefill")[0], topology.roles_of("decode")[0]
    ps, ds = shape(p_role), shape(d_role)
    check(model, ps, ds)
    out: dict[str, list[dict[str, Any]]] = {}
    for kind, role, me, peer in (("prefill", p_role, ps, ds), ("decode", d_role, ds, ps)):
        out[kind] = [
            dict(role=kind, rank=r, tp=me.tp, dp=me.dp, peer_attn_tp=peer.attn_tp, peer_dp=peer.dp, model=model)
            for r in range(role.tp)
        ]
    return out


def start(workers: Any, topology: Topology, model: HeteroModel, timeout: float = 120.0) -> HeteroPair:
    """Start the pair's ranks through a ``pd_workers`` factory (the topology's placement groups).

    Raises:
        Refused: the model's KV heads cannot be sliced to a role's attention TP (nothing is started).
    """
    from harness.engines.sim.deploy import rank_runtime_env, worker_env
    from harness.workers import InProcess

    kwargs = payloads(topology, model)
    # As the PD ranks start: the run's faults and sglang's checks, forked from the rank preload when it can.
    spec = {"env": worker_env(), "runtime_env": rank_runtime_env(workers.cluster, topology, None, workers.sglang)}
    started: dict[str, list[Any]] = {}
    for kind, ranks in kwargs.items():
        role = topology.roles_of(kind)[0]
        started[kind] = [
            workers(role.name, InProcess(RANK_PAYLOAD, kwargs={"name": f"{kind}-r{r}", **kw}), rank=r, **spec)
            for r, kw in enumerate(ranks)
        ]
    p_role, d_role = topology.roles_of("prefill")[0], topology.roles_of("decode")[0]
    return HeteroPair(
        Ranks(started["prefill"], timeout), Ranks(started["decode"], timeout), shape(p_role), shape(d_role), model
    )


def _pull(pair: HeteroPair, rid: str, rank: int, boot: dict[str, Any], delivery: Delivery) -> None:
    """Move the KV of ``rid`` into decode ``rank`` from every prefill TP rank its bootstrap names."""
    prefill_ranks = [boot["prefill_dp_rank"] * pair.prefill_shape.attn_tp + t for t in boot["target_tp_ranks"]]
    sends = [pair.prefill.submit(p, "send", rid, boot["registration"], boot["pages"]) for p in prefill_ranks]
    for (addr, length, blob), p in zip(pair.prefill.get(sends, prefill_ranks), prefill_ranks):
        done = pair.decode.get([pair.decode.submit(rank, "write", rid, addr, length, blob)], [rank])[0]
        delivery.bytes += int(done)
    delivery.bound.setdefault(rank, []).append(int(boot["prefill_dp_rank"]))
    delivery.pulled.setdefault(rank, []).append(prefill_ranks)


def transfer(pair: HeteroPair, requests: Sequence[HeteroRequest]) -> list[Delivery]:
    """Run each request through: prefill dispatches and fills it, decode dispatches, binds and pulls it
    (and, with ``retract``, retracts it, rebootstraps and pulls it again).

    Raises:
        NotHeld (as the rank's error): a receiver was bound to a prefill DP rank that does not hold the request.
        PDError: the prefill ranks disagree on the DP rank they dispatched the request to.
    """
    from harness.engines.sim.errors import PDError

    out = []
    for req in requests:
        chosen = set(pair.prefill.all("prefill", req.rid, req.prompt_len, req.room, req.prefill_dp_rank))
        if len(chosen) != 1:
            raise PDError(f"prefill ranks dispatched {req.rid} to different DP ranks: {sorted(chosen)}")
        delivery = Delivery(req.rid, chosen.pop())
        boots = pair.decode.all("admit", req.rid, req.prompt_len, req.room, req.prefill_dp_rank)
        for rank, boot in enumerate(boots):
            if boot is not None:
                delivery.decode_ranks.append(rank)
                _pull(pair, req.rid, rank, boot, delivery)
        if req.retract:
            for rank in delivery.decode_ranks:
                pair.decode.get([pair.decode.submit(rank, "retract", req.rid)], [rank])
            for rank in delivery.decode_ranks:
                boot = pair.decode.get([pair.decode.submit(rank, "rebootstrap", req.rid)], [rank])[0]
                _pull(pair, req.rid, rank, boot, delivery)
        out.append(delivery)
    return out
