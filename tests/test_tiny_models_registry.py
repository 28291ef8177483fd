"""The CPU recipe names ``harness_tiny_models`` as sglang's external model package: every tiny model's
architecture resolves to sglang's own class through the registry's fast path, without importing the
registry's other model modules (about 3 s of each server's start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from harness.engines.server import launcher, models

PROBE = """
import json, sys
from sglang.srt.models.registry import ModelRegistry
out = {}
for arch in sys.argv[1:]:
    cls, _ = ModelRegistry.resolve_model_cls([arch])
    out[arch] = cls.__module__
out["defaults_loaded"] = ModelRegistry._default_models_loaded
import pkgutil, sglang.srt.models as pkg
out["model_modules"] = len([m for m in pkgutil.iter_modules(pkg.__path__) if not m.ispkg])
out["imported"] = sorted(m for m in sys.modules if m.startswith("sglang.srt.models.") and m.count(".") == 3)
print(json.dumps(out))
"""


def test_every_tiny_model_resolves_to_sglangs_class_without_the_whole_registry():
    archs = sorted(
        {
            a
            for name in models.MODELS
            for a in json.loads((models.ensure_model(name) / "config.json").read_text())["architectures"]
        }
    )
    env = {
        **os.environ,
        **{k: launcher.CPU_ENV[k] for k in ("SGLANG_EXTERNAL_MODEL_PACKAGE", "SGLANG_USE_CPU_ENGINE")},
        "PYTHONPATH": os.pathsep.join([str(launcher.CPU_SHIM_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run([sys.executable, "-c", PROBE, *archs], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for arch in archs:  # sglang's class, not a copy: the package only re-exports EntryClass
        assert got[arch].startswith("sglang.srt.models."), (arch, got)
    # the registry's own modules and what the two classes import (mellum: the MoE blocks it reuses),
    # not the registry's ~150 model modules
    assert got["defaults_loaded"] is False and len(got["imported"]) < got["model_modules"] // 10, got
