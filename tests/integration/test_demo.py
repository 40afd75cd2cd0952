"""The scripting contract of `workbench demo --json`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.conftest import FAST

pytestmark = pytest.mark.integration


def demo(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    """`workbench demo` with 2 peers and the integration tests' fast settings; later flags win."""
    return subprocess.run(
        [sys.executable, "-m", "workbench", "demo", "--peers", "2", "--headless", "--json", *FAST,
         "--run-dir", str(tmp_path), *flags],
        capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_demo_json_contract(tmp_path):
    result = demo(tmp_path, "--rounds", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout  # stdout holds the JSON object and nothing else
    data = json.loads(lines[0])
    for key in (
        "peers",
        "outer_rounds",
        "initial_loss",
        "final_loss",
        "params_max_abs_diff",
        "bytes_sent",
        "seconds",
    ):
        assert key in data, key
    assert data["peers"] == 2 and data["outer_rounds"] == 2
    assert data["final_loss"] < data["initial_loss"]
    assert data["params_max_abs_diff"] <= 1e-5
    assert data["bytes_sent"] > 0 and data["seconds"] > 0
    assert (tmp_path / "commands.txt").read_text().count("workbench ") == 2


@pytest.mark.parametrize(
    ("method_flags", "peer_flags"),
    [
        (["--method", "sparseloco", "--topk-density", "0.05"], ["--update-codec topk", "--error-feedback"]),
        (["--update-codec", "int8", "--delay", "1"], ["--update-codec int8", "--delay 1"]),
        (["--method", "dp"], ["--method dp"]),
        (
            # τ = 1: each fragment's all-reduce runs behind the next inner step (real peers)
            ["--method", "streaming", "--inner-steps", "8", "--fragments", "4", "--sync-delay", "1"],
            ["--method streaming --fragments 4 --sync-delay 1"],
        ),
    ],
    ids=["sparseloco", "int8-delayed", "data-parallel", "streaming"],
)
def test_demo_runs_other_methods_over_the_real_swarm(tmp_path, method_flags, peer_flags):
    result = demo(tmp_path, "--rounds", "3", *method_flags)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["outer_rounds"] == 3 and data["rounds_alone"] == 0
    assert data["params_max_abs_diff"] <= 1e-5
    assert data["final_loss"] < data["initial_loss"]
    commands = (tmp_path / "commands.txt").read_text()
    assert all(flag in commands for flag in peer_flags), commands
