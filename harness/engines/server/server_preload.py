"""What a real sglang server on CPU imports ahead of time: the server fork server's preload.

:func:`server` imports the third-party modules sglang's server graph pulls in (about 85 % of its import
time) and nothing of sglang, so each forked server imports sglang itself after its own ``sitecustomize``
ran. The list (:data:`SERVER_MODULES_FILE`) is generated and checked for staleness. Nothing here touches a
device. Detail: docs/modules.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

from harness.engines.server.launcher import CPU_ENV, CPU_SHIM_DIR

#: The fork server's ``preload`` for real sglang servers on CPU.
SERVER_PRELOAD = f"{__name__}:server"


#: The third-party modules a server imports (one per line), in import order.
SERVER_MODULES_FILE = Path(__file__).resolve().parent / "server_modules.txt"


#: What a server process and its scheduler and detokenizer import: the graph :func:`server` covers.
SERVER_GRAPH = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.llama",
    "sglang.srt.disaggregation.mooncake.conn",
)


class PreloadError(RuntimeError):
    """The server preload imported sglang or the adapter: forked servers would miss their hooks."""


def server() -> None:
    """Import the third-party modules of sglang's server graph, and none of sglang's (see the module
    docstring). A module this environment cannot import is skipped: the server imports it (or not)
    as it would without the fork server.

    Raises:
        PreloadError: a listed module imported sglang (the list must name third-party modules only).
    """
    for name in SERVER_MODULES_FILE.read_text().split():
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional preload, as in rank()
            continue
    leaked = sorted(m for m in sys.modules if m == "sglang" or m.startswith("sglang."))
    if leaked:
        raise PreloadError(
            f"the server preload imported {leaked[0]} (and {len(leaked) - 1} more sglang modules): "
            "forked servers would import sglang before their sitecustomize hooks"
        )


_LIST_SERVER_MODULES = """
import sys
before = set(sys.modules)
for name in sys.argv[1:]:
    __import__(name)
stdlib = set(sys.stdlib_module_names)
for m in sys.modules:
    top = m.split(".")[0]
    if (m not in before and top not in stdlib and not top.startswith("_")
            and top not in ("sglang", "harness", "sgl_kernel")):
        print(m)
"""


def list_server_modules(env: dict[str, str] | None = None) -> list[str]:
    """The third-party modules importing :data:`SERVER_GRAPH` pulls in, in import order (a real
    import, in a subprocess with a CPU server's environment)."""
    run_env = {**os.environ, **CPU_ENV, "OMP_NUM_THREADS": "1", **(env or {})}
    run_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SHIM_DIR), run_env.get("PYTHONPATH", "")) if p)
    r = subprocess.run(
        [sys.executable, "-c", _LIST_SERVER_MODULES, *SERVER_GRAPH],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0:
        raise PreloadError(f"importing sglang's server graph failed: {r.stderr.strip().splitlines()[-1:]}")
    return r.stdout.split()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m harness.engines.server.server_preload",
        description="Write the server preload's module list from a real import.",
    )
    p.add_argument("--write-server-modules", action="store_true", required=True)
    p.parse_args(argv)
    mods = list_server_modules()
    SERVER_MODULES_FILE.write_text("\n".join(mods) + "\n")
    print(f"{len(mods)} modules -> {SERVER_MODULES_FILE.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
