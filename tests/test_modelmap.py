"""Model resolution for real-server suites (``--model NAME=PATH``, ``HARNESS_MODEL_<NAME>``, tiny on cpu)."""

from __future__ import annotations

import pytest

from harness import topology
from harness.engines.server import modelmap
from harness.engines.server.modelmap import ModelError, env_var, overrides, resolve
from harness.engines.server.models import MODELS

CPU = topology.get("cpu")
H100 = topology.get("2-gpu-h100")
H200 = topology.get("8-gpu-h200")


def model_dir(root, name="m"):
    d = root / name
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def test_env_var_names():
    assert env_var("tiny-llama") == "HARNESS_MODEL_TINY_LLAMA"
    assert env_var("tiny-mellum-swa") == "HARNESS_MODEL_TINY_MELLUM_SWA"
    assert env_var("dsv4") == "HARNESS_MODEL_DSV4"
    assert modelmap.NAMES == ("tiny-llama", "tiny-mellum-swa", "dsv4")


def test_option_and_env_give_validated_dirs_and_the_option_wins(tmp_path):
    a, b, c = model_dir(tmp_path, "a"), model_dir(tmp_path, "b"), model_dir(tmp_path, "c")
    got = overrides(
        [f"dsv4={a}", f"tiny-llama={b}"], {"HARNESS_MODEL_DSV4": str(c), "HARNESS_MODEL_TINY_MELLUM_SWA": str(c)}
    )
    assert got == {"dsv4": a.resolve(), "tiny-llama": b.resolve(), "tiny-mellum-swa": c.resolve()}
    assert overrides(None, {}) == {}
    assert overrides(None, {"HARNESS_MODEL_DSV4": ""}) == {}  # an empty var means not given


@pytest.mark.parametrize(
    "value, message",
    [
        ("dsv4", "--model 'dsv4': write NAME=PATH, e.g. --model dsv4=/models/DeepSeek-V4"),
        ("=/x", "--model '=/x': write NAME=PATH"),
        ("dsv4=", "--model 'dsv4=': write NAME=PATH"),
        ("llama=/x", "unknown model name 'llama' in --model llama=/x: use one of tiny-llama, tiny-mellum-swa, dsv4"),
    ],
)
def test_malformed_option_values_are_one_clear_line(value, message):
    with pytest.raises(ModelError) as e:
        overrides([value], {})
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


def test_unusable_directories_name_the_source_and_the_fix(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = {
        f"dsv4={tmp_path / 'missing'}": "does not exist; give a local model directory (no hub download)",
        f"dsv4={tmp_path / 'file'}": "is not a directory; give the model directory, not a file in it",
        f"dsv4={tmp_path / 'empty'}": "has no config.json; give a Hugging Face model directory",
    }
    for value, fix in cases.items():
        with pytest.raises(ModelError) as e:
            overrides([value], {})
        assert str(e.value).startswith(f"--model {value}: ") and str(e.value).endswith(fix), str(e.value)
    with pytest.raises(ModelError, match=r"^env HARNESS_MODEL_DSV4: .* does not exist"):
        overrides(None, {"HARNESS_MODEL_DSV4": str(tmp_path / "missing")})


def test_a_name_given_twice_or_an_unknown_env_var_is_an_error(tmp_path):
    d = model_dir(tmp_path)
    with pytest.raises(ModelError, match="--model dsv4=... is given twice; give each model once"):
        overrides([f"dsv4={d}", f"dsv4={d}"], {})
    with pytest.raises(
        ModelError,
        match="env HARNESS_MODEL_DSV3: no model is called that; use one of "
        "HARNESS_MODEL_TINY_LLAMA, HARNESS_MODEL_TINY_MELLUM_SWA, HARNESS_MODEL_DSV4",
    ):
        overrides(None, {"HARNESS_MODEL_DSV3": str(d)})


def test_given_model_wins_on_every_topology(tmp_path):
    d = model_dir(tmp_path)
    for topo in (CPU, H100, H200):
        assert resolve("tiny-llama", {"tiny-llama": d}, topo) == d
        assert resolve("dsv4", {"dsv4": d}, topo) == d


def test_cpu_builds_an_unmapped_tiny_model_locally(tmp_path):
    spec = MODELS["tiny-llama"]
    cached = tmp_path / f"{spec.name}-{spec.fingerprint()}"  # a finished build: ensure_model returns it
    cached.mkdir()
    (cached / "config.json").write_text("{}")
    assert resolve("tiny-llama", {}, CPU, cache_dir=tmp_path) == cached


def test_gpu_topologies_need_a_given_model(tmp_path):
    with pytest.raises(ModelError) as e:
        resolve("tiny-llama", {}, H100, cache_dir=tmp_path)
    assert str(e.value) == (
        "topology 2-gpu-h100 runs real models: give model 'tiny-llama' with --model tiny-llama=PATH "
        "or HARNESS_MODEL_TINY_LLAMA=PATH (a local model directory; no hub download)"
    )
    assert not list(tmp_path.iterdir()), "a tiny model was built for a GPU topology"
    with pytest.raises(
        ModelError, match="topology 8-gpu-h200 runs real models: give model 'dsv4' with --model dsv4=PATH"
    ):
        resolve("dsv4", {}, H200)


def test_dsv4_is_never_built_and_unknown_names_fail():
    with pytest.raises(
        ModelError, match="model 'dsv4' is not built locally: give it with --model dsv4=PATH or HARNESS_MODEL_DSV4=PATH"
    ):
        resolve("dsv4", {}, CPU)
    with pytest.raises(ModelError, match="unknown model name 'gpt2' in a suite's model"):
        resolve("gpt2", {}, CPU)
