"""``harness topology check``: Ray's verdict and the missing resource, one line; bad input exits 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness import cli

pytestmark = pytest.mark.est_time(10)


def _harness(*args):
    return subprocess.Popen(
        [sys.executable, "-m", "harness.cli", "topology", "check", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_check_on_this_machine_and_simulated():
    # Both start their own local Ray: run them side by side.
    real, sim = _harness("2-gpu-h100"), _harness("2-node-16-gpu-h200", "--simulate")
    out_real, err_real = real.communicate(timeout=300)
    out_sim, err_sim = sim.communicate(timeout=300)
    if out_real.startswith("2-gpu-h100: fits"):
        pytest.skip("this machine has the GPUs: the INFEASIBLE verdict cannot be shown here")
    assert real.returncode == 1, err_real
    assert out_real.splitlines() == [
        "2-gpu-h100: INFEASIBLE: group prefill-0: GPU: needs 1 on one node, the largest node has 0 "
        "[a local Ray on this machine]",
        "hint: 2-gpu-h100 needs 2×H100 (runner 2-gpu-h100); run on that runner, or check with --simulate",
    ]
    assert sim.returncode == 0, err_sim
    assert out_sim.startswith("2-node-16-gpu-h200: fits (") and out_sim.rstrip().endswith(
        "[a local Ray with simulated GPUs]"
    )


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["nope"],
            "harness: unknown topology 'nope'; use one of: 2-gpu-h100, 2-node-16-gpu-h200, 2-node-16-gpu-h200-tp4-tp8, "
            "2-node-2-gpu-h100, 4-gpu-h100-dp-attention-dp2, 4-gpu-h100-tp1-tp2, 4-node-32-gpu-h200, "
            "4-node-32-gpu-h200-dp-attention, 8-gpu-h100-tp1-tp4, 8-gpu-h200, 8-gpu-h200-tp2-tp4, cpu, cpu-tp1-tp2, "
            "cpu-tp1-tp4, cpu-tp2-tp4 "
            "(or a path to a .toml file)",
        ),
        (
            ["cpu", "--simulate", "--ray-address", "127.0.0.1:1"],
            "harness: --simulate starts a local cluster and --ray-address joins one: pass only one",
        ),
        (
            ["cpu", "--ray-address", "127.0.0.1:1"],
            "harness: cannot join the Ray cluster at 127.0.0.1:1: unreachable: nothing accepts connections "
            "(Connection refused); check the address and that the head runs (`ray status` on the head)",
        ),
        (
            ["cpu", "--ray-address", "nohostport"],
            "harness: cannot join the Ray cluster at nohostport: address: not host:port; "
            "pass the head's GCS address, e.g. 10.0.0.1:6379 (`ray status` on the head prints it)",
        ),
        (["cpu", "--timeout", "0"], "harness: --timeout must be > 0, got 0"),
        (
            ["cpu", "--timeout", "inf"],
            "harness: --timeout inf: must be a finite number of seconds above 0 and at most 86400",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, line):
    assert cli.main(["topology", "check", *args]) == 2
    assert capsys.readouterr().err == line + "\n"
