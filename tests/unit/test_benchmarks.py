"""The benchmarks still run: none is in `make test`'s path otherwise, and two broke unnoticed
(train_step's inner step called itself from dae53fd on; overheads' donors served AdamW keys that
the joiner's check, added later, refuses). Each runs here on its smallest input."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from benchmarks import optimizers, overheads
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
    # --no-sweep: every row and code path once (8 runs, not the sweeps' 27), so the test stays
    # well inside its timeout on 2 loaded cores; the sweeps only repeat the same runs.
    out = tmp_path / "optimizers.json"
    done = run(
        "benchmarks.optimizers", "--preset", "tiny", "--steps", "8", "--inner-steps", "4", "--peers", "2",
        "--no-sweep", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    rows = {(r["method"], r["codec"]): r for r in result["rows"]}
    assert {("dp", "fp32"), ("diloco", "fp32"), ("diloco", "int8"), ("diloco-eager", "fp32"),
            ("local_sgd", "fp32"), ("sparseloco-tuned", optimizers.SPARSELOCO_LABEL)} <= set(rows)  # fmt: skip
    assert rows[("dp", "fp32")]["loss_ratio_to_dp"] == 1.0
    for r in rows.values():
        assert math.isfinite(r["final_eval_loss"]) and r["final_eval_loss"] < r["initial_eval_loss"], r
        assert r["bytes_per_peer"] > 0
    assert rows[("diloco", "fp32")]["byte_ratio_to_dp"] == 4.0  # H=4: a sync every 4 steps, fp32 both
    assert rows[("diloco", "int8")]["bytes_per_peer"] < rows[("diloco", "fp32")]["bytes_per_peer"]
    assert rows[("dp", "fp32")]["outer_rounds"] == 8 and rows[("diloco", "fp32")]["outer_rounds"] == 2
    assert {t["status"] for t in result["targets"][:4]} <= {"PASS", "MISS"}  # every compared row ran


def test_the_join_benchmark_s_donors_serve_a_state_a_joiner_accepts() -> None:
    state = overheads.donor_state(100, seed=1)
    _check_shapes(state.params, state.momentum, state.pending, state.inner_keys, state.inner)
