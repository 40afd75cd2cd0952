"""`workbench simulate --json`: the scripting contract, on a small corpus made here."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.cli.command import main

KEYS = ("method", "peers", "inner_steps", "codec", "steps", "final_eval_loss", "bytes_per_peer", "seconds")


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    text = "".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(3000))
    (tmp_path / "a.py").write_text(text)
    (tmp_path / "b.txt").write_text(text[::-1])
    return tmp_path


def run(capsys, *args: str) -> dict:
    code = main(["simulate", "--model", "tiny", "--batch-size", "4", "--json", *args])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and len(out) == 1, out
    return json.loads(out[0])


def test_simulate_json_contract(capsys, corpus: Path) -> None:
    data = run(
        capsys,
        "--data",
        str(corpus),
        "--method",
        "diloco",
        "--peers",
        "3",
        "--inner-steps",
        "4",
        "--codec",
        "int8",
        "--steps",
        "8",
    )
    for key in KEYS:
        assert key in data, key
    assert data["method"] == "diloco" and data["peers"] == 3 and data["inner_steps"] == 4
    assert data["codec"] == "int8" and data["steps"] == 8 and data["outer_rounds"] == 2
    assert data["final_eval_loss"] < data["initial_eval_loss"]
    assert data["params_max_abs_diff"] == 0.0


def test_bytes_follow_the_method_and_codec(capsys, corpus: Path) -> None:
    common = ["--data", str(corpus), "--peers", "2", "--steps", "8"]
    dp = run(capsys, *common, "--method", "dp")  # H is 1: --inner-steps would be an error
    common += ["--inner-steps", "4"]
    diloco = run(capsys, *common, "--method", "diloco")
    int8 = run(capsys, *common, "--method", "diloco", "--codec", "int8")
    sparse = run(capsys, *common, "--method", "sparseloco", "--density", "0.01")
    assert dp["bytes_per_peer"] == 4 * diloco["bytes_per_peer"]  # 8 syncs vs 2, same fp32 payload
    assert 3.5 < diloco["bytes_per_peer"] / int8["bytes_per_peer"] < 4  # 1 B + a 4 B scale per 64
    assert diloco["bytes_per_peer"] / sparse["bytes_per_peer"] > 50  # 1 % of entries, 6 B each


def test_sparseloco_averages_each_kept_coordinate_over_its_keepers_unless_told(capsys, corpus: Path) -> None:
    common = ["--data", str(corpus), "--peers", "2", "--steps", "8", "--inner-steps", "4", "--method", "sparseloco"]  # fmt: skip
    kept = run(capsys, *common)
    group = run(capsys, *common, "--topk-mean", "group")
    assert kept["config"]["topk_mean"] == "kept" and group["config"]["topk_mean"] == "group"
    assert kept["bytes_per_peer"] == group["bytes_per_peer"]  # the mask is implied by the indices
    assert kept["final_eval_loss"] != group["final_eval_loss"]
    int8 = run(capsys, *common, "--update-codec", "int8")  # another codec: the whole group's mean
    assert int8["config"]["codec"] == "int8" and int8["config"]["topk_mean"] is None


def test_the_config_shows_the_streaming_merge_weight_the_run_uses(capsys, corpus: Path) -> None:
    common = ["--data", str(corpus), "--peers", "2", "--steps", "8", "--inner-steps", "4", "--method", "streaming", "--fragments", "2"]  # fmt: skip
    assert run(capsys, *common)["config"]["alpha"] == 0.0  # merged at once: the global fragment
    assert run(capsys, *common, "--sync-delay", "1")["config"]["alpha"] == 0.5  # the paper's, with τ > 0
    assert run(capsys, *common, "--sync-delay", "1", "--alpha", "0.25")["config"]["alpha"] == 0.25
    chosen = run(capsys, *common[:-2])  # no --fragments: the top-level keys say what was used
    assert (
        (chosen["fragments"], chosen["sync_delay"])
        == (4, 0)
        == (chosen["config"]["fragments"], chosen["config"]["sync_delay"])
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "dp", "--codec", "int8"], "--method dp cannot use --update-codec"),
        (["--method", "dp", "--inner-steps", "10"], "--method dp cannot use --inner-steps"),
        (["--method", "diloco", "--topk-chunk", "64"], "update codec is none: add --update-codec topk"),
        (
            ["--method", "sparseloco", "--update-codec", "int8", "--topk-density", "0.1", "--topk-bits", "2"],
            "--topk-density, --topk-bits shape the topk update codec, and this run's update codec is int8",
        ),
        (["--method", "diloco", "--ef-decay", "0.9"], "error feedback is off: add --error-feedback"),
        (["--method", "local_sgd", "--outer-lr", "0.5"], "--method local_sgd cannot use --outer-lr"),
        (["--method", "sparseloco", "--outer-momentum", "0.9"], "error feedback stands in"),
        (["--method", "diloco", "--alpha", "0.5"], "--method diloco cannot use --alpha"),
        (["--no-eager"], "add --overlap"),
        (["--straggler", "x"], "RANK:FRACTION"),
        (["--straggler", "9:0.5"], "straggler"),
        (["--peers", "0"], "peers"),
        (["--density", "0"], "density"),
        (["--speeds", "1,fast"], "argument --speeds: must be positive numbers"),
        (["--peers", "2", "--speeds", "1,1,1"], "one positive speed per peer"),
        (["--method", "dp", "--round-seconds", "5"], "--round-seconds apply to round-based methods"),
        (["--round-seconds", "-1"], "--round-seconds: must be in [0, 86400]"),
        (["--method", "diloco", "--topk-mean", "kept"], "keeps them all"),
        (
            ["--method", "streaming", "--update-codec", "topk", "--topk-mean", "kept"],
            "local_sgd and sparseloco",
        ),
    ],
)
def test_bad_simulate_input_is_one_line(capsys, corpus: Path, args: list[str], message: str) -> None:
    code = main(["simulate", "--model", "tiny", "--data", str(corpus), "--steps", "2", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    # "error: ..." from the command, "workbench simulate: error: ..." from a flag's own bounds
    assert len(err) == 1 and "error: " in err[0] and message in err[0], err


def test_simulate_reports_the_virtual_clock(capsys, corpus: Path) -> None:
    common = [
        "--data",
        str(corpus),
        "--peers",
        "2",
        "--steps",
        "8",
        "--inner-steps",
        "4",
        "--speeds",
        "1,0.5",
    ]
    fixed = run(capsys, *common)
    boxed = run(capsys, *common, "--round-seconds", "4", "--step-seconds", "1")
    assert (fixed["virtual_seconds"], fixed["utilization"], fixed["steps_per_peer"]) == (
        16.0,
        [0.5, 1.0],
        [8, 8],
    )
    assert (boxed["virtual_seconds"], boxed["utilization"], boxed["steps_per_peer"]) == (
        8.0,
        [1.0, 1.0],
        [8, 4],
    )
    assert boxed["config"]["round_seconds"] == 4.0 and boxed["config"]["speeds"] == [1.0, 0.5]


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_simulation_started_in_the_background_stops_on_a_signal(corpus: Path, how) -> None:
    """Started from a script (`workbench simulate ... &`, where the shell makes it ignore
    SIGINT) or stopped by a service manager: it stops within a step, says so in one line and
    exits 130, instead of training its virtual peers on to the end of the run."""
    process = subprocess.Popen(
        [sys.executable, "-m", "workbench", "simulate", "--model", "tiny", "--batch-size", "4"]
        + ["--steps", "1000000", "--data", str(corpus)],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert "loaded corpus" in process.stderr.readline()
        time.sleep(2)  # training, most likely (an interrupted first evaluation stops the same way)
        process.send_signal(how)
        err = process.communicate(timeout=60)[1]
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert err.strip().splitlines()[-1] == "stopped.", err
    assert "Traceback" not in err and "terminate called" not in err, err


def test_a_diverged_simulation_says_so() -> None:
    """`simulate --outer-lr 10 --inner-lr 0.999` ended at 24712 from 5.37 with exit 0 and no word."""
    from workbench.simulate import diverged

    assert "diverged; lower --outer-lr or --inner-lr" in diverged(5.369, 24712.78)
    assert "5.369 -> nan" in diverged(5.369, float("nan"))
    assert diverged(5.369, 2.6) is None and diverged(5.369, 5.4) is None  # learned, or about flat


def test_a_model_with_dropout_is_said_to_make_the_simulation_unrepeatable(caplog) -> None:
    """The virtual peers are threads sharing torch's generator: with dropout layers (a Hugging
    Face config's 0.1) the masks follow the threads' timing, and one seed gave three losses."""
    import torch

    from workbench.simulate import _warn_of_dropout

    with caplog.at_level("WARNING"):
        _warn_of_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)))
        _warn_of_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))
    assert [r.getMessage() for r in caplog.records] == [
        "the model has dropout (p=0.1): the virtual peers share torch's generator, so a run is not "
        "repeatable for its seed; set the dropout to 0 for one that is"
    ]


def test_the_inner_optimizer_flags_reach_the_simulated_peers(capsys, corpus: Path, monkeypatch) -> None:
    """Weight decay, betas and warmup had no flags: a researcher could not compare them, and
    `simulate` built its inner AdamW from the defaults whatever a config file said."""
    import workbench.simulate

    used = {}
    real = workbench.simulate.run_simulation

    def recording(spec, **kwargs):  # type: ignore[no-untyped-def]
        used["train"] = kwargs["train"]
        return real(spec, **kwargs)

    monkeypatch.setattr(workbench.simulate, "run_simulation", recording)
    flags = ["--weight-decay", "0", "--beta1", "0.8", "--beta2", "0.99", "--warmup-steps", "0",
             "--grad-clip", "0.5"]  # fmt: skip
    run(capsys, "--data", str(corpus), "--peers", "2", "--steps", "4", "--inner-steps", "2", *flags)
    train = used["train"]
    assert (train.weight_decay, train.beta1, train.beta2, train.warmup_steps, train.grad_clip) == (
        0,
        0.8,
        0.99,
        0,
        0.5,
    )
