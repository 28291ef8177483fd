"""Bad topology files: each gives exactly one clear line naming the file, the key and the fix."""

from __future__ import annotations

import pytest

from harness import topology

GOOD = """\
name = "{name}"
runner = "2-gpu-h100"

[cluster]
nodes = 1
gpus_per_node = 2
gpu_model = "H100"
gpu_memory_gb = 80

[roles.prefill]
tp = 1
gpus_per_rank = 1

[roles.decode]
tp = 1
gpus_per_rank = 1
"""

# (file name, edit applied to GOOD, the exact error line)
BAD = [
    (
        "unknown-key",
        lambda t: t.replace("tp = 1\n", "tp = 1\ntensor_parallel = 2\n", 1),
        "unknown-key.toml: roles.prefill.tensor_parallel: unknown key; remove it or use one of: "
        "count, cpus_per_rank, dp, dp_attention, engine_args, gpus_per_rank, kind, node, tp",
    ),
    (
        "gpus-do-not-add-up",
        lambda t: t.replace("[roles.decode]\ntp = 1", "[roles.decode]\ntp = 1\ncount = 2"),
        "gpus-do-not-add-up.toml: roles: GPUs do not add up: roles need 3 (prefill 1, decode 2) but the cluster has 2; "
        "lower count/tp/dp/gpus_per_rank or raise cluster.gpus_per_node / cluster.nodes",
    ),
    (
        "tp-does-not-divide",
        lambda t: t.replace("gpus_per_node = 2", "gpus_per_node = 8").replace(
            "[roles.prefill]\ntp = 1", "[roles.prefill]\ntp = 3"
        ),
        "tp-does-not-divide.toml: roles.prefill.tp: tp × gpus_per_rank = 3 does not divide gpus_per_node = 8; "
        "choose tp so that 8 is a multiple of tp × gpus_per_rank",
    ),
    (
        "node-out-of-range",
        lambda t: t.replace("[roles.decode]\ntp = 1", "[roles.decode]\nnode = 1\ntp = 1"),
        "node-out-of-range.toml: roles.decode.node: node 1 does not exist (cluster has 1); "
        "use a node index from 0 to 0",
    ),
    (
        "wrong-type",
        lambda t: t.replace("gpus_per_node = 2", 'gpus_per_node = "2"'),
        "wrong-type.toml: cluster.gpus_per_node: expected int, got '2'; set cluster.gpus_per_node to a int",
    ),
    (
        "missing-decode",
        lambda t: t[: t.index("[roles.decode]")],
        "missing-decode.toml: roles.decode: missing; add a [roles.decode] table (a PD topology needs both)",
    ),
    (
        "missing-gpu-model",
        lambda t: t.replace('gpu_model = "H100"\n', ""),
        "missing-gpu-model.toml: cluster.gpu_model: missing for a GPU cluster; "
        'add gpu_model = "H100" (or the model you need)',
    ),
    (
        "name-mismatch",
        lambda t: t.replace('name = "name-mismatch"', 'name = "other"'),
        "name-mismatch.toml: name: 'other' differs from the file name; set name = \"name-mismatch\" or rename the file",
    ),
    (
        "unknown-role-kind",
        lambda t: t + '\n[roles.cache]\nkind = "kv-cache"\n',
        "unknown-role-kind.toml: roles.cache.kind: unknown role kind 'kv-cache'; use one of prefill, decode, router",
    ),
    (
        "dp-contradicts-engine-args",
        lambda t: t.replace(
            "[roles.decode]\ntp = 1", '[roles.decode]\ntp = 1\ndp = 1\nengine_args = ["--dp-size", "2"]'
        ),
        "dp-contradicts-engine-args.toml: roles.decode.dp: is 1 but engine_args say --dp-size 2; "
        "drop roles.decode.dp (it is read from engine_args) or make the two agree",
    ),
    (
        "dp-attention-contradicts-engine-args",
        lambda t: t.replace(
            "[roles.decode]\ntp = 1",
            '[roles.decode]\ntp = 1\ndp_attention = false\nengine_args = ["--enable-dp-attention", "--dp-size=2"]',
        ),
        "dp-attention-contradicts-engine-args.toml: roles.decode.dp_attention: is false but engine_args say "
        "--enable-dp-attention; drop roles.decode.dp_attention (it is read from engine_args) or make the two agree",
    ),
    (
        "tp-contradicts-engine-args",
        lambda t: t.replace("[roles.decode]\ntp = 1", '[roles.decode]\ntp = 1\nengine_args = ["--tp-size", "2"]'),
        "tp-contradicts-engine-args.toml: roles.decode.tp: is 1 but engine_args say --tp-size 2; "
        "drop roles.decode.tp (it is read from engine_args) or make the two agree",
    ),
    (
        "dp-size-not-a-number",
        lambda t: t.replace("[roles.decode]\ntp = 1", '[roles.decode]\ntp = 1\nengine_args = ["--dp-size", "many"]'),
        "dp-size-not-a-number.toml: roles.decode.engine_args: --data-parallel-size 'many' is not a whole number ≥ 1; "
        'write e.g. ["--dp-size", "2"]',
    ),
    (
        "gpus-on-cpu-cluster",
        lambda t: t.replace("gpus_per_node = 2", "gpus_per_node = 0"),
        "gpus-on-cpu-cluster.toml: roles.prefill.gpus_per_rank: asks for 1 GPU(s) on a cluster without GPUs; "
        "set gpus_per_rank = 0 or give [cluster] gpus_per_node",
    ),
    (  # before: accepted, and `harness topology show` then looped over 9.2e18 nodes
        "nodes-huge",
        lambda t: t.replace("nodes = 1", "nodes = 9223372036854775807"),
        "nodes-huge.toml: cluster.nodes: must be ≤ 1024, got 9223372036854775807; set cluster.nodes to at most 1024",
    ),
    (
        "gpu-memory-nan",
        lambda t: t.replace("gpu_memory_gb = 80", "gpu_memory_gb = nan"),
        "gpu-memory-nan.toml: cluster.gpu_memory_gb: must be a finite number from 1 to 4096, got nan; "
        "set the memory of one GPU in GB, e.g. 80",
    ),
    (
        "cpus-inf",
        lambda t: t.replace("tp = 1\n", "tp = 1\ncpus_per_rank = inf\n", 1),
        "cpus-inf.toml: roles.prefill.cpus_per_rank: must be a finite number from 0 to 4096, got inf; "
        "use a small fraction such as 0.1",
    ),
]


def test_the_template_is_valid(tmp_path):
    p = tmp_path / "good.toml"
    p.write_text(GOOD.format(name="good"))
    assert topology.load(p).total_gpus == 2


@pytest.mark.parametrize("name, edit, line", BAD, ids=[b[0] for b in BAD])
def test_bad_topology_gives_one_exact_line(tmp_path, name, edit, line):
    p = tmp_path / f"{name}.toml"
    p.write_text(edit(GOOD.format(name=name)))
    with pytest.raises(topology.TopologyError) as e:
        topology.load(p)
    assert str(e.value) == line
    assert "\n" not in str(e.value)


def test_not_toml_names_the_file(tmp_path):
    p = tmp_path / "broken.toml"
    p.write_text("name = \n")
    with pytest.raises(topology.TopologyError, match=r"^broken\.toml: not valid TOML \(.*\); fix the syntax$"):
        topology.load(p)


def test_a_file_that_is_not_utf8_or_is_a_directory_is_one_line(tmp_path):
    bad = tmp_path / "latin.toml"
    bad.write_bytes(b'name = "caf\xe9"\n')
    with pytest.raises(
        topology.TopologyError, match=r"^latin\.toml: not UTF-8 text \(byte 11\); save the file as UTF-8$"
    ):
        topology.load(bad)
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(topology.TopologyError, match=r"dir\.toml: is a directory, not a topology file; "):
        topology.load(tmp_path / "dir.toml")


def test_bad_topology_in_the_cli_is_one_line_and_exit_2(tmp_path, capsys):
    from harness import cli

    p = tmp_path / "node-out-of-range.toml"
    p.write_text(BAD[3][1](GOOD.format(name="node-out-of-range")))
    assert cli.main(["topology", "show", str(p)]) == 2
    err = capsys.readouterr().err
    assert err == f"harness: {BAD[3][2]}\n"


def test_parallelism_is_read_from_the_engine_args_when_not_given(tmp_path):
    p = tmp_path / "derived.toml"
    p.write_text(
        GOOD.format(name="derived")
        .replace("gpus_per_node = 2", "gpus_per_node = 4")
        .replace(
            "[roles.decode]\ntp = 1",
            '[roles.decode]\nengine_args = ["--tp", "2", "--enable-dp-attention", "--dp-size", "2"]',
        )
    )
    decode = topology.load(p).role("decode")
    assert (decode.tp, decode.dp, decode.dp_attention) == (2, 2, True)
    assert (decode.groups, decode.total_gpus) == (1, 2)  # attention-DP replicas share their TP group's GPUs


def test_the_shipped_8_gpu_topology_says_what_its_engine_args_say():
    for role in topology.get("8-gpu-h200").roles_of("decode") + topology.get("8-gpu-h200").roles_of("prefill"):
        assert (role.tp, role.dp, role.dp_attention, role.total_gpus) == (4, 4, True, 4), role


def test_topology_show_is_a_table_and_json_on_request(capsys):
    import json

    from harness import cli

    assert cli.main(["topology", "show", "8-gpu-h200"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("8-gpu-h200: 1 node × 8 H200")
    assert out[1].strip().startswith("8×H200 (runner 8-gpu-h200) · transfer mooncake")
    head = out[3].split()
    assert head[:7] == ["role", "kind", "count", "tp", "dp", "dp-attention", "GPUs/rank"]
    decode = next(line for line in out[5:] if line.startswith("decode "))
    assert decode.split()[:8] == ["decode", "decode", "1", "4", "4", "yes", "1", "4"]
    assert decode.endswith("--enable-dp-attention --dp-size 4")
    assert cli.main(["topology", "show", "8-gpu-h200", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["name"]: (r["dp"], r["dp_attention"]) for r in data["roles"]}["decode"] == (4, True)
