"""What a PD run does: the pool configuration of both sides, the requests, a seeded workload."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.engines import alloc_order as order_knob
from harness.engines.soak_driver import mix

KV_KINDS = ("swa", "dsv4")
#: sglang's default ``SGLANG_SWA_EVICTION_INTERVAL`` (0.5.23): decode frees SWA slots once this
#: many tokens slid out of the window.
SGLANG_EVICTION_INTERVAL = 128


@dataclass(frozen=True)
class KVSpec:
    """Pool configuration shared by the prefill and decode workers of one PD pair.

    Attributes:
        kind: ``swa`` (SWAKVPool, hybrid SWA) or ``dsv4`` (DeepSeek-V4 pools).
        page_size: tokens per page.
        window: the sliding window.
        hisparse: DeepSeek-V4 hisparse on the decode side (``dsv4`` only).
        radix_cache: ``--disaggregation-decode-enable-radix-cache`` on the decode side.
        full_tokens: decode full-pool tokens (prefill gets the same, SWA included).
        swa_tokens: decode SWA-pool tokens.
        req_slots: request slots on each side.
        max_context_len: longest request.
        kv_heads: the model's KV heads (``swa`` pools): each of TP ranks stores ``kv_heads // tp`` of
            them, so TP must divide it. DeepSeek-V4's latent KV has no heads: every rank holds it whole.
        device: ``auto`` (the worker's GPU when torch sees one, else CPU), ``cuda`` or ``cpu``.
        eviction_interval: ``SGLANG_SWA_EVICTION_INTERVAL`` of the decode ranks; None leaves it
            unset, so sglang's default (:data:`SGLANG_EVICTION_INTERVAL`) applies.
        alloc_order: both sides' page allocation order, ``sglang`` or ``lifo`` (a freed page is the
            next handed out: :mod:`harness.engines.alloc_order`); default ``HARNESS_ALLOC_ORDER``.
        pool_pages: when set, each side's full pool has this many pages (and the SWA pool at most as
            many), whatever ``full_tokens`` says; default ``HARNESS_POOL_PAGES``.
    """

    kind: str = "swa"
    page_size: int = 64
    window: int = 100
    hisparse: bool = False
    radix_cache: bool = False
    full_tokens: int = 48 * 64
    swa_tokens: int = 16 * 64
    req_slots: int = 8
    max_context_len: int = 4096
    kv_heads: int = 8
    device: str = "auto"
    eviction_interval: int | None = 1
    alloc_order: str = field(default_factory=lambda: order_knob.knobs()[0])
    pool_pages: int | None = field(default_factory=lambda: order_knob.knobs()[1])

    def __post_init__(self) -> None:
        object.__setattr__(self, "alloc_order", order_knob.checked_order(self.alloc_order, "KVSpec.alloc_order"))
        if order_knob.checked_pages(self.pool_pages, "KVSpec.pool_pages") is not None:
            full = int(self.pool_pages or 0) * self.page_size
            object.__setattr__(self, "full_tokens", full)
            object.__setattr__(self, "swa_tokens", min(self.swa_tokens, full))
        if self.kind not in KV_KINDS:
            raise ValueError(f"kind {self.kind!r} unknown; use one of {KV_KINDS}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device {self.device!r} unknown; use auto, cuda or cpu")
        if self.hisparse and self.kind != "dsv4":
            raise ValueError("hisparse needs kind='dsv4'")
        if self.eviction_interval is not None and self.eviction_interval < 1:
            raise ValueError(f"eviction_interval={self.eviction_interval} must be >= 1, or None for sglang's default")
        if self.kv_heads < 1:
            raise ValueError(f"kv_heads={self.kv_heads} must be ≥ 1")
        for name in ("full_tokens", "swa_tokens"):
            if getattr(self, name) % self.page_size:
                raise ValueError(f"{name}={getattr(self, name)} is not a multiple of page_size {self.page_size}")

    def heads_per_rank(self, tp: int) -> int:
        """KV heads one of ``tp`` ranks stores (its head shard; DeepSeek-V4: 1, the whole latent).

        Raises:
            ValueError: ``tp`` does not divide ``kv_heads`` on the ``swa`` pools.
        """
        if self.kind == "dsv4":
            return 1
        if tp < 1 or self.kv_heads % tp:
            raise ValueError(
                f"TP {tp} does not divide kv_heads={self.kv_heads}: "
                "pick a KVSpec.kv_heads that is a multiple of the topology's TP size"
            )
        return self.kv_heads // tp

    @property
    def tag(self) -> str:
        """Short name of the configuration, used in worker ledger names."""
        bits = [self.kind, f"p{self.page_size}", f"w{self.window}"]
        bits += ["hisparse"] if self.hisparse else []
        bits += ["radix"] if self.radix_cache else []
        bits += [f"i{self.eviction_interval or 'default'}"] if self.eviction_interval != 1 else []
        bits += [self.alloc_order] if self.alloc_order != order_knob.SGLANG else []
        bits += [f"n{self.pool_pages}"] if self.pool_pages else []
        return "-".join(bits)


@dataclass(frozen=True)
class PDRequest:
    """One request through P→D: a prompt, decode steps after the handover, an optional failure path.

    Attributes:
        rid: request id.
        prompt_len: prompt tokens (prefill computes them, decode receives their KV).
        decode_steps: decode steps after the first token.
        abort_after_chunks: abort the request after this many transfer chunks (None: never).
        fail_after_chunks: the transfer fails after this many chunks (None: never): decode gives the
            request up through sglang's failed-transfer path.
        abort_after_steps: abort the request after this many decode steps (None: never).
        retract_after_steps: retract the request after this many decode steps (None: never), as decode
            does under pool pressure; sglang resumes it when its admission budgets let it.
    """

    rid: str
    prompt_len: int
    decode_steps: int = 4
    abort_after_chunks: int | None = None
    fail_after_chunks: int | None = None
    abort_after_steps: int | None = None
    retract_after_steps: int | None = None


def workload(
    seed: int,
    n: int,
    *,
    page_size: int,
    max_prompt: int,
    max_steps: int = 8,
    abort_rate: float = 0.0,
    prefix: str = "r",
) -> list[PDRequest]:
    """A seeded workload: prompt lengths mostly at page boundaries (±1) and some uniform, a few aborts.

    Args:
        seed: the random seed (same seed, same workload).
        n: number of requests.
        page_size: the page size the boundaries are placed at.
        max_prompt: longest prompt.
        max_steps: most decode steps per request.
        abort_rate: fraction of requests aborted mid-transfer (after their first chunk).
        prefix: request-id prefix.

    Returns:
        The requests, in arrival order.

    Raises:
        ValueError: ``max_prompt`` shorter than a page.
    """
    # The soak's draw (harness.engines.soak_driver.mix), so both engines' soaks and this workload are one request mix.
    return [
        PDRequest(r.rid, r.length, r.new_tokens, 1 if r.abort else None)
        for r in mix(
            seed, n, page_size=page_size, max_prompt=max_prompt, max_new=max_steps, abort_rate=abort_rate, prefix=prefix
        )
    ]
