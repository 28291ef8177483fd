"""What a role's engine arguments say about its parallelism: the topology loader reads ``tp``, ``dp``
and ``dp_attention`` from them when a role does not state them, and refuses one that contradicts them.
Pure, and nothing of sglang is imported: the flags are sglang's spellings, read as its argparse reads them.
"""

from __future__ import annotations

#: The flags that say a role's parallelism, by the role key they must agree with.
PARALLEL_FLAGS: dict[str, tuple[str, ...]] = {
    "tp": ("--tp", "--tp-size", "--tensor-parallel-size"),
    "dp": ("--dp", "--dp-size", "--data-parallel-size"),
    "dp_attention": ("--enable-dp-attention",),
}


def engine_flag(args: tuple[str, ...], flags: tuple[str, ...]) -> str | None:
    """The value ``args`` give any of ``flags`` (``--dp-size 4`` or ``--dp-size=4``; ``""`` for a
    switch such as ``--enable-dp-attention``; None: not given). The last occurrence wins, as in argparse.

    >>> engine_flag(("--enable-dp-attention", "--dp-size", "4"), ("--dp", "--dp-size"))
    '4'
    >>> engine_flag(("--dp-size=2",), ("--dp-size",))
    '2'
    >>> engine_flag(("--enable-dp-attention",), ("--enable-dp-attention",)), engine_flag((), ("--tp",))
    ('', None)
    """
    found = None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in flags:
            nxt = args[i + 1] if i + 1 < len(args) else ""
            found = value if eq else ("" if not nxt or nxt.startswith("--") else nxt)
    return found


def parallelism(args: tuple[str, ...]) -> dict[str, int | bool | None]:
    """``tp``, ``dp`` and ``dp_attention`` as ``args`` say them (None: not said).

    >>> parallelism(("--enable-dp-attention", "--dp-size", "4"))
    {'tp': None, 'dp': 4, 'dp_attention': True}

    Raises:
        ValueError: a size that is not a whole number ≥ 1 (the message names the flag and a fix).
    """
    out: dict[str, int | bool | None] = {}
    for key, flags in PARALLEL_FLAGS.items():
        said = engine_flag(args, flags)
        if said is None or key == "dp_attention":
            out[key] = None if said is None else True
        elif said.isdigit() and int(said) >= 1:
            out[key] = int(said)
        else:
            raise ValueError(f'{flags[-1]} {said!r} is not a whole number ≥ 1; write e.g. ["{flags[1]}", "2"]')
    return out
