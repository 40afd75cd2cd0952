"""The settings schema (workbench.settings): every way of giving a setting comes from one
declaration, so flags, TOML keys, variables and Experiment keywords cannot drift apart."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from swarm.bounds import BOUNDS
from workbench.cli.command import build_parser
from workbench.cli.configfile import NOT_SETTINGS, layer, settings_of
from workbench.cli.options import build_config, subparser
from workbench.config import RunConfig
from workbench.notebook.experiment import config_from_flags
from workbench.settings.commands import PEER_COMMANDS, command_settings, defaults, values_of

COMMANDS = (*PEER_COMMANDS, "simulate")


@pytest.mark.parametrize("command", COMMANDS)
def test_each_commands_options_are_its_declared_settings(command: str) -> None:
    """The parser holds exactly the schema's settings: same keys, flags, defaults, help, choices."""
    actions = settings_of(subparser(build_parser(), command))
    declared = {k: v for k, v in command_settings(command).items() if k not in NOT_SETTINGS}
    assert set(actions) - {"peers" if command == "join" else ""} - {""} == set(declared)
    parsed = vars(subparser(build_parser(), command).parse_args(["ADDR"] if command == "join" else []))
    for key, item in declared.items():
        action = actions[key]
        assert item.flag in action.option_strings or action.option_strings == ["--no-" + item.flag[2:]]
        assert parsed[key] == defaults(command)[key], key
        assert item.help, f"{key} has no help"
        if item.choices is not None:
            assert tuple(action.choices) == item.choices
        if item.bound is not None:
            assert item.bound in BOUNDS


def test_every_setting_with_a_target_lands_there_in_the_config() -> None:
    """A value given for a setting is read back from the config at the declared place."""
    samples = {"text": "x-1", "int": 2, "float": 0.5, "switch": True, "list": ["/ip4/1.2.3.4/tcp/5"]}
    special = {"codec": "fp16", "data_plane": "hivemind", "aggregate": "trimmed-mean", "wandb_mode": "online"}
    special |= {"run_id": "exp-2", "owner": "0123456789abcdef", "secret": "a-long-secret", "device": "cpu"}
    special |= {"averaging_timeout": 45.0, "matchmaking_time": 1.5, "host": "0.0.0.0"}
    checked = 0
    for key, item in command_settings("start").items():
        if item.target is None or item.target.startswith(("diloco.", "fragments", "sync_delay", "alpha")):
            continue  # the optimizer's go through its method's rules (test_cli, test_launch)
        if key in special:
            value = special[key]
        elif item.bound is not None:
            low, high = BOUNDS[item.bound].low, BOUNDS[item.bound].high
            value = int(low) + 1 if BOUNDS[item.bound].integer else (low + min(high, low + 1)) / 2
        else:
            value = item.choices[-1] if item.choices else samples[item.kind]
        args = values_of("start", {key: value})
        if key in ("tensorboard", "checkpoint_every"):  # each needs a run folder to write in
            args.run_dir = "runs/a"
        if key == "wandb_mode":  # online logs to a project
            args.wandb = "proj"
        if key in ("streaming", "dataset_subset"):  # each shapes how a dataset is read
            args.dataset = "some/dataset"
        if key == "announce":  # to a fixed port
            args.port = 5
        if key == "client_mode":  # a joiner's: the first peer of a run must be reachable
            args.command, args.peers = (
                "join",
                ["/ip4/1.2.3.4/tcp/5/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"],
            )
        assert item.read(build_config(args)) == value, key
        checked += 1
    assert checked >= 25


def test_experiment_keywords_are_checked_as_the_flags_are() -> None:
    with pytest.raises(ValueError, match=r"inner_steps = 0: must be in \[1, 100000\]"):
        config_from_flags("demo", inner_steps=0)
    with pytest.raises(ValueError, match="must be an integer"):
        config_from_flags("demo", inner_steps=10.5)
    with pytest.raises(ValueError, match="did you mean inner_steps"):
        config_from_flags("demo", inner_step=10)
    with pytest.raises(ValueError, match="unknown setting 'announce'.*workbench demo --help"):
        config_from_flags("demo", announce="/ip4/1.2.3.4/tcp/5")  # a peer's, not the demo's
    with pytest.raises(ValueError, match="is not one of"):
        config_from_flags("demo", aggregate="median")
    with pytest.raises(ValueError, match="true or false"):
        config_from_flags("demo", overlap="sometimes")
    config, _ = config_from_flags("demo", inner_lr="2e-3", overlap=True, batch_size=8)  # a number as text too
    assert (config.train.inner_lr, config.diloco.overlap, config.data.batch_size) == (2e-3, True, 8)


def test_experiment_builds_the_config_the_demos_flags_build() -> None:
    """Keywords and flags of the same settings give the same config (without argv)."""
    flags = ["--inner-steps", "10", "--method", "sparseloco", "--outer-lr", "0.5", "--model", "tiny"]
    from_flags = build_config(build_parser().parse_args(["demo", *flags]))
    from_keywords, _ = config_from_flags(
        "demo", inner_steps=10, method="sparseloco", outer_lr=0.5, model="tiny"
    )
    assert repr(from_keywords) == repr(from_flags)
    assert repr(config_from_flags("demo")[0]) == repr(build_config(build_parser().parse_args(["demo"])))


def test_a_switch_from_the_environment_keeps_its_meaning(monkeypatch) -> None:
    """WORKBENCH_EAGER=1 is --eager (it used to read the --no-eager switch and mean the opposite)."""
    parser = build_parser()
    for text, expected in (("1", True), ("off", False)):
        args = parser.parse_args(["start", "--overlap"])
        layer(args, subparser(parser, "start"), ["--overlap"], environ={"WORKBENCH_EAGER": text})
        assert build_config(args).diloco.eager is expected


def test_config_keys_lists_the_schema() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "workbench", "config", "keys", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = json.loads(out)
    commands = [*PEER_COMMANDS, "simulate"]  # one file serves them all
    schema = {k for c in commands for k in command_settings(c)} - {"json"}
    assert set(rows) == schema
    assert rows["inner_steps"]["flag"] == "--inner-steps" and rows["inner_steps"]["commands"] == commands
    assert rows["steps"]["commands"] == ["simulate"]


def test_the_schema_imports_without_torch() -> None:
    code = "import sys, workbench.settings.commands; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_join_commands_of_the_default_run_stay_short() -> None:
    from workbench.cli.argv import join_command

    assert join_command(RunConfig(), ["ADDR"]) == "workbench join ADDR"
    assert isinstance(values_of("start", {}), argparse.Namespace)
