"""Unit tests for the `workbench` command line: flags -> config tree, user errors -> one line.

No test here starts hivemind: every bad value must be refused at config time, and the
``no_peers`` fixture turns any attempt to start a peer, a DHT or a demo swarm into a failure.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

import swarm.dht
import workbench.local.launch
import workbench.run.peer
from swarm.errors import SwarmError
from swarm.monitor import RECORD_FORMAT
from workbench.cli.argv import join_command
from workbench.cli.command import EXIT_USER_ERROR, build_config, build_parser, main
from workbench.config import PeerConfig, RunConfig
from workbench.run.data import ByteCorpus, DataConfig, DataError
from workbench.run.model import small, tiny

PEER_ID = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
ADDRESS = f"/ip4/203.0.113.7/tcp/31337/p2p/{PEER_ID}"


class WouldStartPeers(AssertionError):
    """Raised by the fakes below: a unit test reached code that starts real peers."""


@pytest.fixture(autouse=True)
def no_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise WouldStartPeers("a CLI unit test tried to start a peer, a DHT or a demo swarm")

    monkeypatch.setattr(workbench.run.peer, "run_peer", refuse)
    monkeypatch.setattr(workbench.run.peer, "connect", refuse)
    monkeypatch.setattr(swarm.dht, "start_dht", refuse)
    monkeypatch.setattr(workbench.local.launch, "run_demo", refuse)
    monkeypatch.setattr(workbench.local.launch, "LocalSwarm", refuse)
    # main() configures logging and sets HIVEMIND_LOGLEVEL with setdefault: keep it test-local.
    monkeypatch.setenv("HIVEMIND_LOGLEVEL", "CRITICAL")


def config_of(*argv: str) -> RunConfig:
    return build_config(build_parser().parse_args(list(argv)))


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {err!r}"
    # "error: ..." from the command, "workbench start: error: ..." from the flags' own checks
    assert lines[0].startswith(("error: ", "workbench")) and "error: " in lines[0], lines[0]
    assert out == "", f"nothing on stdout for a user error, got {out!r}"
    return lines[0]


# --- defaults -----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["start"], ["join", ADDRESS]])
def test_peer_defaults_are_the_documented_ones(argv: list[str]) -> None:
    config = config_of(*argv)
    assert config.diloco.inner_steps == 50
    assert config.diloco.outer_lr == 0.7
    assert config.diloco.outer_momentum == 0.9
    assert config.diloco.nesterov is True
    assert config.model == small()
    assert config.averaging.compression == "none"
    assert config.averaging.matchmaking_time == 2.0 and config.averaging.averaging_timeout == 30.0
    assert config.data.path is None and config.data.batch_size == 16
    assert config.train.inner_lr == 1e-3 and config.train.threads == 0
    assert config.peer.run_id == "workbench" and config.peer.rounds == 0 and config.peer.min_peers == 1
    assert config.network.host == "127.0.0.1" and config.network.port == 0
    assert config.network.announce == [] and config.network.client_mode is False
    assert config.network.connect_timeout == 20.0


def test_start_has_no_bootstrap_peers_and_join_has_them() -> None:
    assert config_of("start").network.initial_peers == []
    other = f"/ip6/::1/tcp/4000/p2p/{PEER_ID}"
    assert config_of("join", ADDRESS, other).network.initial_peers == [ADDRESS, other]


def test_demo_defaults() -> None:
    args = build_parser().parse_args(["demo"])
    assert (args.inner_steps, args.rounds, args.threads, args.peers, args.model) == (20, 8, 1, 4, "small")
    assert args.headless is False and args.json is False and args.timeout == 900.0
    config = build_config(args)
    assert config.diloco.inner_steps == 20 and config.peer.rounds == 8 and config.train.threads == 1
    assert config.model == small()
    assert config.network.initial_peers == [] and config.network.host == "127.0.0.1"
    assert config.peer.run_id == "workbench"


def test_flags_reach_the_config() -> None:
    config = config_of(
        "start",
        "--model", "tiny", "--batch-size", "8", "--seed", "3", "--threads", "2", "--inner-steps", "10",
        "--inner-lr", "0.002", "--outer-lr", "0.5", "--outer-momentum", "0", "--rounds", "4",
        "--codec", "int8", "--matchmaking-time", "1", "--averaging-timeout", "10", "--run-id", "exp-2",
        "--name", "alice", "--host", "0.0.0.0", "--port", "31337", "--announce", "/ip4/203.0.113.7/tcp/31337",
        "--connect-timeout", "5", "--min-peers", "3",
    )  # fmt: skip
    assert config.model == tiny()
    assert (config.data.batch_size, config.peer.seed, config.train.threads) == (8, 3, 2)
    assert (config.diloco.inner_steps, config.diloco.outer_lr, config.diloco.outer_momentum) == (10, 0.5, 0.0)
    assert config.diloco.nesterov is False  # no momentum: no Nesterov
    assert config.train.inner_lr == 0.002 and config.peer.rounds == 4
    assert config.averaging.compression == "int8"
    assert (config.averaging.matchmaking_time, config.averaging.averaging_timeout) == (1.0, 10.0)
    assert (config.peer.run_id, config.peer.name, config.peer.min_peers) == ("exp-2", "alice", 3)
    assert (config.network.host, config.network.port) == ("0.0.0.0", 31337)
    assert config.network.announce == ["/ip4/203.0.113.7/tcp/31337"]
    assert config.network.client_mode is False and config.network.connect_timeout == 5.0
    assert config_of("join", ADDRESS, "--client-mode").network.client_mode is True


# --- user errors: one line, exit status 2, no traceback, no peer started ---------------------------------


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        pytest.param(["start", "--inner-steps", "0"], "--inner-steps", id="inner-steps-0"),
        pytest.param(["start", "--outer-lr", "-1"], "--outer-lr", id="outer-lr-negative"),
        pytest.param(["start", "--outer-lr", "11"], "--outer-lr", id="outer-lr-11"),
        pytest.param(["start", "--outer-momentum", "1"], "--outer-momentum", id="momentum-1"),
        pytest.param(["start", "--run-id", "a.b"], "a.b", id="run-id"),
        pytest.param(["join", "not-an-address"], "not-an-address", id="join-garbage"),
        pytest.param(["join", "/ip4/127.0.0.1/tcp/4000"], "peer id", id="join-no-peer-id"),
        pytest.param(["join", "127.0.0.1:4000"], "/ip4/127.0.0.1/tcp/4000", id="join-host-port"),
        pytest.param(["start", "--host", "localhost"], "localhost", id="host-name"),
        pytest.param(["start", "--port", "70000"], "--port", id="port"),
        pytest.param(["start", "--announce", "/ip4/1.2.3.4"], "/ip4/1.2.3.4", id="announce-no-port"),
        pytest.param(
            ["start", "--announce", f"/ip4/1.2.3.4/tcp/1/p2p/{PEER_ID}"], "/p2p/", id="announce-peer-id"
        ),
        pytest.param(["start", "--batch-size", "0"], "--batch-size", id="batch-size-0"),
        pytest.param(["start", "--threads", "-1"], "--threads", id="threads"),
        pytest.param(["start", "--rounds", "-1"], "--rounds", id="rounds"),
        pytest.param(["start", "--min-peers", "0"], "--min-peers", id="min-peers"),
        pytest.param(["start", "--connect-timeout", "0"], "--connect-timeout", id="connect-timeout"),
        pytest.param(
            ["start", "--matchmaking-time", "40", "--averaging-timeout", "30"], "timeout", id="timeouts"
        ),
        pytest.param(["start", "--inner-lr", "2"], "--inner-lr", id="inner-lr"),
        pytest.param(["demo", "--inner-steps", "0"], "--inner-steps", id="demo-inner-steps"),
        pytest.param(["demo", "--rounds", "0", "--run-dir", "{tmp}"], "--rounds", id="demo-rounds-0"),
        pytest.param(["start", "--topk-density", "0"], "--topk-density", id="topk-density-0"),
        pytest.param(["start", "--shard", "5/4"], "shard", id="shard-out-of-range"),
        pytest.param(["start", "--shard", "x"], "I/N", id="shard-garbage"),
        pytest.param(["start", "--secret", "short"], "at least 8", id="secret-short"),
        pytest.param(
            ["join", f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER_ID}", "--owner", "xyz"], "16 hex", id="owner"
        ),
        pytest.param(["start", "--checkpoint-every", "-1"], "--checkpoint-every", id="checkpoint-every"),
        pytest.param(["status", "--run-id", "x"], "multiaddr", id="status-no-address"),
        pytest.param(
            ["status", f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER_ID}", "--watch", "0.1"], "--watch", id="watch"
        ),
        pytest.param(
            ["steer", f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER_ID}", "--key", "k"],
            "nothing to change",
            id="steer-nothing",
        ),
        pytest.param(["replay", "{tmp}/missing.jsonl"], "cannot read the recording", id="replay-missing"),
        pytest.param(
            ["status", "--replay", "{tmp}/missing.jsonl"], "cannot read", id="status-replay-missing"
        ),
        pytest.param(["replay", "{tmp}/garbage"], "not a workbench monitor recording", id="replay-garbage"),
        pytest.param(
            ["status", "--replay", "{tmp}/r.jsonl", "--record", "{tmp}/r2.jsonl"],
            "--replay prints a recorded run, so --record would do nothing",
            id="status-replay-record",
        ),
        pytest.param(
            [
                "status",
                f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER_ID}",
                "--replay",
                "{tmp}/r.jsonl",
                "--owner",
                "0" * 16,
            ],
            "a MULTIADDR, --owner would do nothing: drop them",
            id="status-replay-live-options",
        ),
        pytest.param(["export", "{tmp}", "--out", ""], "--out is empty", id="export-empty-out"),
        pytest.param(
            ["export", "{tmp}", "--tensorboard", ""], "--tensorboard is empty", id="export-empty-tb"
        ),
        pytest.param(
            ["status", f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER_ID}", "--record", "{tmp}/no/such/dir/r.jsonl"],
            "cannot write the recording",
            id="record-unwritable",
        ),
        pytest.param(
            ["status", f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER_ID}", "--record", "{tmp}/garbage"],
            "is not a workbench monitor recording",
            id="record-over-another-file",
        ),
        pytest.param(["config", "show", "--host", "bogus"], "--host", id="config-host"),
        pytest.param(
            ["config", "show", "--averaging-timeout", "1.5"], "averaging timeout", id="config-timeout"
        ),
        pytest.param(["start", "--resume", "{tmp}/no-such-run"], "no such folder", id="resume-missing"),
        pytest.param(["start", "--resume", "{tmp}"], "checkpoint.pt does not exist", id="resume-empty"),
        pytest.param(["start", "--run-dir", "{tmp}/garbage"], "is a file: give a folder", id="run-dir-file"),
        pytest.param(
            ["start", "--run-dir", "{tmp}/garbage/sub"],
            "--run-dir {tmp}/garbage/sub: {tmp}/garbage is a file, not a folder",
            id="run-dir-under-a-file",
        ),
        # An empty path was taken as none (--resume "" started a fresh run, --run-dir "" wrote
        # nothing) or as the current folder (--data ""): refused, in a flag, a file or a variable.
        pytest.param(  # accepted, then every round was one step whatever the box
            ["start", "--method", "dp", "--round-seconds", "5"],
            "--method dp syncs every step (a round is one step): drop --round-seconds",
            id="dp-round-seconds",
        ),
        pytest.param(  # config show refuses what start would (test_streaming checks the hint)
            ["config", "show", "--method", "streaming", "--inner-steps", "1"],
            "divisible by --fragments (4) and no --delay",
            id="streaming-h-1",
        ),
        pytest.param(  # the demo started 4 peers, and each failed on it
            ["demo", "--device", "tpu"],
            "unknown device 'tpu': use auto, cpu, cuda or cuda:N",
            id="demo-device",
        ),
        pytest.param(  # flags that shape what the run would not do were accepted and did nothing
            ["start", "--wandb-mode", "online"], "add --wandb PROJECT", id="wandb-mode-alone"
        ),
        pytest.param(
            ["start", "--streaming"], "--streaming shapes how a --dataset is read", id="streaming-alone"
        ),
        pytest.param(
            ["simulate", "--dataset-subset", "en"],
            "--dataset-subset shapes how a --dataset",
            id="subset-alone",
        ),
        pytest.param(
            ["steer", f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER_ID}", "--key", "k", "--pause", ""],
            "--pause is empty: name a peer",
            id="steer-pause-empty",
        ),
        pytest.param(  # printed nothing and exited 0
            ["status", "--replay", "{tmp}/header.jsonl"], "header.jsonl holds no readings", id="replay-empty"
        ),
        pytest.param(["start", "--resume", ""], "argument --resume: is empty", id="resume-empty-value"),
        pytest.param(["join", ADDRESS, "--run-dir", ""], "argument --run-dir: is empty", id="run-dir-empty"),
        pytest.param(["demo", "--run-dir", " "], "argument --run-dir: is empty", id="demo-run-dir-empty"),
        pytest.param(["simulate", "--data", ""], "argument --data: is empty", id="data-empty"),
        pytest.param(["start", "--identity", ""], "argument --identity: is empty", id="identity-empty"),
        pytest.param(
            ["config", "show", "--config", "{tmp}/empty.toml"], "data = '': is empty", id="toml-empty"
        ),
        pytest.param(
            ["start", "--run-dir", "{tmp}/held"],
            "holds a checkpoint (checkpoint.pt) that this peer's saves would replace: continue from it "
            "with --resume {tmp}/held",
            id="run-dir-with-a-checkpoint",
        ),
        pytest.param(["start", "--shard", "0/0"], "must be in 1..1048576", id="shard-of-0"),
        pytest.param(
            ["start", "--shard", "0/99999999999999999999"], "must be in 1..1048576", id="shard-of-10^20"
        ),
        pytest.param(
            ["start", "--checkpoint-every", "2"],
            "needs a folder to write them in: add --run-dir",
            id="ckpt-no-dir",
        ),
        pytest.param(
            ["status", ADDRESS, "--owner", "xyz"], "--owner takes the 16 hex digits", id="status-owner"
        ),
        pytest.param(
            ["doctor", ADDRESS, "--owner", "0000"], "--owner takes the 16 hex digits", id="doctor-owner"
        ),
        pytest.param(
            ["steer", ADDRESS, "--key", "{tmp}/garbage", "--owner", "ABCDEF0123456789", "--outer-lr", "0.5"],
            "--owner takes the 16 hex digits",
            id="steer-owner",
        ),
        pytest.param(["start", "--shard", "-1/4"], "shard must be in 0..3", id="shard-negative"),
        pytest.param(["start", "--name", "[/b]"], "invalid peer name", id="name-markup"),
        pytest.param(["start", "--config", ""], "--config is empty", id="config-empty"),
        pytest.param(
            ["start", "--client-mode", "--port", "31337", "--announce", "/ip4/203.0.113.7/tcp/31337"],
            "--announce has no use with --client-mode",
            id="client-mode-announce",
        ),
        pytest.param(  # a port picked at start: the announced one cannot lead to it (stop 72)
            ["start", "--announce", "/ip4/203.0.113.7/tcp/31337"],
            "needs a fixed --port",
            id="announce-port-picked",
        ),
        pytest.param(["start", "--error-feedback"], "add --update-codec int8", id="error-feedback-lossless"),
        pytest.param(  # its join command would never connect
            ["start", "--client-mode"],
            "the first peer of a run must accept connections",
            id="start-client-mode",
        ),
        pytest.param(
            ["start", "--resume", "{tmp}/garbage"],
            "is a file: give the folder that holds it (--resume {tmp})",
            id="resume-a-file",
        ),
        pytest.param(
            ["join", ADDRESS, "--secret", "SECRET"], "the join command's placeholder", id="secret-placeholder"
        ),
        pytest.param(
            ["start", ADDRESS],
            "workbench start: error: unrecognized arguments: " + ADDRESS + "; to join a run",
            id="start-with-an-address",
        ),
        pytest.param(  # said by the action's own parser, which has the help for it
            ["config", "keys", "--bogus"],
            "workbench config keys: error: unrecognized arguments: --bogus (see workbench config keys --help)",
            id="config-action-unknown-flag",
        ),
        pytest.param(
            [
                "steer",
                f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER_ID}",
                "--key",
                "k",
                "--pause",
                "b",
                "--resume",
                "b",
            ],
            "--pause and --resume both name b",
            id="steer-pause-and-resume",
        ),
    ],
)
def test_bad_values_exit_2_with_one_error_line(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    hint = hint.replace("{tmp}", str(tmp_path))
    (tmp_path / "garbage").write_bytes(b'{"event": "round"}\n\xff\xfe')  # a metrics file, say
    (tmp_path / "held").mkdir()
    (tmp_path / "empty.toml").write_text('data = ""\n')
    (tmp_path / "header.jsonl").write_text(json.dumps({"format": RECORD_FORMAT}) + "\n")  # no reading
    (tmp_path / "held" / "checkpoint.pt").write_bytes(b"a stopped peer's")
    try:
        status = main(argv)
    except SystemExit as stop:  # out of a flag's bounds: argparse says so before anything starts
        status = stop.code
    assert status == EXIT_USER_ERROR
    line = one_error_line(capsys)
    assert hint in line, f"{hint!r} not in {line!r}"


@pytest.mark.parametrize("peers", ["0", "-1", "2000"])
def test_demo_with_a_bad_peer_count_exits_2(
    peers: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["demo", "--peers", peers, "--run-dir", str(tmp_path)]) == EXIT_USER_ERROR
    assert "peers" in one_error_line(capsys)


@pytest.mark.parametrize("data", ["missing.txt", "empty.txt"])
def test_demo_with_bad_data_says_so_once_before_starting_peers(
    data: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Each peer failed on it, and the demo said "peer-0 exited with status 2 before
    finishing", exit 1 (a review, stop 71)."""
    (tmp_path / "empty.txt").write_text("")
    run_dir = tmp_path / "run"
    assert main(["demo", "--data", str(tmp_path / data), "--run-dir", str(run_dir)]) == EXIT_USER_ERROR
    line = one_error_line(capsys)
    assert str(tmp_path / data) in line and "peer-0" not in line, line
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        pytest.param(["start", "--codec", "zstd"], "invalid choice", id="codec"),
        pytest.param(["start", "--update-codec", "zip"], "invalid choice", id="update-codec"),
        pytest.param(["start", "--delay", "3"], "invalid choice", id="delay-3"),
        pytest.param(
            ["start", "--model", "huge"], "unknown model 'huge' (no such preset or folder)", id="model"
        ),
        pytest.param(["start", "--inner-steps", "ten"], "invalid integer value", id="not-an-int"),
        pytest.param(["join"], "required", id="join-without-address"),
        pytest.param([], "required", id="no-command"),
    ],
)
def test_argparse_rejects_malformed_flags(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == EXIT_USER_ERROR
    out, err = capsys.readouterr()
    assert "Traceback" not in err and out == ""
    assert hint in err
    assert err.strip().splitlines() == [err.strip()]  # one line: no usage block burying it
    assert err.startswith("workbench")  # argparse's "prog: error: ..." line


def test_a_data_error_when_the_peer_starts_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--data is checked when the peer loads its corpus (after build_config); main still prints one line."""

    def fake_run_peer(config: RunConfig, *, on_started=None) -> dict:
        ByteCorpus.load(config.data)  # what the real peer does first with --data
        raise WouldStartPeers("the corpus should not have loaded")

    monkeypatch.setattr(workbench.run.peer, "run_peer", fake_run_peer)
    assert main(["start", "--data", "/nonexistent/path"]) == EXIT_USER_ERROR
    assert "/nonexistent/path" in one_error_line(capsys)


def test_a_missing_data_path_is_a_data_error() -> None:
    with pytest.raises(DataError) as info:
        ByteCorpus.load(DataConfig(path="/nonexistent/path"))
    message = str(info.value)
    assert "/nonexistent/path" in message and "\n" not in message
    assert isinstance(info.value, ValueError)


def test_build_config_raises_value_or_swarm_errors() -> None:
    with pytest.raises(ValueError):
        config_of("start", "--shard", "5/4")
    with pytest.raises(SystemExit):  # out of the flag's bounds: refused while parsing
        config_of("start", "--inner-steps", "0")
    with pytest.raises(SwarmError):
        config_of("join", "nope")


# --- join_command ---------------------------------------------------------------------------------


def test_join_command_of_the_default_config_is_short() -> None:
    assert join_command(RunConfig(), [ADDRESS]) == f"workbench join {ADDRESS}"
    assert join_command(config_of("start"), [ADDRESS]) == f"workbench join {ADDRESS}"


def test_join_command_names_every_non_default_setting() -> None:
    config = RunConfig(
        model=tiny(),
        peer=PeerConfig(run_id="exp-2"),
        diloco=config_of("start", "--inner-steps", "10").diloco,
        averaging=config_of("start", "--codec", "int8").averaging,
    )
    command = join_command(config, [ADDRESS])
    assert command == f"workbench join --run-id exp-2 --model tiny --inner-steps 10 --codec int8 {ADDRESS}"


def test_join_command_with_several_addresses() -> None:
    other = f"/ip6/::1/tcp/31337/p2p/{PEER_ID}"
    assert join_command(RunConfig(), [ADDRESS, other]) == f"workbench join {ADDRESS} {other}"


def _round_trip(start_flags: list[str]) -> tuple[RunConfig, RunConfig]:
    """(the starter's config, the config of a peer that pastes the printed join command)."""
    starter = config_of("start", *start_flags)
    argv = shlex.split(join_command(starter, [ADDRESS]))
    assert argv[:2] == ["workbench", "join"]
    return starter, config_of(*argv[1:])


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--run-id", "exp-2"],
        ["--model", "tiny"],
        ["--model", "medium"],
        ["--inner-steps", "10"],
        ["--codec", "int8"],
        ["--codec", "fp16", "--model", "tiny", "--run-id", "r_1", "--inner-steps", "7"],
        ["--round-seconds", "30", "--inner-steps", "500"],
    ],
    ids=lambda flags: " ".join(flags) or "defaults",
)
def test_join_command_round_trips_through_the_parser(flags: list[str]) -> None:
    starter, joiner = _round_trip(flags)
    assert joiner.peer.round_seconds == starter.peer.round_seconds
    assert joiner.network.initial_peers == [ADDRESS]
    assert joiner.peer.run_id == starter.peer.run_id
    assert joiner.model == starter.model
    assert joiner.diloco.inner_steps == starter.diloco.inner_steps
    assert joiner.averaging.compression == starter.averaging.compression


@pytest.mark.parametrize(
    "flags",
    [
        ["--outer-lr", "0.5"],
        ["--outer-momentum", "0"],
        ["--outer-momentum", "0.5"],
        # The knobs a run does not use yet are the preset's on the joiner too (stop 57: with
        # DiLoCoConfig's, a codec steered to topk compressed the joiners otherwise).
        ["--method", "sparseloco", "--update-codec", "int8"],
        ["--method", "sparseloco", "--update-codec", "none"],
        ["--method", "sparseloco", "--overlap", "--topk-density", "0.1"],
        ["--method", "local_sgd", "--update-codec", "topk"],
        # A preset's error feedback turned off (`error_feedback = false` in a file) had no flag
        # to travel in: joiners kept it on, and a different fingerprint refused every one.
        ["--method", "sparseloco", "--no-error-feedback"],
    ],
    ids=" ".join,
)
def test_join_command_carries_the_outer_optimizer(flags: list[str]) -> None:
    starter, joiner = _round_trip(flags)
    assert joiner.diloco == starter.diloco and joiner.preset == starter.preset


@pytest.mark.parametrize("method", ["diloco", "dp"])
def test_join_command_carries_the_gradient_clip(method: str) -> None:
    """With dp each peer clips and steps the averaged gradient itself: a joiner at the default
    clip drifted away from a run started with --grad-clip 0.25, unrefused."""
    starter, joiner = _round_trip(["--method", method, "--grad-clip", "0.25"])
    assert joiner.train.grad_clip == starter.train.grad_clip == 0.25


def test_join_command_carries_the_inner_optimizer() -> None:
    """Weight decay, betas and warmup had no flags (stop 59): a run's file could set them, and a
    joiner pasting the command trained with the defaults (with dp, its θ drifts away)."""
    flags = ["--method", "dp", "--weight-decay", "0", "--beta1", "0.8", "--beta2", "0.99",
             "--warmup-steps", "5"]  # fmt: skip
    starter, joiner = _round_trip(flags)
    assert joiner.train == starter.train
    assert (joiner.train.weight_decay, joiner.train.beta1, joiner.train.beta2, joiner.train.warmup_steps) == (
        0,
        0.8,
        0.99,
        5,
    )


def test_join_command_quotes_a_folder_with_a_space(tmp_path) -> None:
    folder = tmp_path / "my tokenizer"
    config = RunConfig(model=tiny(), peer=PeerConfig(run_id="exp-2"))
    config.data.tokenizer = str(folder)
    words = shlex.split(join_command(config, [ADDRESS]))
    assert words[words.index("--tokenizer") + 1] == str(folder)


@pytest.mark.parametrize(
    "flags",
    [
        ["--method", "streaming", "--inner-steps", "8", "--fragments", "2"],
        ["--method", "streaming", "--inner-steps", "8", "--fragments", "2", "--sync-delay", "3"],
        [
            "--method",
            "streaming",
            "--inner-steps",
            "8",
            "--fragments",
            "2",
            "--sync-delay",
            "1",
            "--alpha",
            "0.25",
        ],
    ],
    ids=" ".join,
)
def test_join_command_carries_the_streaming_schedule(flags: list[str]) -> None:
    """Every peer of a streaming run must merge on the same schedule (τ sets whose clock leads)."""
    starter, joiner = _round_trip(flags)
    assert (joiner.method, joiner.fragments, joiner.sync_delay, joiner.alpha) == (
        starter.method, starter.fragments, starter.sync_delay, starter.alpha,
    )  # fmt: skip
    assert joiner.overlapped == (starter.sync_delay > 0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--inner-steps", "8", "--fragments", "4", "--sync-delay", "2"], "below the 2 inner steps"),
        (["--inner-steps", "8", "--fragments", "4", "--alpha", "1"], "alpha"),
    ],
)
def test_a_sync_delay_that_does_not_fit_the_schedule_is_refused(flags, message, capsys) -> None:
    assert main(["start", "--method", "streaming", *flags]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_join_command_is_one_line_of_shell_words() -> None:
    config = RunConfig(model=tiny(), peer=PeerConfig(run_id="exp-2"))
    command = join_command(config, [ADDRESS])
    assert "\n" not in command
    assert shlex.split(command) == command.split()


def test_choice_lists_match_their_registries():
    """workbench.names mirrors the torch-backed registries, so that the parser needs no torch."""
    from optim.codecs import CODECS
    from workbench import names
    from workbench.run.model import PRESETS

    assert tuple(sorted(CODECS)) == names.UPDATE_CODECS
    assert tuple(sorted(PRESETS)) == names.MODEL_PRESETS


def test_help_does_not_import_torch():
    """`workbench --help` (and every command's --help) builds the parser without torch (#8)."""
    import subprocess
    import sys

    code = "import sys, workbench.cli.command as c; c.build_parser(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr


def test_a_secret_on_the_command_line_is_warned_of(monkeypatch, caplog, capsys):
    """`ps` showed a private run's `--secret` in full to every user of the machine (a review,
    stop 64): given on a command line it is warned of, from the environment it is not."""
    with caplog.at_level("WARNING", logger="workbench"):
        assert main(["config", "show", "--secret", "correct horse battery"]) == 0
    assert "set WORKBENCH_SECRET in the environment instead" in caplog.text
    assert "correct horse" not in capsys.readouterr().out
    caplog.clear()
    monkeypatch.setenv("WORKBENCH_SECRET", "correct horse battery")
    with caplog.at_level("WARNING", logger="workbench"):
        assert main(["config", "show"]) == 0
    assert "WORKBENCH_SECRET" not in caplog.text


def test_export_writes_csv_and_json_lines(tmp_path, capsys):
    """`workbench export RUN_DIR --csv`: one row per round event of every peer under RUN_DIR."""
    import csv
    import io

    for name, losses in (("a", [3.0, 2.5]), ("b", [3.1, 2.4])):
        folder = tmp_path / name
        folder.mkdir()
        lines = [json.dumps({"event": "started", "time": 0.5, "peer": name})]
        lines += [
            json.dumps({"event": "round", "time": 1.0 + i, "peer": name, "outer_step": i + 1, "loss": loss})
            for i, loss in enumerate(losses)
        ]
        (folder / "metrics.jsonl").write_text("\n".join(lines) + '\n{"event": "rou')  # a torn last line
    assert main(["export", str(tmp_path), "--csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["peer"], r["outer_step"], r["loss"]) for r in rows] == [
        ("a", "1", "3.0"), ("b", "1", "3.1"), ("a", "2", "2.5"), ("b", "2", "2.4"),
    ]  # fmt: skip
    out = tmp_path / "all.jsonl"
    assert main(["export", str(tmp_path), "--events", "all", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 6
    assert main(["export", str(tmp_path / "a" / "metrics.jsonl")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--events", "rounds"]) == 2  # a typo: one line, not no rows
    assert "no rounds events under" in capsys.readouterr().err


def test_export_keeps_each_outer_step_once_and_writes_strict_json(tmp_path, capsys):
    """A peer resumed from an older checkpoint runs some outer steps again: the rows it wrote for
    them before the resume are left out (and counted on stderr). NaN is null in JSON lines."""
    events = [
        {"event": "round", "time": 1.0, "peer": "a", "outer_step": 1, "loss": 3.0},
        {"event": "round", "time": 2.0, "peer": "a", "outer_step": 2, "loss": 2.8},
        {"event": "round", "time": 3.0, "peer": "a", "outer_step": 3, "loss": float("nan")},
        {"event": "resumed_checkpoint", "time": 9.0, "peer": "a", "outer_step": 1},
        {"event": "round", "time": 10.0, "peer": "a", "outer_step": 2, "loss": 2.7},
        {"event": "round", "time": 11.0, "peer": "a", "outer_step": 3, "loss": float("inf")},
        {"event": "done", "time": 12.0, "peer": "a", "summary": {"eval": [float("nan"), 1.0]}},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert main(["export", str(tmp_path), "--events", "all"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line, parse_constant=pytest.fail) for line in out.splitlines()]  # no NaN/Infinity
    assert [(r["event"], r.get("outer_step"), r.get("loss")) for r in rows] == [
        ("round", 1, 3.0), ("resumed_checkpoint", 1, None), ("round", 2, 2.7), ("round", 3, None),
        ("done", None, None),
    ]  # fmt: skip
    assert rows[-1]["summary"] == {"eval": [None, 1.0]}
    assert "left out 2 events of outer steps a resume rolled back" in err
    assert main(["export", str(tmp_path), "--csv"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1 + 3  # header and steps 1, 2, 3 once each


def test_a_line_cut_short_then_resumed_costs_that_line_not_the_export(tmp_path, capsys):
    """A peer killed mid-line (or stopped by a full disk) and resumed: its next event went onto
    the half line, and `export` refused the whole file ("metrics.jsonl:22 is not a JSON line").
    The resumed peer ends the half line first; export leaves out such a line and says so."""
    from workbench.run.telemetry import Events

    whole = [{"event": "round", "time": 1.0, "peer": "a", "outer_step": 1, "loss": 3.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(whole[0]) + '\n{"event": "round", "time": 17')  # killed mid-line
    events = Events()
    events.open(tmp_path, name="a", exporters=[])
    events.emit("round", outer_step=2, loss=2.5)
    events.close()
    assert path.read_text().splitlines()[1] == '{"event": "round", "time": 17'
    assert main(["export", str(tmp_path), "--csv"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 + 2, out  # the header, steps 1 and 2
    assert "left out 1 event line(s) cut short" in err
    # Without the mend (an earlier release wrote the next event onto the half line): that event
    # is whole and kept. It may be a run's start over, which the export splits at.
    run = {"event": "started", "time": 50.0, "peer": "a", "run": "r/o/2.0"}
    later = {"event": "round", "time": 51.0, "peer": "a", "outer_step": 1, "loss": 1.5}
    first = {"event": "started", "time": 0.5, "peer": "a", "run": "r/o/1.0"}
    glued = '{"event": "round", "time": 17' + json.dumps(run)
    path.write_text("\n".join(json.dumps(e) for e in (first, whole[0])) + f"\n{glued}\n{json.dumps(later)}\n")
    assert main(["export", str(tmp_path), "--csv"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 + 1 and ",1.5" in out and "earlier run" in err, (out, err)
    path.write_text(json.dumps(whole[0]) + "\nnot an event\n" + json.dumps(whole[0]) + "\n")
    assert main(["export", str(tmp_path), "--csv"]) == EXIT_USER_ERROR  # not a peer's file: refused
    assert "metrics.jsonl:2 is not a JSON line" in capsys.readouterr().err


def test_a_run_started_over_in_its_folder_exports_alone(tmp_path, capsys):
    """`start` refuses a folder holding a checkpoint and says to remove them to start over:
    the new run appended to the old metrics.jsonl and `export` mixed both, outer steps 1, 2,
    1, 2 with nothing to tell them apart (a review, stop 60). A peer that came back to the same
    run (a demo's restart, --resume) keeps its earlier events."""
    import csv
    import io

    def session(run: str, steps: range, t0: float) -> list[dict]:
        started = {"event": "started", "time": t0, "peer": "a", "run": run}
        return [started] + [
            {"event": "round", "time": t0 + s, "peer": "a", "outer_step": s, "loss": t0 + s} for s in steps
        ]

    path = tmp_path / "metrics.jsonl"
    lines = session("r/owner/1.0", range(1, 3), 10.0) + session("r/owner/2.0", range(1, 3), 100.0)
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert main(["export", str(tmp_path), "--csv"]) == 0
    out, err = capsys.readouterr()
    assert [r["loss"] for r in csv.DictReader(io.StringIO(out))] == ["101.0", "102.0"]
    assert "left out 3 events of an earlier run in the same folder" in err
    rejoined = session("r/owner/1.0", range(1, 3), 10.0) + session("r/owner/1.0", range(3, 5), 100.0)
    path.write_text("".join(json.dumps(e) + "\n" for e in rejoined))
    assert main(["export", str(tmp_path), "--csv"]) == 0
    out, err = capsys.readouterr()
    assert len(list(csv.DictReader(io.StringIO(out)))) == 4 and "earlier run" not in err
    # A whole run resumed from its checkpoints: its owner publishes the manifest anew (another
    # creation time, another "run"), and export left out everything before the resume.
    resumed = session("r/owner/2.0", range(3, 5), 100.0)
    resumed.insert(1, {"event": "resumed_checkpoint", "time": 100.0, "peer": "a", "outer_step": 2})
    path.write_text(
        "".join(json.dumps(e) + "\n" for e in session("r/owner/1.0", range(1, 3), 10.0) + resumed)
    )
    assert main(["export", str(tmp_path), "--csv"]) == 0
    out, err = capsys.readouterr()
    assert [r["outer_step"] for r in csv.DictReader(io.StringIO(out))] == ["1", "2", "3", "4"], err
    assert "earlier run" not in err


def test_export_holds_only_the_events_it_writes(tmp_path, capsys):
    """Export read each metrics.jsonl whole and parsed every event before choosing: 989 MB of
    memory for a 137 MB file of 200,000 rounds, whatever --events asked for. It now reads line
    by line and keeps only the events asked for (the others as their outer step, so that a
    resume still leaves out as many)."""
    import tracemalloc

    from workbench.cli.export import read_events

    def rounds(steps: range, t0: float) -> list[str]:
        return [
            json.dumps(
                {
                    "event": "round",
                    "time": t0 + s,
                    "peer": "a",
                    "outer_step": s,
                    "loss": 1.0 / s,
                    "notes": "x" * 400,
                }
            )
            for s in steps
        ]

    resumed = json.dumps({"event": "resumed_checkpoint", "time": 50_000.0, "peer": "a", "outer_step": 100})
    lines = [json.dumps({"event": "started", "time": 0.0, "peer": "a", "run": "r"})]
    lines += rounds(range(1, 20_001), 0.0) + [resumed] + rounds(range(101, 201), 50_000.0)
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines) + "\n")
    tracemalloc.start()
    try:
        started = read_events(tmp_path, {"started"})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [e["event"] for e in started] == ["started"]
    assert peak < path.stat().st_size / 4, (peak, path.stat().st_size)  # (whole: 2.7x the file)
    rolled_back = "left out 19900 events of outer steps a resume rolled back"
    assert rolled_back in capsys.readouterr().err  # the same count whatever is exported
    assert len(read_events(tmp_path, {"round"})) == 200 and rolled_back in capsys.readouterr().err
    assert len(read_events(tmp_path, None)) == 202 and rolled_back in capsys.readouterr().err


def test_export_refuses_an_empty_run_dir_and_an_out_folder(tmp_path, monkeypatch, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "round", "outer_step": 1}) + "\n")
    monkeypatch.chdir(tmp_path)  # '' is not the current folder
    assert main(["export", ""]) == EXIT_USER_ERROR
    assert "RUN_DIR is empty" in one_error_line(capsys)
    assert main(["export", str(tmp_path), "--out", str(tmp_path)]) == EXIT_USER_ERROR
    assert f"--out {tmp_path} is a folder: give a file name" in one_error_line(capsys)
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "no" / "x.csv")]) == EXIT_USER_ERROR
    assert "cannot write --out" in one_error_line(capsys)


def test_export_never_writes_over_what_it_reads_and_names_what_it_cannot_take(tmp_path, capsys):
    """`--out RUN_DIR/metrics.jsonl` overwrote the peer's events with the rows exported (6 lines
    became 1); a line whose time is not a number ended in a traceback; a typo beside a real kind
    in --events was passed over, and `--events ,` exported nothing; `--wandb-mode online`
    without --wandb did nothing, where `start` refuses it."""
    events = tmp_path / "metrics.jsonl"
    lines = [
        {"event": "started", "time": 0.5, "peer": "a"},
        {"event": "round", "time": 1.0, "peer": "a", "outer_step": 1},
    ]
    events.write_text("".join(json.dumps(e) + "\n" for e in lines))
    before = events.read_text()
    assert main(["export", str(tmp_path), "--out", str(events)]) == EXIT_USER_ERROR
    assert "is a metrics.jsonl under RUN_DIR" in one_error_line(capsys) and events.read_text() == before
    assert main(["export", str(tmp_path), "--events", "round,state_donwloaded"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 and "no state_donwloaded events under" in err
    assert main(["export", str(tmp_path), "--events", ","]) == EXIT_USER_ERROR
    assert "names no event kind" in one_error_line(capsys)
    assert (
        main(["export", str(tmp_path), "--wandb-mode", "online", "--out", str(tmp_path / "x.jsonl")])
        == EXIT_USER_ERROR
    )
    assert "add --wandb PROJECT" in one_error_line(capsys)
    events.write_text(before + json.dumps({"event": "round", "time": "x", "peer": 5}) + "\n{}\n")
    assert main(["export", str(tmp_path), "--csv"]) == EXIT_USER_ERROR
    assert f"{events}:3 has a time that is not a number" in one_error_line(capsys)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["join", "/ip4/127.0.0.1/tcp/31337/p2p/notapeerid"], id="malformed-address"),
        pytest.param(["join", "127.0.0.1:31337"], id="host-port"),
        pytest.param(["start", "--host", "1.2.3.999"], id="bad-host"),
        pytest.param(["start", "--announce", "/ip4/203.0.113.7/tcp/0"], id="announce-port-0"),
    ],
)
def test_a_bad_address_is_refused_before_torch_is_imported(argv: list[str]) -> None:
    """Told in a fraction of a second, not after torch's 2-3 s import (15 s on a loaded
    machine, which once failed test_bad_addresses' bound)."""
    import subprocess
    import sys

    probe = (
        "import sys\nfrom workbench.cli.command import main\n"
        f"code = main({argv!r})\nprint(code, 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == [str(EXIT_USER_ERROR), "False"], (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr


def test_the_web_monitor_on_a_taken_port_is_one_line(capsys, tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["replay", str(tmp_path / "run.jsonl"), "--web", "--web-port", str(port)]
        assert main(argv) == EXIT_USER_ERROR
    assert f"cannot serve the monitor on 127.0.0.1:{port}" in one_error_line(capsys)


def test_the_web_monitor_checks_its_inputs_before_it_serves(capsys, tmp_path: Path, monkeypatch) -> None:
    """`replay missing.jsonl --web` and `monitor ... --key missing --web` served on, the error
    said only in the browser: checked first now, as without --web."""
    import workbench.cli.monitor as monitor

    served: list = []
    monkeypatch.setattr(monitor, "_serve", lambda argv, port: served.append(argv) or 0)
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--web"]) == EXIT_USER_ERROR
    assert "cannot read the recording" in one_error_line(capsys)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["replay", str(empty), "--web"]) == EXIT_USER_ERROR
    assert "is not a workbench monitor recording" in one_error_line(capsys)
    address = f"/ip4/127.0.0.1/tcp/9/p2p/{PEER_ID}"
    assert main(["monitor", address, "--key", str(tmp_path / "missing.key"), "--web"]) == EXIT_USER_ERROR
    assert "cannot read" in one_error_line(capsys)
    assert main(["monitor", address, "--record", str(tmp_path), "--web"]) == EXIT_USER_ERROR
    assert "cannot write the recording" in one_error_line(capsys)
    assert served == []


# --- doctor ----------------------------------------------------------------------------------------


def test_doctor_tells_a_libp2p_listener_from_anything_else_on_the_port() -> None:
    """A web server on the port was told "check the /p2p/ id against the one the peer printed"
    as a peer with another id was (a review, stop 71): a libp2p listener says its multistream
    header first; anything else says nothing, or something else."""
    import contextlib
    import socket
    import threading

    from workbench.cli.doctor import MULTISTREAM, speaks_libp2p

    def serve(first: bytes) -> int:
        listener = socket.create_server(("127.0.0.1", 0))

        def answer() -> None:
            connection, _ = listener.accept()
            with connection, listener, contextlib.suppress(OSError):
                connection.sendall(first)
                connection.recv(1)  # (until the probe hangs up, or resets)

        threading.Thread(target=answer, daemon=True).start()
        return listener.getsockname()[1]

    assert speaks_libp2p("127.0.0.1", serve(MULTISTREAM), timeout=2.0) is True
    assert speaks_libp2p("127.0.0.1", serve(b""), timeout=0.5) is False  # a web server: waits
    assert speaks_libp2p("127.0.0.1", serve(b"SSH-2.0-OpenSSH_9.6\r\n"), timeout=2.0) is False


def test_doctor_tells_a_refused_port_from_a_bad_name_and_a_silent_firewall(monkeypatch):
    import socket

    from workbench.cli.doctor import probe_port

    with socket.socket() as free:  # a port nothing listens on: bound, then closed
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    refused = probe_port("127.0.0.1", port, timeout=5)
    assert refused.status == "fail" and "connection refused" in refused.detail
    assert "--host 0.0.0.0" not in refused.fix  # this machine: the peer is not running
    name = probe_port("peer.invalid", 31337, timeout=5)  # .invalid never resolves (RFC 2606)
    assert "does not resolve" in name.detail and "spelling" in name.fix and "--host" not in name.fix
    waited = []

    def silent(target, timeout):
        waited.append(timeout)
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", silent)
    dropped = probe_port("203.0.113.7", 31337, timeout=7.5)
    assert waited == [7.5] and "no answer within 7.5 s" in dropped.detail
    assert "firewall or NAT" in dropped.fix and "--host 0.0.0.0" not in dropped.fix

    def refuse(target, timeout):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", refuse)
    remote = probe_port("203.0.113.7", 31337, timeout=5)
    assert "--host 0.0.0.0 --port 31337 --announce /ip4/203.0.113.7/tcp/31337" in remote.fix
    named = probe_port("peer.example.org", 31337, timeout=5)  # /ip4/peer.example.org is no address
    assert "--announce /dns4/peer.example.org/tcp/31337" in named.fix
    assert "is the peer running on this machine" in probe_port("localhost", 31337, timeout=5).fix


@pytest.mark.parametrize(
    ("cuda", "driver", "build", "status", "said"),
    [
        (True, True, "12.8", "ok", "sees 2 CUDA device(s), the first a NVIDIA H200"),
        (False, True, None, "warn", "is a CPU build: peers will train on the CPU"),
        (False, True, "12.8", "warn", "finds no usable GPU although an NVIDIA driver is installed"),
        (False, False, None, "info", "no GPU: peers train on the CPU"),
    ],
    ids=["gpu", "cpu-build-on-a-gpu-machine", "driver-but-no-gpu", "cpu"],
)
def test_doctor_says_where_a_peer_would_train(monkeypatch, cuda, driver, build, status, said):
    import shutil

    import torch

    from workbench.cli.doctor import device_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(torch.version, "cuda", build)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi" if driver else None)
    monkeypatch.setattr("os.path.exists", lambda path: False)
    check = device_check()
    assert check.name == "device" and check.status == status and said in check.detail, check
    if build is None and driver:
        assert "pip install torch==" + torch.__version__.split("+")[0] in check.fix


def test_doctor_probes_with_the_connect_timeout_and_a_malformed_address_is_exit_2(monkeypatch, capsys):
    import workbench.cli.doctor as doctor

    waited = []
    monkeypatch.setattr(
        doctor,
        "probe_port",
        lambda host, port, *, timeout: waited.append(timeout) or doctor.Check("port x", "fail", "x"),
    )
    assert main(["doctor", ADDRESS, "--connect-timeout", "42", "--json"]) == 1
    assert waited == [42.0]
    capsys.readouterr()
    long = f"/ip4/1.2.3/tcp/31337/p2p/{PEER_ID}"
    assert main(["doctor", long]) == EXIT_USER_ERROR
    out = capsys.readouterr().out
    assert any(long in line for line in out.splitlines()), out  # never wrapped mid-address


def test_doctor_refuses_a_short_secret_before_probing_anything(capsys, monkeypatch):
    """Stop 57, a review: it probed the ports, then blamed the network for a short --secret."""
    import workbench.cli.doctor as doctor

    monkeypatch.setattr(doctor, "probe_port", lambda *a, **k: pytest.fail("probed a port"))
    assert main(["doctor", ADDRESS, "--secret", "short"]) == EXIT_USER_ERROR
    assert "at least 8 characters" in one_error_line(capsys)


def test_doctor_prints_brackets_it_was_given_as_they_are(capsys):
    """Stop 57, a review: the address the user typed went into rich's markup: `[/ip4/...]`
    raised rich's MarkupError (a traceback), and `[b]` vanished."""
    assert main(["doctor", "[/ip4/1.2.3.4/tcp/1]"]) == EXIT_USER_ERROR
    out = capsys.readouterr().out
    assert "[/ip4/1.2.3.4/tcp/1]" in out, out


def test_doctor_tells_the_address_this_machine_reaches_the_swarm_from(monkeypatch):
    """Stop 57, a review: it read the observer's own addresses, which are on 127.0.0.1 on every
    machine, so it always said "loopback only"."""
    import workbench.cli.doctor as doctor

    assert "on this machine" in doctor._reachability([("127.0.0.1", 31337)])[0].detail  # a real socket
    source = {}

    class Routed:
        """A UDP socket whose connect picks ``source[host]`` as this machine's address."""

        def __init__(self, family, kind):
            self.peer = None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def connect(self, target):
            if target[0] not in source:
                raise OSError("Network is unreachable")
            self.peer = target[0]

        def getsockname(self):
            return (source[self.peer], 40000)

    monkeypatch.setattr(doctor.socket, "socket", Routed)
    source.update({"203.0.113.9": "93.184.216.34", "10.1.2.3": "10.1.2.4"})
    public = doctor._reachability([("203.0.113.9", 31337)])[0]
    assert public.status == "ok" and "93.184.216.34" in public.detail
    assert "--announce /ip4/93.184.216.34/tcp/PORT" in public.fix
    private = doctor._reachability([("10.1.2.3", 31337)])[0]
    assert private.status == "warn" and "private (LAN) address, 10.1.2.4" in private.detail
    assert doctor._reachability([("192.0.2.99", 1)])[0].status == "info"  # no route


def test_config_show_names_the_file_of_a_bad_host_as_start_does(capsys, tmp_path) -> None:
    (tmp_path / "run.toml").write_text('host = "localhost"\n')
    for argv in (["config", "show"], ["start"]):
        assert main([*argv, "--config", str(tmp_path / "run.toml")]) == EXIT_USER_ERROR
        line = one_error_line(capsys)
        # named as the file is read (the flag's check, before the config is built)
        assert (
            "--host must be an IP address" in line and f"{tmp_path / 'run.toml'}: host = 'localhost'" in line
        )


def test_a_rule_between_settings_names_where_a_flag_it_names_came_from(capsys, monkeypatch, tmp_path) -> None:
    """A rule's error names the flags ("drop --error-feedback"): from a file or a variable, the
    user never typed that flag, and nothing said where it came from (a review, stop 60)."""
    (tmp_path / "run.toml").write_text("error_feedback = true\n")
    assert main(["start", "--config", str(tmp_path / "run.toml")]) == EXIT_USER_ERROR
    assert f"(error_feedback from file {tmp_path / 'run.toml'})" in one_error_line(capsys)
    monkeypatch.setenv("WORKBENCH_CLIENT_MODE", "1")
    assert main(["start"]) == EXIT_USER_ERROR
    assert "(client_mode from env WORKBENCH_CLIENT_MODE)" in one_error_line(capsys)
    monkeypatch.delenv("WORKBENCH_CLIENT_MODE")
    monkeypatch.setenv("WORKBENCH_SYNC_DELAY", "3")
    assert main(["start"]) == EXIT_USER_ERROR
    assert "(sync_delay from env WORKBENCH_SYNC_DELAY)" in one_error_line(capsys)
    monkeypatch.delenv("WORKBENCH_SYNC_DELAY")
    # A word of the message is not a key named: "the port is forwarded" blamed WORKBENCH_PORT.
    monkeypatch.setenv("WORKBENCH_PORT", "31337")
    monkeypatch.setenv("WORKBENCH_ANNOUNCE", "/ip4/1.2.3.4/tcp/31337")
    assert main(["start", "--client-mode"]) == EXIT_USER_ERROR
    line = one_error_line(capsys)
    assert "(announce from env WORKBENCH_ANNOUNCE)" in line and "port from" not in line, line


def test_the_secrets_variable_is_named_as_its_source(capsys, monkeypatch) -> None:
    """--secret's default comes from WORKBENCH_RUN_SECRET: `config show --sources` said
    "default", and a bad value's error did not name the variable."""
    monkeypatch.setenv("WORKBENCH_RUN_SECRET", "supersecret123")
    assert main(["config", "show", "--sources"]) == 0
    out, _ = capsys.readouterr()
    line = next(line for line in out.splitlines() if line.startswith("# secret ="))
    assert "# env WORKBENCH_RUN_SECRET (set, never printed" in line and "supersecret123" not in out, out
    monkeypatch.setenv("WORKBENCH_RUN_SECRET", "short")
    assert main(["start"]) == EXIT_USER_ERROR
    assert "(secret from env WORKBENCH_RUN_SECRET)" in one_error_line(capsys)


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("workbench 0.")


def test_doctor_tells_a_wrong_peer_id_on_a_live_port_from_a_firewall(monkeypatch) -> None:
    """The port answered but the DHT found no peer of that id there: the fix said "firewall"."""
    import argparse

    import workbench.cli.doctor as doctor
    from swarm.errors import SwarmError

    def unreachable(args):
        raise SwarmError("could not reach any bootstrap peer")

    monkeypatch.setattr(doctor, "_observer", unreachable)
    monkeypatch.setattr(doctor, "speaks_libp2p", lambda host, port, *, timeout: True)  # another peer id
    args = argparse.Namespace(peers=[ADDRESS], owner=None, connect_timeout=5.0, run_id="r", secret=None)
    for port, said in (("ok", "not the peer named by the address's /p2p/ id"), ("warn", "firewall")):
        monkeypatch.setattr(
            doctor, "probe_port", lambda host, p, *, timeout, port=port: doctor.Check("port x", port, "x")
        )
        bootstrap = [c for c in doctor.diagnose(args) if c.name == "bootstrap"]
        assert bootstrap and bootstrap[0].status == "fail" and said in bootstrap[0].fix, bootstrap


def test_a_tokenizer_path_that_does_not_exist_is_said_so(tmp_path) -> None:
    """transformers took it for a hub name: "Repo id must use alphanumeric chars ..."."""
    from workbench.run.hf import load_tokenizer

    for name in (str(tmp_path / "tok"), "./no-such-tokenizer"):
        with pytest.raises(ValueError, match="no such folder"):
            load_tokenizer(name)


def test_two_models_that_differ_only_in_block_size_are_told_apart_in_words() -> None:
    """A joiner with another --block-size was refused with two identical descriptions of the
    models (the parameter counts rounded alike), so it could not see what differed."""
    from workbench.run.joining import fingerprint
    from workbench.run.model import build_model

    summaries = []
    for block in ("64", "96"):
        config = config_of("start", "--model", "tiny", "--block-size", block)
        summaries.append(fingerprint(config, build_model(config.model, seed=0))[1])
    assert summaries[0] != summaries[1] and "block size 96" in summaries[1], summaries


def test_a_joiner_with_another_aggregation_is_refused() -> None:
    """`--aggregate` was not in the run's fingerprint: a trimmed-mean joiner was let into a mean
    run, downloaded the state 18 times in 10 rounds and ended on another θ (a review,
    2026-12-06). A mean run's fingerprint stays what it was (its checkpoints resume)."""
    from workbench.run.joining import fingerprint, fingerprinted_flags
    from workbench.run.model import build_model

    configs = [
        config_of("start", "--model", "tiny", *extra) for extra in ((), ("--aggregate", "trimmed-mean"))
    ]
    model = build_model(configs[0].model, seed=0)
    mean, trimmed = (fingerprint(config, model)[0] for config in configs)
    assert mean != trimmed
    assert fingerprinted_flags(configs[1], model)["--aggregate"] == "trimmed-mean"
    # The refusal shows both sides' summaries: what differs is in them.
    assert "trimmed-mean" in fingerprint(configs[1], model)[1]
    streaming = [
        config_of("start", "--model", "tiny", "--method", "streaming", *extra)
        for extra in ((), ("--sync-delay", "2", "--codec", "fp16"))
    ]
    summaries = [fingerprint(config, model)[1] for config in streaming]
    assert "tau=0" in summaries[0] and "tau=2" in summaries[1] and "wire fp16" in summaries[1], summaries
    # The tiny model's with every default, before --aggregate was covered: a checkpoint written
    # then still resumes (a --resume with another fingerprint is refused).
    assert mean == "59041bd129840254", mean


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA device")
def test_the_demo_says_a_missing_gpu_once_before_starting_peers(capsys, monkeypatch) -> None:
    started = []
    monkeypatch.setattr(workbench.local.launch, "run_demo", lambda *a, **k: started.append(a))
    assert main(["demo", "--headless", "--device", "cuda"]) == EXIT_USER_ERROR
    assert "no CUDA device found; use --device cpu" in one_error_line(capsys) and not started


def test_a_demo_peer_that_failed_is_said_in_one_line_with_its_log(tmp_path) -> None:
    """A LaunchError is one line (SwarmError): the peer's log tail after a newline came out as a
    literal backslash-n. Now: where the log is, and its last lines joined."""
    from workbench.local.launch import LaunchError, LocalPeer

    peer = LocalPeer("peer-0", tmp_path, process=None)
    assert peer.log_end() == f"the end of its log ({tmp_path / 'peer.log'}): (empty)"
    (tmp_path / "peer.log").write_text("started\nloading\n\nerror: unknown device 'tpu'\n")
    message = str(LaunchError(f"peer-0 exited with status 2 before finishing; {peer.log_end()}"))
    assert "\\n" not in message and "\n" not in message
    assert message.endswith("): loading | error: unknown device 'tpu'")


def test_grad_clip_is_a_flag_every_command_passes_on(monkeypatch):
    """Stop 57, a review: docs/optimizers.md told dp users about `--grad-clip`, which no command
    had; every inner step clipped at 1.0 and nothing said so."""
    import workbench.simulate

    assert config_of("start").train.grad_clip == 1.0
    assert config_of("start", "--grad-clip", "0").train.grad_clip == 0.0
    assert config_of("join", ADDRESS, "--grad-clip", "0.5").train.grad_clip == 0.5
    from pathlib import Path

    from workbench.local.launch import peer_arguments

    demo = config_of("demo", "--grad-clip", "0.5")  # the demo's and Experiment's local peers
    assert config_of("start", *peer_arguments(demo, name="p", run_dir=Path("/tmp/x"))).train.grad_clip == 0.5
    taken = []

    def run_simulation(spec, **kwargs):
        taken.append(kwargs["train"].grad_clip)
        raise KeyboardInterrupt

    monkeypatch.setattr(workbench.simulate, "run_simulation", run_simulation)
    main(["simulate", "--grad-clip", "0.25", "--steps", "2"])
    assert taken == [0.25]
    assert main(["start", "--grad-clip", "-1"]) == EXIT_USER_ERROR


def test_config_show_never_prints_the_run_secret(capsys, monkeypatch):
    """Stop 57, a review: `config show --json --secret X` printed X (and `--sources` the
    variable's), though the join command and the logs never do."""
    assert main(["config", "show", "--json", "--secret", "mysecret123"]) == 0
    out = capsys.readouterr().out
    assert "mysecret123" not in out and json.loads(out)["settings"]["secret"] is None
    monkeypatch.setenv("WORKBENCH_RUN_SECRET", "envsecret99")
    assert main(["config", "show", "--sources"]) == 0
    out = capsys.readouterr().out
    assert "envsecret99" not in out and "set, never printed" in out


def test_a_status_that_cannot_reach_the_run_leaves_no_empty_recording(tmp_path, monkeypatch, capsys):
    """`status MULTIADDR --record new.jsonl` against a run it could not reach left new.jsonl with
    its header only, which `status --replay` then refused ("holds no readings")."""
    import workbench.cli.status as status
    from swarm.errors import SwarmError

    def unreachable(args):  # type: ignore[no-untyped-def]
        raise SwarmError("could not reach any bootstrap peer")

    monkeypatch.setattr(status, "open_observer", unreachable)
    new, kept = tmp_path / "new.jsonl", tmp_path / "kept.jsonl"
    kept.write_text('{"format": "workbench-monitor/1"}\n')
    for path in (new, kept):
        assert (
            main(["status", f"/ip4/127.0.0.1/tcp/9/p2p/{PEER_ID}", "--record", str(path)]) == EXIT_USER_ERROR
        )
        assert "could not reach" in one_error_line(capsys)
    assert not new.exists() and kept.exists()  # one it did not make is left alone


@pytest.mark.parametrize(
    ("argv", "verbose"),
    [
        (["start"], 0),
        (["-v", "start"], 1),
        (["start", "--rounds", "3", "-v"], 1),  # where "run with -v for details" leads a user
        (["join", "/ip4/127.0.0.1/tcp/1/p2p/QmX", "-vv"], 2),
        (["status", "/ip4/127.0.0.1/tcp/1/p2p/QmX", "--verbose"], 1),
        (["-v", "start", "-v"], 2),  # hivemind's logs too, as -vv
        (["config", "show", "-v"], 1),
        (["config", "keys", "--verbose"], 1),
    ],
)
def test_verbose_is_taken_before_or_after_the_command(argv, verbose) -> None:
    """`workbench start ... -v` was "unrecognized arguments: -v", while every error says "run
    with -v for details" (a review, stop 59)."""
    args, extra = build_parser().parse_known_args(argv)
    assert (args.verbose + getattr(args, "verbose_after", 0), extra) == (verbose, [])


def test_a_demo_that_fails_exits_1_not_a_mistakes_2(monkeypatch, capsys) -> None:
    """A peer that crashed or a demo past --timeout exited 2, the status of a user's mistake: a
    script could not tell them apart (a review, stop 59)."""
    import workbench.local.launch as launch

    def failing(config, args):  # type: ignore[no-untyped-def]
        raise launch.DemoFailed("peer-1 exited with status 1 before finishing; the end of its log: boom")

    monkeypatch.setattr(launch, "run_demo_command", failing)
    assert main(["demo", "--model", "tiny"]) == 1
    assert (
        one_error_line(capsys)
        == "error: peer-1 exited with status 1 before finishing; the end of its log: boom"
    )


@pytest.mark.parametrize("command", ["status", "doctor", "steer", "monitor"])
def test_the_observers_take_the_run_id_the_peers_take(command, monkeypatch) -> None:
    """`WORKBENCH_RUN_ID=myrun workbench doctor ADDR` looked for run 'workbench' beside a peer
    started with it, while WORKBENCH_RUN_SECRET was taken (a review, stop 60)."""
    extra = ["/ip4/127.0.0.1/tcp/1", *(["--key", "k"] if command == "steer" else [])]
    monkeypatch.delenv("WORKBENCH_RUN_ID", raising=False)
    assert _observed([command, *extra]).run_id == "workbench"
    monkeypatch.setenv("WORKBENCH_RUN_ID", "myrun")
    assert _observed([command, *extra]).run_id == "myrun"
    assert _observed([command, *extra, "--run-id", "other"]).run_id == "other"


def _observed(argv: list[str]):
    """An observer command's args as it runs with them (its WORKBENCH_* variables taken)."""
    from workbench.cli.status import observer_settings

    return observer_settings(build_parser().parse_args(argv))


@pytest.mark.parametrize("command", ["status", "doctor", "steer", "monitor"])
def test_the_observers_check_their_variables_as_the_peers_do_and_name_them(
    command, monkeypatch, capsys
) -> None:
    """A review (stop 69): an empty WORKBENCH_RUN_ID or WORKBENCH_SECRET fell back to the
    default in `status`, `steer`, `doctor` and `monitor` (`start` refuses them), and a bad
    WORKBENCH_CONNECT_TIMEOUT was said as ``--connect-timeout``, a flag never given."""
    extra = ["/ip4/127.0.0.1/tcp/1/p2p/QmXyzB8iV6WGF5CqH3HbXiFNPbYcvMk1pW6uDSpBX3mJ5U"]
    extra += ["--key", "k", "--outer-lr", "0.5"] if command == "steer" else []
    for variable, value, said in [
        ("WORKBENCH_RUN_ID", "", "WORKBENCH_RUN_ID = '': invalid run id"),
        ("WORKBENCH_SECRET", "", "WORKBENCH_SECRET = (set, not shown): a run secret must be at least 8"),
        ("WORKBENCH_CONNECT_TIMEOUT", "abc", "WORKBENCH_CONNECT_TIMEOUT='abc' must be a number"),
    ]:
        monkeypatch.setenv(variable, value)
        assert main([command, *extra]) == 2
        err = capsys.readouterr().err
        assert said in err and "--connect-timeout" not in err, err
        monkeypatch.delenv(variable)


@pytest.mark.parametrize("command", ["status", "doctor", "steer", "monitor"])
def test_the_observers_take_the_secret_owner_and_timeout_variables_the_peers_take(
    command, monkeypatch
) -> None:
    """`WORKBENCH_SECRET=... workbench start` made a private run that `status` in the same shell
    could not find: it read WORKBENCH_RUN_SECRET only (so with WORKBENCH_OWNER and
    WORKBENCH_CONNECT_TIMEOUT; a review, 2026-12-06)."""
    extra = ["/ip4/127.0.0.1/tcp/1", *(["--key", "k"] if command == "steer" else [])]
    monkeypatch.setenv("WORKBENCH_SECRET", "correcthorse42")
    monkeypatch.setenv("WORKBENCH_OWNER", "0123456789abcdef")
    monkeypatch.setenv("WORKBENCH_CONNECT_TIMEOUT", "7")
    args = _observed([command, *extra])
    assert (args.secret, args.owner, args.connect_timeout) == ("correcthorse42", "0123456789abcdef", 7.0)
    # Both set: as the peers take it, WORKBENCH_SECRET (the setting's variable) over --secret's
    # default WORKBENCH_RUN_SECRET, or the observers looked for another run than the peers ran.
    monkeypatch.setenv("WORKBENCH_RUN_SECRET", "the-run-secret")
    assert _observed([command, *extra]).secret == "correcthorse42"
    monkeypatch.delenv("WORKBENCH_SECRET")
    assert _observed([command, *extra]).secret == "the-run-secret"


def test_a_joiner_is_warned_of_shared_settings_its_own_machine_filled_in(
    capsys, monkeypatch, tmp_path
) -> None:
    """The join command carries a shared setting only where the run changed it: a joiner's own
    `WORKBENCH_INNER_LR` or config file filled in the rest, and its peer trained unlike the
    others without a word (the fingerprint covers the model and the outer optimizer only)."""
    import workbench.run.peer

    monkeypatch.setattr(workbench.run.peer, "run_peer", lambda config, on_started=None: {})
    (tmp_path / "mine.toml").write_text("rounds = 5\n")
    monkeypatch.setenv("WORKBENCH_INNER_LR", "0.002")
    address = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    assert main(["join", address, "--config", str(tmp_path / "mine.toml"), "--weight-decay", "0.2"]) == 0
    err = capsys.readouterr().err
    assert "warning: inner_lr 0.002 (env WORKBENCH_INNER_LR), rounds 5 (file " in err, err
    assert "weight_decay" not in err  # a flag: the join command's (or the user's own choice)
    monkeypatch.delenv("WORKBENCH_INNER_LR")
    assert main(["join", address]) == 0 and "warning" not in capsys.readouterr().err
    monkeypatch.setenv("WORKBENCH_INNER_LR", "0.002")
    assert main(["start"]) == 0 and "warning" not in capsys.readouterr().err  # the run's own settings


def test_an_error_holding_a_newline_is_still_one_line(capsys, monkeypatch) -> None:
    """`--tokenizer $'/x\\ny'` printed its error over two lines (the path's newline)."""
    import workbench.run.peer

    def refuse(config, on_started=None):  # type: ignore[no-untyped-def]
        raise ValueError(f"--tokenizer {config.data.tokenizer}: no such folder")

    monkeypatch.setattr(workbench.run.peer, "run_peer", refuse)
    assert main(["start", "--tokenizer", "/x\ny"]) == EXIT_USER_ERROR
    assert "--tokenizer /x\\ny: no such folder" in one_error_line(capsys)


def test_a_demo_refusing_a_setting_from_a_file_names_the_file(capsys, tmp_path) -> None:
    """`shard = "0/4"` in the file a run's peers share: `demo --config` said "drop --shard", a
    flag the user never typed (a review, 2026-12-06)."""
    (tmp_path / "run.toml").write_text('shard = "0/4"\n')
    assert main(["demo", "--config", str(tmp_path / "run.toml"), "--run-dir", str(tmp_path / "d")]) == 2
    line = one_error_line(capsys)
    assert "drop --shard" in line and f"(shard from file {tmp_path / 'run.toml'})" in line, line


def test_the_demos_help_does_not_offer_shard_and_the_flag_is_still_refused(capsys, tmp_path) -> None:
    """`demo --help` listed `--shard I/N`, a flag the demo only refuses (it deals peer I shard I/N)."""
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "--shard" not in capsys.readouterr().out
    assert main(["demo", "--shard", "0/4", "--run-dir", str(tmp_path / "d")]) == 2
    assert "drop --shard" in one_error_line(capsys)


def test_a_demo_whose_peers_ended_apart_does_not_say_they_agree(capsys, monkeypatch, tmp_path) -> None:
    """A peer thawed after the others finished trained 12 rounds alone: the demo printed
    "params agree to 3.3e-01" (a review, 2026-12-06)."""
    import workbench.local.launch as launch

    result = dict(
        peers=2, outer_rounds=4, initial_loss=5.4, final_loss=2.7, params_max_abs_diff=0.33,
        bytes_sent=1e6, seconds=9.0, rounds_alone=12, mean_group_size=1.5, run_dir=str(tmp_path),
    )  # fmt: skip
    monkeypatch.setattr(launch, "run_demo", lambda *args, **kwargs: result)
    monkeypatch.setattr(launch, "run_demo_tui", lambda *args, **kwargs: 0)
    argv = ["demo", "--peers", "2", "--rounds", "4", "--no-tui", "--run-dir", str(tmp_path)]
    assert main(argv) == 0
    said = " ".join(capsys.readouterr().err.split())
    assert "params differ by 3.3e-01 (12 rounds alone" in said and "agree" not in said, said
    result["params_max_abs_diff"] = 3e-8
    assert main(argv) == 0
    assert "params agree to 3.0e-08" in " ".join(capsys.readouterr().err.split())


def test_export_writes_no_formula_and_no_escape_and_skips_nothing_silently(tmp_path, capsys):
    """A review (stop 69): a peer's name is the peer's to choose; `export --csv` wrote
    ``=HYPERLINK(...)`` as a cell a spreadsheet runs, and an escape sequence raw to the
    terminal. A line nested 100,000 deep was a RecursionError traceback."""
    import csv
    import io

    folder = tmp_path / "a"
    folder.mkdir()
    events = [
        {"event": "round", "time": 1.0, "peer": '=HYPERLINK("http://x","y")', "outer_step": 1, "loss": 2.0},
        {"event": "round", "time": 2.0, "peer": "\x1b[2Jboom", "outer_step": 2, "loss": -1.5},
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert main(["export", str(tmp_path), "--csv"]) == 0
    out = capsys.readouterr().out
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["peer"] for r in rows] == ['\'=HYPERLINK("http://x","y")', "\\x1b[2Jboom"]
    assert rows[1]["loss"] == "-1.5" and "\x1b" not in out  # a number stays a number
    (folder / "metrics.jsonl").write_text("[" * 100_000 + "\n" + json.dumps(events[0]) + "\n")
    assert main(["export", str(tmp_path), "--csv"]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl:1 is not a JSON line" in err and "Traceback" not in err


def test_a_fifo_given_as_a_recording_or_metrics_is_refused_not_waited_on(tmp_path, capsys):
    """A review (stop 69): `status --replay FIFO` and `export` of a metrics.jsonl that is a FIFO
    waited for a writer for ever."""
    import os

    fifo = tmp_path / "run.jsonl"
    os.mkfifo(fifo)
    assert main(["status", "--replay", str(fifo)]) == 2
    assert "is not a file" in capsys.readouterr().err
    (tmp_path / "a").mkdir()
    os.mkfifo(tmp_path / "a" / "metrics.jsonl")
    assert main(["export", str(tmp_path)]) == 2
    assert "metrics.jsonl is not a file" in capsys.readouterr().err
