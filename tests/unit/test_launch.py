"""The demo launcher's pieces that need no processes: flags round trip, progress rendering."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from workbench.cli.argv import join_command
from workbench.cli.command import build_config, build_parser
from workbench.cli.optimizer_flags import canonical
from workbench.local.demo_table import DemoTable, describe
from workbench.local.launch import LaunchError, peer_arguments


def test_peer_arguments_rebuild_the_same_config(tmp_path: Path) -> None:
    """What a demo peer runs is exactly the config the demo was given."""
    args = build_parser().parse_args(
        [
            "demo",
            "--model",
            "tiny",
            "--inner-steps",
            "7",
            "--inner-lr",
            "0.002",
            "--outer-lr",
            "0.5",
            "--outer-momentum",
            "0.8",
            "--codec",
            "fp16",
            "--rounds",
            "3",
            "--round-seconds",
            "2.5",
            "--batch-size",
            "4",
            "--seed",
            "5",
            "--matchmaking-time",
            "1.5",
            "--averaging-timeout",
            "20",
            "--data",
            str(tmp_path),
        ]
    )
    config = build_config(args)
    config = replace(config, peer=replace(config.peer, run_id="demo-x", min_peers=3))
    flags = peer_arguments(config, name="peer-1", run_dir=tmp_path)
    rebuilt = build_config(build_parser().parse_args(["start", *flags]))
    assert rebuilt.model == config.model
    assert rebuilt.data == config.data
    assert rebuilt.diloco == config.diloco
    assert rebuilt.averaging == config.averaging
    assert rebuilt.train == config.train
    assert rebuilt.peer.run_id == "demo-x" and rebuilt.peer.min_peers == 3 and rebuilt.peer.rounds == 3
    assert rebuilt.peer.round_seconds == 2.5
    assert rebuilt.peer.run_dir == str(tmp_path / "peer-1") and rebuilt.peer.name == "peer-1"


def test_peer_arguments_need_a_preset(tmp_path: Path) -> None:
    config = build_config(build_parser().parse_args(["demo"]))
    config = replace(config, model=replace(config.model, n_layer=3))
    with pytest.raises(LaunchError, match="presets"):
        peer_arguments(config, name="peer-0", run_dir=tmp_path)


def test_demo_table_tracks_rounds_and_bytes() -> None:
    table = DemoTable(peers=2, rounds=4)
    table.update({"peer": "peer-0", "event": "started", "device": "cpu"})
    for step in (1, 2):
        table.update(
            {
                "peer": "peer-0",
                "event": "round",
                "outer_step": step,
                "loss": 3.0,
                "eval_loss": 2.5,
                "group_size": 2,
                "samples_per_second": 30.0,
                "bytes_sent": 2_000_000,
            }
        )
    assert table.rows["peer-0"]["round"] == 2 and table.rows["peer-0"]["sent"] == 4_000_000
    console = Console(width=120, record=True)
    console.print(table.render())
    text = console.export_text()
    assert "round 0/4" in text  # peer-1 has not finished a round yet
    assert "peer-1" in text and "starting" in text and "4.0" in text


def test_describe_round_mentions_a_lone_round() -> None:
    line = describe(
        {
            "peer": "peer-2",
            "event": "round",
            "outer_step": 3,
            "loss": 2.0,
            "eval_loss": 2.1,
            "group_size": 1,
            "samples_per_second": 10.0,
            "alone_reason": "no other peer in this round",
        }
    )
    assert "round   3" in line and "group 1" in line and "alone: no other peer" in line
    assert describe({"peer": "p", "event": "left", "reason": "finished"}) is None


def test_describe_round_counts_a_streaming_runs_rounds_not_its_syncs() -> None:
    """Stop 57, a review: `demo --headless --method streaming --rounds 2` (F=4) said round 8."""
    event = {"peer": "p", "event": "round", "outer_step": 8, "loss": 2.0, "eval_loss": 2.1,
             "group_size": 2, "samples_per_second": 1.0}  # fmt: skip
    assert "round   2 (sync 4/4)" in describe(event, 4)
    assert "round   2 (sync 1/4)" in describe({**event, "outer_step": 5}, 4)


def test_a_reused_run_dir_forgets_a_bigger_demos_peers_and_commands_are_shell_words(tmp_path, monkeypatch):
    """Stop 57, a review: after a demo of 4 peers, one of 2 in the same --run-dir left peer-2's
    and peer-3's events there, and `export` mixed them in; commands.txt was not quoted (a run
    dir with a space could not be pasted back)."""
    import shlex
    import subprocess

    from workbench.local import launch

    run_dir = tmp_path / "my demo"
    for index in range(4):
        (run_dir / f"peer-{index}").mkdir(parents=True)
        (run_dir / f"peer-{index}" / "metrics.jsonl").write_text("{}\n")

    class Started(Exception):
        pass

    def popen(argv, **kwargs):
        raise Started(argv)

    monkeypatch.setattr(subprocess, "Popen", popen)
    config = build_config(build_parser().parse_args(["demo", "--model", "tiny"]))
    swarm = launch.LocalSwarm(config, peers=2, run_dir=run_dir)
    with pytest.raises(Started):
        swarm.start()
    assert (
        not (run_dir / "peer-2" / "metrics.jsonl").exists()
        and not (run_dir / "peer-3" / "metrics.jsonl").exists()
    )
    command = (run_dir / "commands.txt").read_text().strip()
    assert shlex.split(command)[shlex.split(command).index("--run-dir") + 1] == str(run_dir / "peer-0")


def test_data_parallel_method_round_trips(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--method dp cannot use --inner-steps"):  # H is 1
        build_config(build_parser().parse_args(["start", "--method", "dp", "--inner-steps", "30"]))
    config = build_config(build_parser().parse_args(["start", "--method", "dp"]))
    assert config.method == "dp" and config.diloco.inner_steps == 1 and config.diloco.outer_lr == 1.0
    rebuilt = build_config(
        build_parser().parse_args(["start", *peer_arguments(config, name="p", run_dir=tmp_path)])
    )
    assert rebuilt.method == "dp" and rebuilt.diloco == config.diloco
    assert "--method dp" in join_command(config, ["ADDR"])


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            [],
            dict(
                outer_lr=0.7, outer_momentum=0.9, nesterov=True, codec="none", error_feedback=False, delay=0
            ),
        ),
        (["--method", "local_sgd"], dict(outer_lr=1.0, outer_momentum=0.0, nesterov=False, codec="none")),
        (
            ["--method", "sparseloco"],
            dict(outer_lr=1.0, outer_momentum=0.0, codec="topk", error_feedback=True),
        ),
        (
            ["--method", "sparseloco", "--outer-lr", "0.5", "--topk-density", "0.03"],
            dict(outer_lr=0.5, codec="topk", topk_density=0.03),
        ),
        (["--outer-momentum", "0"], dict(outer_momentum=0.0, nesterov=False)),
        (  # its unused topk knobs made the joiners' fingerprint differ: refused as another model
            ["--method", "sparseloco", "--update-codec", "int8"],
            dict(codec="int8", error_feedback=True, error_decay=0.95, topk_density=128 / 4096),
        ),
        (["--method", "sparseloco", "--update-codec", "none"], dict(codec="none", topk_mean="group")),
        (["--delay", "1", "--update-codec", "int8"], dict(delay=1, codec="int8")),
        (["--overlap"], dict(delay=1, overlap=True, eager=None, outer_lr=0.8, outer_momentum=0.3)),
        (
            ["--overlap", "--no-eager"],
            dict(delay=1, overlap=True, eager=False, outer_lr=1.0, outer_momentum=0.0, nesterov=False),
        ),
        (["--delay", "1", "--eager", "--outer-momentum", "0.9"], dict(eager=True, outer_momentum=0.9)),
        (
            ["--method", "sparseloco"],
            dict(topk_chunk=4096, topk_bits=2, topk_density=128 / 4096, error_decay=0.95),
        ),
        (
            [
                "--update-codec",
                "topk",
                "--topk-chunk",
                "64",
                "--topk-bits",
                "2",
                "--error-feedback",
                "--ef-decay",
                "0.9",
            ],
            dict(codec="topk", topk_chunk=64, topk_bits=2, error_feedback=True, error_decay=0.9),
        ),
    ],
)
def test_method_presets_and_overrides(flags: list[str], expected: dict, tmp_path: Path) -> None:
    config = build_config(build_parser().parse_args(["start", *flags]))
    for name, value in expected.items():
        assert getattr(config.diloco, name) == value, name
    # A demo peer (and a joiner from the printed command) rebuilds the same outer config.
    # The knobs the run uses, that is: unused ones (topk's, with int8) are left out of the flags,
    # and out of the fingerprint (canonical), or its joiners were refused as another model.
    rebuilt = build_config(
        build_parser().parse_args(["start", *peer_arguments(config, name="p", run_dir=tmp_path)])
    )
    assert canonical(rebuilt.diloco) == canonical(config.diloco)
    command = join_command(config, ["/ip4/127.0.0.1/tcp/1/p2p/x"]).split()[2:-1]
    joiner = build_config(build_parser().parse_args(["start", *command]))
    assert canonical(joiner.diloco) == canonical(config.diloco)


def test_streaming_method_round_trips_and_checks_its_schedule(tmp_path: Path) -> None:
    config = build_config(
        build_parser().parse_args(["start", "--method", "streaming", "--inner-steps", "48"])
    )
    assert config.method == "streaming" and config.fragments == 4 and config.diloco.outer_lr == 0.7
    rebuilt = build_config(
        build_parser().parse_args(["start", *peer_arguments(config, name="p", run_dir=tmp_path)])
    )
    assert rebuilt.method == "streaming" and rebuilt.fragments == 4 and rebuilt.diloco == config.diloco
    assert "--method streaming --fragments 4" in join_command(config, ["ADDR"])
    with pytest.raises(ValueError, match="divisible"):
        build_config(
            build_parser().parse_args(
                ["start", "--method", "streaming", "--inner-steps", "50", "--fragments", "3"]
            )
        )


def test_model_and_data_flags_reach_every_demo_peer(tmp_path: Path) -> None:
    """A Hugging Face folder, a dataset, a tokenizer and the exporters survive the trip from the
    demo's flags to each peer's."""
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text("{}")
    flags = [
        "--model", str(model), "--block-size", "64", "--dataset", "./corpus", "--dataset-split", "train[:90%]",
        "--streaming", "--text-field", "body", "--tokenizer", "./tok", "--tensorboard", str(tmp_path / "tb"),
        "--wandb", "proj", "--run-dir", str(tmp_path / "run"), "--max-bytes", "5000000",
    ]  # fmt: skip
    config = build_config(build_parser().parse_args(["start", *flags]))
    rebuilt = build_config(
        build_parser().parse_args(["start", *peer_arguments(config, name="p1", run_dir=tmp_path / "run")])
    )
    assert rebuilt.hf_model == str(model) and rebuilt.model.block_size == 64
    assert rebuilt.data == config.data and config.data.max_bytes == 5_000_000
    assert rebuilt.peer.tensorboard == str(tmp_path / "tb" / "p1")  # a folder per peer
    assert (rebuilt.peer.wandb_project, rebuilt.peer.wandb_mode) == ("proj", "offline")
    small = build_config(build_parser().parse_args(["start", "--model", "tiny", "--block-size", "32"]))
    again = build_config(
        build_parser().parse_args(["start", *peer_arguments(small, name="p", run_dir=tmp_path)])
    )
    assert again.model == small.model
    # A preset with its own context: the printed join command carries it (it used to fail).
    assert "--model tiny --block-size 32" in join_command(small, ["ADDR"])
    assert f"--model {model} --block-size 64" in join_command(config, ["ADDR"])


def test_every_inner_training_setting_reaches_every_demo_peer(tmp_path: Path) -> None:
    """The inner AdamW's settings (stop 59: weight decay, betas and warmup got flags) travel
    from the demo's flags to each peer's, as the learning rate and the clip did."""
    flags = ["--inner-lr", "0.002", "--grad-clip", "0.5", "--weight-decay", "0", "--beta1", "0.8"]
    flags += ["--beta2", "0.99", "--warmup-steps", "3", "--threads", "1"]
    config = build_config(build_parser().parse_args(["start", *flags]))
    rebuilt = build_config(
        build_parser().parse_args(["start", *peer_arguments(config, name="p1", run_dir=tmp_path / "run")])
    )
    assert rebuilt.train == config.train and config.train.beta1 == 0.8


def test_a_demo_peer_starts_in_its_own_folder_which_a_reuse_cleans(tmp_path: Path, monkeypatch) -> None:
    """Each peer is started with its own name and --run-dir (a loop over the files a reused
    folder drops once took the name's place: every peer got --name checkpoint.prev.pt); a
    reused folder loses its metrics and checkpoints (a peer refuses a --run-dir holding one),
    a restart keeps them and resumes."""
    import subprocess

    from workbench.local import launch

    started: list[list[str]] = []

    class Process:
        pid = 1

        def __init__(self, argv, **kwargs) -> None:
            started.append(argv)

        def poll(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Process)
    config = build_config(build_parser().parse_args(["demo", "--model", "tiny", "--run-dir", str(tmp_path)]))
    swarm = launch.LocalSwarm(config, peers=2, run_dir=tmp_path)
    old = tmp_path / "peer-1"
    old.mkdir()
    for leftover in ("metrics.jsonl", "checkpoint.pt", "checkpoint.prev.pt", "identity.key"):
        (old / leftover).write_text("an earlier demo's")
    swarm._spawn("start", "peer-1", [])
    argv = started[-1]
    assert argv[argv.index("--name") + 1] == "peer-1"
    assert argv[argv.index("--run-dir") + 1] == str(old)
    assert sorted(p.name for p in old.iterdir()) == ["identity.key", "peer.log"]
    (old / "checkpoint.pt").write_text("this run's")
    swarm._spawn("join", "peer-1", [], again=True)
    assert started[-1][started[-1].index("--name") + 1] == "peer-1" and (old / "checkpoint.pt").exists()


def test_demo_peers_get_their_settings_as_flags_not_from_the_demos_environment(
    tmp_path: Path, monkeypatch
) -> None:
    """A WORKBENCH_* variable the demo leaves out reached every peer it started: WORKBENCH_PORT put
    them all on one port, WORKBENCH_IDENTITY gave them one key (one peer id), WORKBENCH_BLOCK_SIZE
    beat the demo's own --block-size. A secret the notebook passes on purpose still goes."""
    import subprocess

    from workbench.local import launch

    environments: list[dict] = []

    class Process:
        pid = 1

        def __init__(self, argv, **kwargs) -> None:
            environments.append(kwargs["env"])

    monkeypatch.setattr(subprocess, "Popen", Process)
    monkeypatch.setenv("WORKBENCH_PORT", "31337")
    monkeypatch.setenv("WORKBENCH_IDENTITY", str(tmp_path / "one.key"))
    monkeypatch.setenv("SOMETHING_ELSE", "kept")
    config = build_config(build_parser().parse_args(["demo", "--model", "tiny", "--run-dir", str(tmp_path)]))
    swarm = launch.LocalSwarm(config, peers=2, run_dir=tmp_path)
    swarm._spawn("start", "peer-0", [])
    swarm._spawn("start", "peer-1", [], env={"WORKBENCH_RUN_SECRET": "a long secret"})
    for env in environments:
        assert (
            "WORKBENCH_PORT" not in env
            and "WORKBENCH_IDENTITY" not in env
            and env["SOMETHING_ELSE"] == "kept"
        )
        assert env[launch.LAUNCHER_PID]
    assert environments[1]["WORKBENCH_RUN_SECRET"] == "a long secret"


def _demo_without_processes(tmp_path: Path, monkeypatch, codes: dict[str, int | None]):
    """A 3-peer demo whose processes are fakes: peer-N's exit status is ``codes`` (None: running)."""
    import subprocess

    from workbench.local import launch

    started: list[list[str]] = []

    class Process:
        def __init__(self, argv, **kwargs) -> None:
            started.append(argv)
            self.name = argv[argv.index("--name") + 1]
            self.pid = len(started)

        def poll(self):
            return codes.get(self.name)

    monkeypatch.setattr(subprocess, "Popen", Process)
    from dataclasses import replace

    config = build_config(build_parser().parse_args(["demo", "--model", "tiny", "--run-dir", str(tmp_path)]))
    config = replace(config, peer=replace(config.peer, min_peers=3))  # as `workbench demo` sets it
    swarm = launch.LocalSwarm(config, peers=3, run_dir=tmp_path)
    for i in range(3):
        swarm._spawn("join", f"peer-{i}", [])
    return swarm, started


def test_a_restarted_demo_peer_does_not_wait_for_all_of_the_demos_peers(tmp_path: Path, monkeypatch) -> None:
    """The demo starts its peers with --min-peers N; a restart kept it, and a peer restarted
    beside one still stopped waited 120 s in "joining" (a review, stop 59)."""
    codes: dict[str, int | None] = {"peer-0": None, "peer-1": -9, "peer-2": -9}
    swarm, started = _demo_without_processes(tmp_path, monkeypatch, codes)
    assert started[0][started[0].index("--min-peers") + 1] == "3"
    swarm.peers[0].events.append({"event": "started", "addresses": ["/ip4/127.0.0.1/tcp/1/p2p/QmA"]})
    swarm.restart("peer-1")
    argv = build_parser().parse_args(started[-1][3:])
    assert argv.min_peers == 1 and argv.name == "peer-1"


def test_the_demo_tells_each_peer_that_failed_once(tmp_path: Path, monkeypatch) -> None:
    """In the terminal UI a joiner that failed at start-up was never said (it never showed in
    the monitor, and the others waited for it): each failure is said once; a kill is not one."""
    codes: dict[str, int | None] = {"peer-0": None, "peer-1": 1, "peer-2": -9}
    swarm, _ = _demo_without_processes(tmp_path, monkeypatch, codes)
    told: set[int] = set()
    lines = swarm.failures(told)
    assert len(lines) == 1 and lines[0].startswith("peer-1 exited with status 1: the end of its log")
    assert swarm.failures(told) == []
    swarm.peers[0].events.append({"event": "started", "addresses": ["/ip4/127.0.0.1/tcp/1/p2p/QmA"]})
    swarm.restart("peer-1")  # it fails again: said again (a review: the name was the key)
    assert [line[:28] for line in swarm.failures(told)] == ["peer-1 exited with status 1:"]


def test_a_second_demo_in_a_running_demos_folder_is_refused_before_it_removes_anything(
    tmp_path: Path,
) -> None:
    """It removed the running demo's metrics, checkpoints and log, then failed on the peers'
    locks; the first demo never saw its end (a review, stop 59)."""
    import subprocess
    import sys

    from workbench.local import launch

    folder = tmp_path / "peer-0"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("the running demo's\n")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True
    )  # another process: a lock is its process's
    try:
        assert holder.stdout.readline().strip() == "held"
        config = build_config(
            build_parser().parse_args(["demo", "--model", "tiny", "--run-dir", str(tmp_path)])
        )
        with pytest.raises(launch.LaunchError, match=f"peer-0 is running there \\(pid {holder.pid}\\)"):
            launch.LocalSwarm(config, peers=2, run_dir=tmp_path).start(timeout=5)
        assert (folder / "metrics.jsonl").read_text() == "the running demo's\n"
    finally:
        holder.kill()
        holder.wait()


HOLD = """
import sys, time
from pathlib import Path
from workbench.run.checkpoint import hold_run_dir
lock = hold_run_dir(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(60)
"""


def test_the_demos_timeout_covers_the_first_peers_start_up(tmp_path: Path, monkeypatch) -> None:
    """peer-0 was given a fixed 120 s to start whatever --timeout said: a first dataset read or a
    big model on a CPU failed the demo at 120 s (a review, stop 59)."""
    from workbench.local import launch

    given: list[float] = []

    def start(self, timeout: float = 120.0) -> None:
        given.append(timeout)
        raise launch.LaunchError("stop here")

    monkeypatch.setattr(launch.LocalSwarm, "start", start)
    config = build_config(build_parser().parse_args(["demo", "--model", "tiny"]))
    with pytest.raises(launch.LaunchError, match="stop here"):
        launch.run_demo(config, peers=2, run_dir=tmp_path, timeout=900.0, show=print)
    with pytest.raises(launch.LaunchError, match="stop here"):  # the terminal UI's demo too
        launch.run_demo_tui(config, peers=2, run_dir=tmp_path, console=None, timeout=600.0)
    assert given == [900.0, 600.0]


def test_the_mean_group_size_leaves_out_an_overlapped_runs_first_sync(tmp_path: Path, monkeypatch) -> None:
    """An overlapped run's first sync averages nothing yet (group 1, pending): it counted in the
    mean, 3.625 for 4 peers that averaged every round together (a review, stop 59)."""
    import torch

    swarm, _ = _demo_without_processes(tmp_path, monkeypatch, {})
    for peer in swarm.peers:
        torch.save([torch.zeros(2)], peer.directory / "global_params.pt")
        peer.events += [
            {"event": "initial_eval", "eval_loss": 5.0},
            {"event": "round", "group_size": 1, "pending": True, "bytes_sent": 0},
            *({"event": "round", "group_size": 3, "bytes_sent": 10} for _ in range(3)),
            {"event": "done", "outer_rounds": 4, "final_eval_loss": 2.0, "bytes_sent": 10},
        ]
    result = swarm.result(1.0)
    assert result["mean_group_size"] == 3.0 and result["rounds_alone"] == 0


def test_the_demos_bytes_sent_counts_a_restarted_peers_first_process(tmp_path: Path, monkeypatch) -> None:
    """A peer killed and restarted without a checkpoint starts counting its bytes at 0: the
    demo's total (each peer's `done`) left out what its first process sent."""
    import torch

    swarm, _ = _demo_without_processes(tmp_path, monkeypatch, {})
    for peer in swarm.peers:
        torch.save([torch.zeros(2)], peer.directory / "global_params.pt")
        peer.events += [
            {"event": "initial_eval", "eval_loss": 5.0},
            {"event": "round", "group_size": 2, "bytes_sent": 100},
            {"event": "round", "group_size": 2, "bytes_sent": 100},
            {"event": "final_sync", "bytes_sent": 7},
            {"event": "done", "outer_rounds": 2, "final_eval_loss": 2.0, "bytes_sent": 207},
        ]
    restarted = swarm.peers[-1]  # its first process sent 100, the second 207
    restarted.events[1:1] = [{"event": "round", "group_size": 2, "bytes_sent": 100}]
    assert swarm.result(1.0)["bytes_sent"] == 207 * len(swarm.peers) + 100


def test_a_peer_s_events_after_a_line_cut_short_by_a_kill_are_read(tmp_path: Path) -> None:
    """A demo peer killed mid-line and restarted (`f` in the TUI) ends the cut line before its
    next event: the demo's reader raised JSONDecodeError on it (a review, stop 60)."""
    import json
    from types import SimpleNamespace

    from workbench.local.launch import LocalPeer

    peer = LocalPeer("peer-1", tmp_path, SimpleNamespace(poll=lambda: None))
    good = {"event": "round", "time": 2.0, "outer_step": 1}
    (tmp_path / "metrics.jsonl").write_text('{"event": "round", "time": 1\n' + json.dumps(good) + "\n")
    assert peer.poll_events() == [good] and peer.events == [good]
