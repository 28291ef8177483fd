"""The PD router's entry point (``python -m harness.engines.server.router ARGS``): sglang-router's
Rust router, parsed and started as upstream's ``sglang_router.launch_router`` starts it (the same
``RouterArgs`` flags, then ``Router.from_args(...).start()``), without that module's import of the
Python MiniLB.

Why: upstream's module imports sglang (torch, transformers) only to offer ``--mini-lb``, 6.8 s per stack
start on a 2-core machine. ``--mini-lb`` still runs upstream's module. Measurements: docs/modules.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

#: Upstream's launcher, run for ``--mini-lb``.
UPSTREAM_MODULE = "sglang_router.launch_router"


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--mini-lb" in args:
        import runpy

        sys.argv = [UPSTREAM_MODULE, *args]
        runpy.run_module(UPSTREAM_MODULE, run_name="__main__", alter_sys=True)
        return
    import setproctitle
    from sglang_router.router import Router
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(
        prog="router", description="sglang-router's Rust router (see the module docstring)"
    )
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    router_args = RouterArgs.from_cli_args(parser.parse_args(args), use_router_prefix=False)
    setproctitle.setproctitle("sglang::router")
    router_args._validate_router_args()
    Router.from_args(router_args).start()


if __name__ == "__main__":
    main()
