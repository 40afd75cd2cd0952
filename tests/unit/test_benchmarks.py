"""The benchmarks still run: none is in `make test`'s path otherwise, and two broke unnoticed
(train_step's inner step called itself from dae53fd on; overheads' donors served AdamW keys that
the joiner's check, added later, refuses). Each runs here on its smallest input."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks import overheads
from swarm.download import _check_shapes


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120)


def test_train_step_measures_a_tiny_model(tmp_path) -> None:
    out = tmp_path / "train_step.json"
    done = run(
        "benchmarks.train_step", "--preset", "tiny", "--steps", "2", "--batch-size", "2", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(out.read_text())["results"]
    assert row["all_finite"] and row["tokens_per_second"] > 0 and row["outer_step_seconds"] > 0


def test_trust_measures_the_sketches(tmp_path) -> None:
    out = tmp_path / "trust.json"
    done = run("benchmarks.trust", "--mb", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())


def test_tui_refresh_measures_a_small_swarm(tmp_path) -> None:
    out = tmp_path / "tui_refresh.json"
    done = run("benchmarks.tui_refresh", "--peers", "4", "--refreshes", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())


def test_optimizers_compares_the_methods_on_a_tiny_run(tmp_path) -> None:
    out = tmp_path / "optimizers.json"
    done = run(
        "benchmarks.optimizers", "--preset", "tiny", "--steps", "8", "--inner-steps", "4", "--peers", "2",
        "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())


def test_the_join_benchmark_s_donors_serve_a_state_a_joiner_accepts() -> None:
    state = overheads.donor_state(100, seed=1)
    _check_shapes(state.params, state.momentum, state.pending, state.inner_keys, state.inner)
