"""Which local model directory a real-server suite gets for a logical model name (never the hub).

Suites name their model logically (``tiny-llama``, ``tiny-mellum-swa``, ``dsv4``); this is the one place
that turns such a name into a directory: ``--model NAME=PATH``, then ``HARNESS_MODEL_<NAME>``, then (CPU only)
a tiny model built locally. On a GPU topology a model must be given. The order, the checks and the API:
docs/modules.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

from harness.engines.server.models import MODELS, ensure_model
from harness.topology import Topology

OPTION = "--model"
ENV_PREFIX = "HARNESS_MODEL_"
#: DeepSeek-V4 class model for the 8-gpu-h200 TP4+TP4 suite: never built here, always given.
DSV4 = "dsv4"
#: Every logical name a suite may ask for: the tiny models, then the real-only ones.
NAMES: tuple[str, ...] = (*MODELS, DSV4)


class ModelError(ValueError):
    """A model cannot be resolved or a given path is unusable. The message is one line with the fix."""


def env_var(name: str) -> str:
    """The env var that maps logical model ``name`` to a directory (``HARNESS_MODEL_<NAME>``)."""
    return ENV_PREFIX + name.upper().replace("-", "_")


def _how(name: str) -> str:
    return f"{OPTION} {name}=PATH or {env_var(name)}=PATH"


def _check_name(name: str, where: str) -> str:
    if name not in NAMES:
        raise ModelError(f"unknown model name {name!r} in {where}: use one of {', '.join(NAMES)}")
    return name


def check_dir(path: str | os.PathLike, where: str) -> Path:
    """Validate a model directory given by ``where`` (the option or env var, for the message).

    Returns:
        The absolute path.

    Raises:
        ModelError: it does not exist, is not a directory, or has no ``config.json``.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(f"{where}: {p} does not exist; give a local model directory (no hub download)")
    if not p.is_dir():
        raise ModelError(f"{where}: {p} is not a directory; give the model directory, not a file in it")
    if not (p / "config.json").is_file():
        raise ModelError(f"{where}: {p} has no config.json; give a Hugging Face model directory")
    return p.resolve()


def overrides(option_values: Sequence[str] | None, environ: Mapping[str, str] | None = None) -> dict[str, Path]:
    """The models given on the command line and in the environment (the command line wins).

    Args:
        option_values: each ``NAME=PATH`` passed to ``--model``.
        environ: where the ``HARNESS_MODEL_*`` vars are read (default ``os.environ``).

    Returns:
        ``{name: directory}``, each directory validated.

    Raises:
        ModelError: malformed value, unknown name, a name given twice, or an unusable directory.
    """
    env = os.environ if environ is None else environ
    out: dict[str, Path] = {}
    known = {env_var(n): n for n in NAMES}
    for var in sorted(v for v in env if v.startswith(ENV_PREFIX)):
        if var not in known:
            raise ModelError(f"env {var}: no model is called that; use one of {', '.join(env_var(n) for n in NAMES)}")
        if env[var]:
            out[known[var]] = check_dir(env[var], f"env {var}")
    given: set[str] = set()
    for value in option_values or ():
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ModelError(f"{OPTION} {value!r}: write NAME=PATH, e.g. {OPTION} dsv4=/models/DeepSeek-V4")
        _check_name(name, f"{OPTION} {value}")
        if name in given:
            raise ModelError(f"{OPTION} {name}=... is given twice; give each model once")
        given.add(name)
        out[name] = check_dir(path, f"{OPTION} {value}")
    return out


def resolve(
    name: str, given: Mapping[str, Path], topology: Topology, *, cache_dir: str | os.PathLike | None = None
) -> Path:
    """The model directory a suite gets for logical model ``name`` on ``topology``.

    Args:
        name: a logical model name (:data:`NAMES`).
        given: the result of :func:`overrides`.
        topology: the test's topology; without GPUs an unmapped tiny model is built locally.
        cache_dir: where tiny models are built (default the repo-ignored ``models/``).

    Returns:
        The directory to pass as ``--model-path``.

    Raises:
        ModelError: unknown name, or no directory for it where one must be given.
    """
    _check_name(name, "a suite's model")
    if name in given:
        return Path(given[name])
    if topology.needs_gpus:
        raise ModelError(
            f"topology {topology.name} runs real models: give model {name!r} with {_how(name)} "
            "(a local model directory; no hub download)"
        )
    if name not in MODELS:
        raise ModelError(f"model {name!r} is not built locally: give it with {_how(name)}")
    return ensure_model(name, cache_dir)
