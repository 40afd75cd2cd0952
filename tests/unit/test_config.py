"""Unit tests for the config tree (workbench.config and the component configs it holds).

Every bad value is refused where the config is built, with a one-line message that names the
value, so the CLI, the TUI and notebooks all show the same fix.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from optim.diloco import DiLoCoConfig
from swarm.averaging_config import CODEC_BYTES, AveragingConfig
from swarm.dht import NetworkConfig
from swarm.errors import SwarmError
from swarm.records import check_run_id
from workbench.config import PeerConfig, RunConfig, TrainConfig
from workbench.run.data import DataConfig
from workbench.run.model import ModelConfig, small

PEER_ID = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


# (config class, kwargs, error type, substrings the one-line message must hold)
BAD_VALUES = [
    # TrainConfig
    (TrainConfig, dict(inner_lr=0.0), ValueError, ["inner lr", "0.0"]),
    (TrainConfig, dict(inner_lr=1.0), ValueError, ["inner lr", "1.0"]),
    (TrainConfig, dict(inner_lr=-0.001), ValueError, ["inner lr", "-0.001"]),
    (TrainConfig, dict(inner_lr=float("nan")), ValueError, ["inner lr", "nan"]),
    (TrainConfig, dict(weight_decay=-0.1), ValueError, ["weight decay", "-0.1"]),
    (TrainConfig, dict(weight_decay=1.0), ValueError, ["weight decay", "1.0"]),
    (TrainConfig, dict(beta1=1.0), ValueError, ["beta1", "1.0"]),
    (TrainConfig, dict(beta2=-0.5), ValueError, ["beta2", "-0.5"]),
    (TrainConfig, dict(warmup_steps=-1), ValueError, ["warmup", "-1"]),
    (TrainConfig, dict(grad_clip=-1.0), ValueError, ["grad clip", "-1.0"]),
    (TrainConfig, dict(threads=-2), ValueError, ["threads", "-2"]),
    # PeerConfig
    (PeerConfig, dict(run_id=""), SwarmError, ["run id", "''"]),
    (PeerConfig, dict(run_id="a.b"), SwarmError, ["run id", "a.b"]),
    (PeerConfig, dict(name=""), ValueError, ["name", "0"]),
    (PeerConfig, dict(name="x" * 65), ValueError, ["name", "65"]),
    (PeerConfig, dict(rounds=-1), ValueError, ["rounds", "-1"]),
    (PeerConfig, dict(min_peers=0), ValueError, ["min peers", "0"]),
    (PeerConfig, dict(min_peers=1025), ValueError, ["min peers", "1025"]),
    (PeerConfig, dict(wait_timeout=-1.0), ValueError, ["wait timeout", "-1.0"]),
    (PeerConfig, dict(eval_every=0), ValueError, ["eval every", "(got 0)"]),
    (PeerConfig, dict(eval_batches=0), ValueError, ["eval batches", "(got 0)"]),
    # AveragingConfig
    (AveragingConfig, dict(compression="zstd"), SwarmError, ["'zstd'", "none"]),
    (AveragingConfig, dict(matchmaking_time=0.05), SwarmError, ["matchmaking", "0.05"]),
    (AveragingConfig, dict(matchmaking_time=121.0), SwarmError, ["matchmaking", "121.0"]),
    (AveragingConfig, dict(matchmaking_time=float("nan")), SwarmError, ["matchmaking", "nan"]),
    (AveragingConfig, dict(averaging_timeout=1.0), SwarmError, ["averaging timeout", "1.0"]),
    (AveragingConfig, dict(averaging_timeout=4000.0), SwarmError, ["averaging timeout", "4000.0"]),
    (AveragingConfig, dict(round_wait=-1.0), SwarmError, ["round wait", "-1.0"]),
    (AveragingConfig, dict(round_wait=3601.0), SwarmError, ["round wait", "3601.0"]),
    # NetworkConfig
    (NetworkConfig, dict(initial_peers=["nope"]), SwarmError, ["'nope'", "multiaddr"]),
    (
        NetworkConfig,
        dict(initial_peers=["/ip4/1.2.3.4/tcp/4000"]),
        SwarmError,
        ["/ip4/1.2.3.4/tcp/4000", "peer id"],
    ),
    (NetworkConfig, dict(host="localhost"), SwarmError, ["'localhost'"]),
    (NetworkConfig, dict(port=70000), SwarmError, ["70000"]),
    (NetworkConfig, dict(announce=["/ip4/1.2.3.4"]), SwarmError, ["/ip4/1.2.3.4", "port"]),
    (NetworkConfig, dict(connect_timeout=0.5), SwarmError, ["connect timeout", "0.5"]),
    (NetworkConfig, dict(connect_timeout=601.0), SwarmError, ["connect timeout", "601.0"]),
    # DiLoCoConfig (more in test_diloco.py)
    (DiLoCoConfig, dict(inner_steps=0), ValueError, ["inner_steps", "0"]),
    (DiLoCoConfig, dict(outer_lr=11.0), ValueError, ["outer_lr", "11.0"]),
]


def _case_id(case: Any) -> str | None:
    if isinstance(case, type):
        return case.__name__
    if isinstance(case, dict):
        return ",".join(f"{k}={v!r}"[:24] for k, v in case.items())
    return ""


@pytest.mark.parametrize(("cls", "kwargs", "error", "hints"), BAD_VALUES, ids=_case_id)
def test_bad_values_are_refused_with_a_one_line_message(
    cls: type, kwargs: dict[str, Any], error: type[Exception], hints: list[str]
) -> None:
    with pytest.raises(error) as info:
        cls(**kwargs)
    message = str(info.value)
    assert "\n" not in message, f"not one line: {message!r}"
    for hint in hints:
        assert hint in message, f"{hint!r} not in {message!r}"


def test_every_config_error_is_caught_by_the_cli() -> None:
    """The CLI catches (ValueError, SwarmError); AddressError must be one of those."""
    from swarm.addresses import AddressError

    assert issubclass(AddressError, SwarmError)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [(TrainConfig, dict(grad_clip=float("nan"))), (PeerConfig, dict(wait_timeout=float("nan")))],
    ids=["grad_clip=nan", "wait_timeout=nan"],
)
def test_nan_is_refused(cls: type, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="nan"):
        cls(**kwargs)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (
            TrainConfig,
            dict(inner_lr=0.5, weight_decay=0.0, beta1=0.0, beta2=0.999, warmup_steps=0, grad_clip=0.0),
        ),
        (TrainConfig, dict(threads=1)),
        (PeerConfig, dict(run_id="demo-1_a", name="x" * 64, rounds=0, min_peers=1024, wait_timeout=0.0)),
        (AveragingConfig, dict(matchmaking_time=0.1, averaging_timeout=3600.0, round_wait=0.0)),
        (
            NetworkConfig,
            dict(initial_peers=[f"/ip4/1.2.3.4/tcp/4000/p2p/{PEER_ID}"], host="0.0.0.0", port=31337),
        ),
        (NetworkConfig, dict(announce=["/ip4/203.0.113.7/tcp/31337"], port=31337, connect_timeout=1.0)),
    ],
    ids=_case_id,
)
def test_edge_values_are_accepted(cls: type, kwargs: dict[str, Any]) -> None:
    cls(**kwargs)


@pytest.mark.parametrize("codec", sorted(CODEC_BYTES))
def test_every_codec_name_is_accepted(codec: str) -> None:
    assert AveragingConfig(compression=codec).compression == codec


# --- RunConfig ------------------------------------------------------------------------------------


def test_run_config_defaults() -> None:
    config = RunConfig()
    assert config.model == small() and isinstance(config.model, ModelConfig)
    assert isinstance(config.data, DataConfig) and config.data.path is None
    assert (config.diloco.inner_steps, config.diloco.outer_lr, config.diloco.outer_momentum) == (50, 0.7, 0.9)
    assert config.diloco.nesterov
    assert config.averaging.compression == "none"
    assert config.network.initial_peers == [] and config.network.host == "127.0.0.1"
    assert config.peer.run_id == "workbench"
    assert config.train.inner_lr == 1e-3


def test_run_configs_do_not_share_mutable_defaults() -> None:
    a, b = RunConfig(), RunConfig()
    a.network.initial_peers.append("x")
    a.network.announce.append("y")
    assert b.network.initial_peers == [] and b.network.announce == []
    assert a.train is not b.train and a.model is not b.model


def test_run_config_checks_its_parts_when_they_are_built() -> None:
    with pytest.raises(ValueError, match="inner_steps"):
        RunConfig(diloco=DiLoCoConfig(inner_steps=0))


# --- TrainConfig.lr_factor ---------------------------------------------------------------------------


@pytest.mark.parametrize("total", [None, 1000])
def test_lr_warms_up_linearly(total: int | None) -> None:
    train = TrainConfig(warmup_steps=4)
    assert [train.lr_factor(step, total) for step in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])


@pytest.mark.parametrize("total", [None, 0, 10, 5])
def test_lr_is_constant_after_warmup_without_a_known_length(total: int | None) -> None:
    """No total (or one within the warmup): no decay."""
    train = TrainConfig(warmup_steps=10)
    assert [train.lr_factor(step, total) for step in (10, 11, 100, 10_000)] == [1.0] * 4


def test_lr_cosine_decays_to_a_tenth_at_the_end() -> None:
    train = TrainConfig(warmup_steps=10)
    total = 110
    assert train.lr_factor(10, total) == pytest.approx(1.0)
    assert train.lr_factor(60, total) == pytest.approx(0.55)  # half way: 0.1 + 0.9 * 0.5
    assert train.lr_factor(total, total) == pytest.approx(0.1)
    assert train.lr_factor(10 * total, total) == pytest.approx(0.1)  # clamped past the end
    factors = [train.lr_factor(step, total) for step in range(total + 1)]
    after_warmup = factors[10:]
    assert all(a >= b for a, b in zip(after_warmup, after_warmup[1:])), "must not increase after warmup"
    assert all(0.1 - 1e-12 <= f <= 1.0 for f in factors)


def test_lr_without_warmup_starts_at_the_peak() -> None:
    train = TrainConfig(warmup_steps=0)
    assert train.lr_factor(0, None) == 1.0
    assert train.lr_factor(0, 100) == pytest.approx(1.0)
    assert train.lr_factor(50, 100) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


# --- run ids ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("run_id", ["demo-1_a", "a", "A9", "workbench", "x" * 64, "1-run"])
def test_check_run_id_accepts(run_id: str) -> None:
    assert check_run_id(run_id) == run_id


@pytest.mark.parametrize(
    "run_id", ["", "a.b", "with space", "x" * 65, "-leading-dash", "_x", "a/b", "ünïcode", "a:b"], ids=repr
)
def test_check_run_id_rejects(run_id: str) -> None:
    with pytest.raises(SwarmError) as info:
        check_run_id(run_id)
    message = str(info.value)
    assert "\n" not in message and f"'{run_id}'" in message
    assert "letters, digits" in message


def test_check_run_id_rejects_a_trailing_newline() -> None:
    with pytest.raises(SwarmError):
        check_run_id("abc\n")


def test_every_bound_is_documented():
    from pathlib import Path

    from swarm.bounds import BOUNDS

    text = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for name, bound in BOUNDS.items():
        assert f"| `--{name.replace('_', '-')}` | {bound.describe()}" in text, name
