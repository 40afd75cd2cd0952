"""Unit tests for DHT records (swarm.records), the group-consistency check and the wire codecs.

Importing swarm.averaging imports hivemind (no DHT or averager is started here).
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hivemind.compression import CompressionInfo
from pydantic import ValidationError

from swarm.averaging import CODECS
from swarm.averaging_config import CODEC_BYTES
from swarm.gathered import disowned_by_its_donor, diverged_from_group, held_by_most, holding_the_same_state
from swarm.records import PeerHeartbeat, Stage

REPO_ROOT = Path(__file__).resolve().parents[2]

# Two real-looking peer ids; ID_A < ID_B as strings.
ID_A = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
ID_B = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
ID_C = "12D3KooWRAaoUUiDeqzh1ssh3jcWmuBvh8m4jEvD6PWCGpCHdP4M"
ID_D = "12D3KooWZzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz"  # after the others


# --- PeerHeartbeat ----------------------------------------------------------------------------------


def heartbeat(**overrides: Any) -> dict[str, Any]:
    record = dict(
        peer_id=ID_A,
        name="peer-0",
        stage="training",
        outer_step=3,
        inner_step=7,
        inner_steps=50,
        loss=2.5,
        samples_per_second=120.5,
        bytes_sent=1024,
        bytes_received=2048,
        device="cpu",
        time=1_700_000_000.25,
        last_round_seconds=3.5,
        group_size=4,
        control_version=2,
        protocol=0,
        control_refused=0,
        control_refusal="",
        addresses=["/ip4/127.0.0.1/tcp/31337/p2p/" + ID_A],
        tokens_per_second=15424.0,
        dp_bytes=10_000_000,
        rounds=40,
        last_error=None,
        ignored={},
        averaged_with=[],
        serving=False,
        last_round_steps=0,
        round_wait_seconds=0.0,
        averaging_deadline_seconds=0.0,
        matchmaking_window_seconds=0.0,
        last_round_spread=0.0,
        last_round_last="",
        last_round_alone="",
        download_progress=0.0,
        download_donors=0,
        final_theta=[],
        settled=False,
    )
    record.update(overrides)
    return record


def test_stage_values_are_the_documented_strings() -> None:
    assert [s.value for s in Stage] == [
        "joining",
        "downloading",
        "training",
        "waiting",
        "averaging",
        "paused",
        "finishing",
        "leaving",
    ]
    assert Stage("averaging") is Stage.AVERAGING
    assert Stage.TRAINING == "training"  # a str enum: stored in the DHT as plain text


def test_heartbeat_round_trips_through_json() -> None:
    beat = PeerHeartbeat.model_validate(heartbeat())
    dumped = beat.model_dump(mode="json")
    assert dumped["stage"] == "training" and isinstance(dumped["stage"], str)
    assert dumped == heartbeat()
    again = PeerHeartbeat.model_validate(dumped)
    assert again == beat
    assert again.stage is Stage.TRAINING


@pytest.mark.parametrize("stage", list(Stage))
def test_every_stage_round_trips(stage: Stage) -> None:
    beat = PeerHeartbeat.model_validate(heartbeat(stage=stage.value))
    assert PeerHeartbeat.model_validate(beat.model_dump(mode="json")).stage is stage


def test_heartbeat_optional_fields_default() -> None:
    minimal = {
        k: v
        for k, v in heartbeat().items()
        if k in {"peer_id", "name", "stage", "outer_step", "inner_step", "inner_steps", "time"}
    }
    beat = PeerHeartbeat.model_validate(minimal)
    assert beat.loss is None and beat.samples_per_second == 0.0 and beat.device == "cpu"
    assert beat.bytes_sent == 0 and beat.bytes_received == 0


def test_a_newer_peers_extra_fields_are_ignored() -> None:
    """Forward compatible: a heartbeat from a newer version still parses (its extras dropped)."""
    beat = PeerHeartbeat.model_validate(heartbeat(gpu_temperature=71))
    assert beat.peer_id == ID_A and "gpu_temperature" not in beat.model_dump()


def test_heartbeat_is_frozen() -> None:
    beat = PeerHeartbeat.model_validate(heartbeat())
    with pytest.raises(ValidationError):
        beat.outer_step = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(dict(outer_step=-1), id="negative-outer-step"),
        pytest.param(dict(inner_step=-1), id="negative-inner-step"),
        pytest.param(dict(inner_steps=0), id="zero-inner-steps"),
        pytest.param(dict(stage="dancing"), id="unknown-stage"),
        pytest.param(dict(name="x" * 65), id="name-too-long"),
        pytest.param(dict(peer_id="x" * 129), id="peer-id-too-long"),
        pytest.param(dict(device="x" * 33), id="device-too-long"),
        pytest.param(dict(samples_per_second=-1.0), id="negative-speed"),
        pytest.param(dict(bytes_sent=-5), id="negative-bytes"),
        pytest.param(dict(outer_step="many"), id="outer-step-not-a-number"),
        pytest.param(dict(time=None), id="no-time"),
    ],
)
def test_malformed_heartbeats_are_rejected(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        PeerHeartbeat.model_validate(heartbeat(**overrides))


@pytest.mark.parametrize(
    "missing", ["peer_id", "name", "stage", "outer_step", "inner_step", "inner_steps", "time"]
)
def test_heartbeat_requires_its_core_fields(missing: str) -> None:
    record = heartbeat()
    del record[missing]
    with pytest.raises(ValidationError):
        PeerHeartbeat.model_validate(record)


# --- diverged_from_group -------------------------------------------------------------------------------


def member(peer: str, outer_step: int, fingerprint: list[float]) -> dict[str, Any]:
    return {"peer": peer, "outer_step": outer_step, "fingerprint": fingerprint}


FP = [1.25, 3.5, 0.75]
OTHER_FP = [1.5, 3.0, 0.5]


def test_alone_is_never_diverged() -> None:
    mine = member(ID_A, 4, FP)
    assert diverged_from_group(mine, [mine]) is None
    assert diverged_from_group(mine, []) is None


def test_a_peer_behind_the_group_must_download() -> None:
    mine = member(ID_A, 3, FP)
    reason = diverged_from_group(mine, [mine, member(ID_B, 4, FP)])
    assert reason is not None and "behind" in reason
    assert "3" in reason and "4" in reason


def test_a_peer_ahead_of_the_group_keeps_its_state() -> None:
    mine = member(ID_B, 4, FP)
    assert diverged_from_group(mine, [member(ID_A, 3, OTHER_FP), mine]) is None


def test_same_step_and_same_fingerprint_is_consistent() -> None:
    group = [member(ID_A, 5, FP), member(ID_B, 5, list(FP)), member(ID_C, 5, list(FP))]
    for mine in group:
        assert diverged_from_group(mine, group) is None


def test_the_odd_one_out_must_download() -> None:
    odd = member(ID_A, 5, OTHER_FP)  # lowest id, but outvoted
    group = [odd, member(ID_B, 5, FP), member(ID_C, 5, FP)]
    reason = diverged_from_group(odd, group)
    assert reason is not None and "differ" in reason and "2 of 3" in reason
    assert diverged_from_group(group[1], group) is None
    assert diverged_from_group(group[2], group) is None


@pytest.mark.parametrize("order", [(ID_A, ID_B), (ID_B, ID_A)])
def test_a_one_to_one_tie_goes_to_the_lower_peer_id(order: tuple[str, str]) -> None:
    group = [member(order[0], 2, FP), member(order[1], 2, OTHER_FP)]
    verdicts = {m["peer"]: diverged_from_group(m, group) for m in group}
    told = [peer for peer, reason in verdicts.items() if reason is not None]
    assert told == [max(ID_A, ID_B)], verdicts  # exactly one downloads: the higher id
    assert verdicts[min(ID_A, ID_B)] is None


def test_in_a_two_to_two_split_the_outvoted_pair_avoid_each_other_as_donors() -> None:
    """The pair holding the θ that lost the vote must not fetch it back from each other: in the
    churn soak two such peers swapped the same wrong θ every round to the end of the run."""
    winners = [member(ID_A, 7, FP), member(ID_B, 7, list(FP))]  # ID_A is the lowest id
    losers = [member(ID_C, 7, OTHER_FP), member(ID_D, 7, list(OTHER_FP))]
    group = [*winners, *losers]
    for mine in winners:
        assert diverged_from_group(mine, group) is None
    for mine in losers:
        assert "2 of 4" in (diverged_from_group(mine, group) or "")
    assert holding_the_same_state(losers[0], group) == {ID_D}
    assert holding_the_same_state(losers[1], group) == {ID_C}
    assert holding_the_same_state(winners[0], group) == {ID_B}
    # Another step is another state; a member whose info does not parse holds nothing.
    assert holding_the_same_state(losers[0], [*group, member("later", 8, OTHER_FP), {"peer": "x"}]) == {ID_D}
    assert holding_the_same_state({"peer": ID_C}, group) == set()


def test_a_donor_whose_own_fingerprint_disowns_the_state_it_served_is_left_out() -> None:
    """A joiner took the liar's made-up θ at outer step 0 with nobody to check it; at the round
    the liar's own fingerprint sides with the honest peer's: the liar served a θ it does not
    hold, so the joiner's next download neither takes its state nor counts its sketches."""
    joiner, honest, liar = member(ID_A, 0, OTHER_FP), member(ID_B, 0, FP), member(ID_C, 0, list(FP))
    group = [joiner, honest, liar]
    assert diverged_from_group(joiner, group) is not None
    took = (ID_C, 0)  # (donor, outer step) of this peer's last download
    assert disowned_by_its_donor(joiner, group, took) == {ID_C}
    # The honest donor of the θ the group holds is not.
    assert not disowned_by_its_donor(member(ID_A, 0, FP), group, took)
    # A donor that holds what it served (both outvoted) is not: holding_the_same_state avoids it.
    assert not disowned_by_its_donor(joiner, [joiner, honest, member(ID_C, 0, OTHER_FP)], took)
    # In a pair too, whichever way its tie of fingerprints went (here the joiner's, the lower id:
    # it would have kept the made-up θ): half is not most.
    assert diverged_from_group(joiner, [joiner, liar]) is None
    assert disowned_by_its_donor(joiner, [joiner, liar], took) == {ID_C}
    assert not held_by_most(joiner, [joiner, liar])
    # A donor on the losing side of a split, the joiner on the winning one (the churn soak):
    # most of the round hold the joiner's θ, and it stands.
    split = [member(ID_A, 0, FP), member(ID_B, 0, FP), member(ID_C, 0, OTHER_FP), member(ID_D, 0, FP)]
    assert disowned_by_its_donor(split[0], split, took) == {ID_C}
    assert held_by_most(split[0], split) and not held_by_most(split[2], split)
    assert not held_by_most(split[0], split, ignored=[ID_B, ID_D])  # liars count for nothing
    # A round since the download, the donor at another step or not in the round, no download,
    # a malformed info: no evidence.
    assert not disowned_by_its_donor(
        member(ID_A, 1, OTHER_FP), [member(ID_B, 1, FP), member(ID_C, 1, FP)], took
    )
    assert not disowned_by_its_donor(joiner, [joiner, honest, member(ID_C, 1, FP)], took)
    assert not disowned_by_its_donor(joiner, [joiner, honest], took)
    assert not disowned_by_its_donor(joiner, group, None)
    assert not disowned_by_its_donor({"peer": ID_A}, group, took)


def test_peers_to_avoid_are_neither_donors_nor_witnesses_of_a_download() -> None:
    from swarm.download import Downloading

    asked: list[tuple[set[str], set[str]]] = []

    class Probe(Downloading):
        _refused_donors = {"refused"}
        peer_id, board = "me", _Board()

        def _fetch_state(self, skipped, distrusted, deadline):
            asked.append((set(skipped), set(distrusted)))
            return None  # nobody served

    assert Probe().download_state(avoid=["mate"]) is None
    assert asked == [({"refused", "mate"}, {"refused", "mate"})]


class _Board:
    def __init__(self, *beats) -> None:
        self.beats = {b.peer_id: b for b in beats}

    def fetch(self):
        return dict(self.beats)

    def ignore(self, peer, why) -> None:
        pass


def test_a_paused_peer_is_neither_donor_nor_witness_while_another_trains() -> None:
    """A paused peer's θ stands still on purpose: a joiner took it as a witness (it could not
    confirm the running peer's state) and as a donor (its old state refused), 36 times, then
    started from the seed's init, while the run was hundreds of rounds in."""
    from swarm.download import Downloading
    from swarm.records import PeerHeartbeat, Stage

    def beat(peer: str, step: int, stage: Stage) -> PeerHeartbeat:
        return PeerHeartbeat(
            peer_id=peer,
            name=peer,
            stage=stage,
            outer_step=step,
            inner_step=0,
            inner_steps=5,
            time=1.0,
            addresses=["/ip4/127.0.0.1/tcp/1"],
        )

    asked: list[tuple[set[str], dict[str, int]]] = []

    class Probe(Downloading):
        _refused_donors: set[str] = set()
        peer_id = "me"

        def __init__(self, *beats) -> None:
            self.board = _Board(*beats)
            from swarm.claims import Vouching

            self.vouching = Vouching()

        def _fetch_state(self, skipped, distrusted, deadline):
            asked.append((set(skipped), self._verifiers(distrusted)[0]))
            return None

    Probe(beat("running", 616, Stage.TRAINING), beat("paused", 515, Stage.PAUSED)).download_state()
    assert asked[-1] == ({"paused"}, {"running": 616})
    Probe(beat("paused", 515, Stage.PAUSED)).download_state()  # nobody else: the paused peer serves
    assert asked[-1] == (set(), {})
    # The running peer cannot serve in this call (avoided): the paused one may.
    Probe(beat("running", 616, Stage.TRAINING), beat("paused", 515, Stage.PAUSED)).download_state(
        avoid=["running"]
    )
    assert asked[-1][0] == {"running"}


def test_a_peer_waiting_for_min_peers_witnesses_a_state_at_its_own_step_only() -> None:
    """A peer "joining" waits for ``--min-peers`` (it started the run or downloaded already): a
    joiner arriving then had no witness at all and took a lying donor's made-up θ on its word.
    Such a peer is asked now, when nobody else is there to ask, and counted when it answers for
    the state's step; at another step (the seed's init after a failed download) or silent, it
    counts for nothing, where a peer training would make the state unconfirmed or refused.
    Beside peers that train it is not asked: fresh joiners say "joining" for a moment (their
    init θ at outer step 0), those at the donor's step are asked first, and a peer at step 232
    asked only them about a step-0 state (the churn soak) and took it."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from swarm.claims import Vouching
    from swarm.download import Downloading
    from swarm.records import PeerHeartbeat, Stage
    from swarm.sketch import state_sketches

    def beat(peer: str, step: int, stage: Stage) -> PeerHeartbeat:
        return PeerHeartbeat(
            peer_id=peer, name=peer, stage=stage, outer_step=step, inner_step=0, inner_steps=5, time=1.0,
            addresses=["/ip4/127.0.0.1/tcp/1"],
        )  # fmt: skip

    theta, made_up = [torch.ones(8)], [torch.full((8,), 2.0)]

    class Probe(Downloading):
        _refused_donors: set[str] = set()
        peer_id = "me"

        def __init__(self, answers) -> None:
            self.board = _Board(
                beat("waiting", 4, Stage.JOINING),
                beat("fetching", 4, Stage.DOWNLOADING),
                beat("liar", 4, Stage.JOINING),  # it waits for --min-peers too
            )
            self.vouching, self.answers, self.asked = Vouching(), answers, []
            nobody = Future()
            nobody.set_result(None)
            self.averager = SimpleNamespace(
                load_state_from_peers=lambda **_: nobody, streamed_from=lambda tag: [], download=[0.0] * 3
            )

        def _fetch_direct(self, skipped, verifiers, deadline):
            self.asked.append(dict(verifiers))
            if "liar" in skipped:
                return None  # nobody else serves (nor over hivemind's stream, below)
            metadata = dict(outer_step=4, num_params=1, num_pending=0, inner_keys=[])
            answers = {peer: got(b"seed") for peer, got in self.answers.items() if peer in verifiers}
            return metadata, [made_up[0], torch.zeros(8)], "liar", dict.fromkeys(answers, b"seed"), answers

    sketched = lambda step, params: lambda seed: (step, state_sketches(params, seed))  # noqa: E731
    probe = Probe({"waiting": sketched(4, theta)})
    assert probe.download_state(timeout=5.0) is None  # the waiting peer contradicts the liar
    assert set(probe.asked[0]) == {"waiting", "liar"}  # the downloading peer is not asked
    # Waiting at another step, or silent: no word either way (the donor is the only witness).
    for answer in (sketched(0, theta), lambda seed: None):
        probe = Probe({"waiting": answer})
        assert probe.download_state(timeout=5.0) is not None
        assert probe.vouching.witnessed == {"liar"}  # taken on the donor's word: its donor alone
    probe = Probe({"waiting": sketched(4, made_up)})  # it holds the served θ: confirmed
    assert probe.download_state(timeout=5.0) is not None
    assert probe.vouching.witnessed == {"waiting", "liar"} and probe.vouching.witnessed_step == 4
    # A peer training at another step still has its say: nobody at the state's step, refused.
    probe = Probe({"waiting": lambda seed: None})
    probe.board.beats["waiting"] = beat("waiting", 3, Stage.TRAINING)
    probe.answers["waiting"] = sketched(3, theta)
    assert probe.download_state(timeout=5.0) is None
    # Beside a peer that trains, one joining is not asked by a peer that averaged before (here
    # it would have confirmed).
    probe = Probe({"waiting": sketched(4, made_up), "trains": sketched(5, theta)})
    probe.vouching.averaged_with(["trains"])
    probe.board.beats["trains"] = beat("trains", 5, Stage.TRAINING)
    assert probe.download_state(timeout=5.0) is None  # "trains" was past step 4 before: old
    assert set(probe.asked[0]) == {"trains"}, probe.asked
    # A fresh joiner asks it after the others: one fresh key saying "training" (silent, at any
    # step), or the liar itself saying so, left it no witness, and it took the made-up θ.
    for fake in ("fresh-key", "liar"):
        probe = Probe({"waiting": sketched(4, theta)})
        probe.board.beats[fake] = beat(fake, 9, Stage.TRAINING)
        assert probe.download_state(timeout=5.0) is None  # the waiting peer contradicts the liar
        assert "waiting" in probe.asked[0], probe.asked


def test_a_donor_its_round_mates_contradict_is_refused_not_ignored() -> None:
    """It may be an honest peer on the losing side of a split: in the churn soak, ignoring such
    donors for the rest of the run left honest peers invisible to each other's barrier."""
    from optim.state import OuterState
    from swarm.claims import Vouching
    from swarm.download import Downloading
    from swarm.sketch import state_sketches

    ignored: list[str] = []

    class Probe(Downloading):
        vouching, _refused_donors = Vouching(), set()
        peer_id = "me"
        board = type(
            "Board", (), {"ignore": lambda self, peer, why: ignored.append(peer), "fetch": lambda self: {}}
        )()

        def _fetch_state(self, skipped, distrusted, deadline):
            if "other-side" in skipped:
                return None
            seed, theirs = b"seed", [torch.ones(8)]
            served = OuterState(outer_step=5, params=[torch.zeros(8)], momentum=[torch.zeros(8)])
            return (
                served,
                "other-side",
                {"mate": seed},
                {"mate": (5, state_sketches(theirs, seed))},
                {"mate": 5},
            )

    probe = Probe()
    probe.vouching.averaged_with(["mate"])
    assert probe.download_state() is None
    assert probe._refused_donors == {"other-side"} and not ignored


def test_a_tie_goes_to_the_lower_peer_id_even_when_one_id_is_a_prefix() -> None:
    short, long = "peerA", "peerAB"  # "peerA" < "peerAB"
    group = [member(short, 2, FP), member(long, 2, OTHER_FP)]
    assert diverged_from_group(group[0], group) is None
    assert diverged_from_group(group[1], group) is not None


def test_tiny_relative_differences_count_as_equal() -> None:
    nudged = [x * (1 + 1e-9) for x in FP]
    group = [member(ID_A, 1, FP), member(ID_B, 1, nudged)]
    assert diverged_from_group(group[0], group) is None
    assert diverged_from_group(group[1], group) is None


def test_differences_above_the_tolerance_count() -> None:
    nudged = [x * (1 + 1e-3) for x in FP]
    group = [member(ID_A, 1, FP), member(ID_B, 1, nudged)]
    assert (diverged_from_group(group[0], group) is None) != (diverged_from_group(group[1], group) is None)


def test_fingerprints_of_another_length_differ() -> None:
    group = [member(ID_A, 1, FP), member(ID_B, 1, FP[:2]), member(ID_C, 1, FP)]
    assert diverged_from_group(group[1], group) is not None
    assert diverged_from_group(group[0], group) is None


def test_only_members_at_the_top_step_vote() -> None:
    """A straggler at a lower step does not make the leaders' tie a majority."""
    group = [member(ID_A, 5, FP), member(ID_B, 5, OTHER_FP), member(ID_C, 4, OTHER_FP)]
    assert diverged_from_group(group[0], group) is None
    assert diverged_from_group(group[1], group) is not None
    assert "behind" in (diverged_from_group(group[2], group) or "")


def test_my_own_entry_need_not_be_in_the_group() -> None:
    mine = member(ID_B, 2, OTHER_FP)
    assert diverged_from_group(mine, [member(ID_A, 2, FP)]) is not None
    assert diverged_from_group(member(ID_A, 2, FP), [mine]) is None


def test_non_dict_group_entries_are_ignored() -> None:
    mine = member(ID_A, 2, FP)
    assert diverged_from_group(mine, [mine, None, "junk", 3]) is None  # type: ignore[list-item]


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"peer": ID_B, "outer_step": "x", "fingerprint": FP}, id="outer-step-str"),
        pytest.param({"peer": ID_B, "outer_step": None, "fingerprint": FP}, id="outer-step-none"),
        pytest.param({"peer": ID_B, "outer_step": 2, "fingerprint": ["a", "b", "c"]}, id="fingerprint-str"),
    ],
)
def test_a_malformed_member_does_not_crash_the_check(bad: dict[str, Any]) -> None:
    mine = member(ID_A, 2, FP)
    assert diverged_from_group(mine, [mine, bad, member(ID_C, 2, FP)]) is None


# --- wire codecs -----------------------------------------------------------------------------------


def test_codecs_match_the_config_names() -> None:
    assert set(CODECS) == set(CODEC_BYTES) == {"none", "fp16", "int8"}


def round_trip(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    codec = CODECS[name]()
    serialized = codec.compress(tensor, CompressionInfo.from_tensor(tensor))
    return codec.extract(serialized), len(serialized.buffer)


@pytest.fixture
def uniform() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.rand(10_000, generator=g, dtype=torch.float32) * 2 - 1  # (10000,) in [-1, 1)


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch deprecates quantize_per_tensor, used by int8
@pytest.mark.parametrize("name", ["none", "fp16", "int8"])
def test_codec_round_trip_error_is_bounded(name: str, uniform: torch.Tensor) -> None:
    """Regression test for hivemind 1.1.12's 8-bit codec, which crashes on numpy >= 2.4."""
    restored, size = round_trip(name, uniform)
    assert restored.shape == uniform.shape and restored.dtype == torch.float32
    error = (restored - uniform).abs().max().item()
    scale = uniform.abs().max().item()
    if name == "none":
        assert error == 0.0
    elif name == "fp16":
        torch.testing.assert_close(restored, uniform, rtol=1e-2, atol=1e-6)
        assert error <= 1e-2 * scale
    else:
        assert error <= 0.05 * scale, f"int8 error {error} > 5% of max |x| {scale}"
    # the payload is about CODEC_BYTES per element (int8 adds a 256-entry codebook)
    assert size == pytest.approx(CODEC_BYTES[name] * uniform.numel(), rel=0.15)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_int8_is_accurate_within_three_sigma_of_gaussian_data() -> None:
    """hivemind's Uniform8BitQuantization spans ±3σ around the mean: values beyond are clipped
    (for N(0, 1) data the error at a 4σ outlier is about 1σ), those within are within a bin."""
    g = torch.Generator().manual_seed(1)
    t = torch.randn(10_000, generator=g, dtype=torch.float32)
    restored, _ = round_trip("int8", t)
    inside = (t - t.mean()).abs() <= 2.9 * t.std()
    error_inside = (restored - t)[inside].abs().max().item()
    assert error_inside <= 0.05 * t.abs().max().item()
    assert torch.isfinite(restored).all()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", ["none", "fp16", "int8"])
def test_codecs_handle_a_2d_tensor_and_zeros(name: str) -> None:
    t = torch.zeros(7, 5)  # (7, 5)
    t[0, 0] = 1.0
    restored, _ = round_trip(name, t)
    assert restored.shape == (7, 5)
    assert torch.isfinite(restored).all()


def test_numpy_is_below_2_4_for_hiveminds_int8_codec() -> None:
    major, minor = (int(part) for part in np.__version__.split(".")[:2])
    assert (major, minor) < (2, 4), (
        f"numpy {np.__version__} breaks hivemind 1.1.12's 8-bit codecs (int() on an array); "
        "keep the numpy<2.4 pin in pyproject.toml"
    )
    assert '"numpy>=1.26,<2.4"' in (REPO_ROOT / "pyproject.toml").read_text()


def test_served_state_round_trips_with_queued_updates() -> None:
    """What GroupAverager sends, _parse_state rebuilds (params, momentum, queue, inner)."""
    from swarm.download import _parse_state
    from swarm.errors import SwarmError

    params = [torch.randn(3, 2), torch.randn(4)]
    momentum = [torch.randn(3, 2) * 0.1, torch.randn(4) * 0.1]  # in proportion to θ, as honest ones are
    queued = [[torch.randn(3, 2) * 0.01, torch.randn(4) * 0.01]]
    inner = [torch.randn(3, 2)]
    metadata = {"outer_step": 7, "num_params": 2, "num_pending": 1, "inner_keys": [[0, "exp_avg"]]}
    state = _parse_state(metadata, [*params, *momentum, *queued[0], *inner])
    assert state.outer_step == 7
    assert all(torch.equal(a, b) for a, b in zip(state.params, params))
    assert all(torch.equal(a, b) for a, b in zip(state.momentum, momentum))
    assert all(torch.equal(a, b) for a, b in zip(state.pending[0], queued[0]))
    assert torch.equal(state.inner[0], inner[0]) and state.inner_keys == [[0, "exp_avg"]]
    with pytest.raises(SwarmError, match="tensors for 2 params"):
        _parse_state(metadata, [*params, *momentum])


def test_a_state_with_numbers_no_honest_peer_holds_is_a_malformed_donor() -> None:
    """Witnesses check θ against theirs, and not every state can be confirmed; they never see the
    step's sign, the momentum or the queued updates. A donor's step of -1 stopped the joiner (its
    next heartbeat failed the schema), a NaN queued update stopped it at its next sync, and a
    queued update of 1e30 took its θ to 1e30. Each is now refused like a malformed state."""
    from swarm.download import _parse_state
    from swarm.errors import SwarmError

    params = [torch.randn(3, 2), torch.randn(4)]
    small = [p * 0.01 for p in params]
    meta = {"outer_step": 7, "num_params": 2, "num_pending": 1}
    assert _parse_state(meta, [*params, *small, *small]).outer_step == 7
    huge = [torch.full_like(p, 1e30) for p in params]
    nan = [torch.full_like(p, float("nan")) for p in params]
    bad = [
        ({**meta, "outer_step": -1}, [*params, *small, *small], "outer step -1 is outside"),
        ({**meta, "outer_step": 10**9 + 1}, [*params, *small, *small], "outside 0..1000000000"),
        (meta, [*nan, *small, *small], "θ holds NaN/Inf"),
        (meta, [*huge, *small, *small], "θ has a norm beyond float32"),
        (meta, [*params, *small, *nan], "queued update 0 has norm nan"),
        (meta, [*params, *small, *huge], "queued update 0 has norm inf"),
        (meta, [*params, *small, *[p * 2 for p in params]], "queued update 0 has norm"),
        (meta, [*params, *[p * 11 for p in params], *small], "outer momentum has norm"),
    ]
    for metadata, tensors, why in bad:
        with pytest.raises(SwarmError, match=re.escape(why)):
            _parse_state(metadata, tensors)


def test_a_state_with_more_queued_updates_than_a_peer_holds_or_bytes_for_floats_is_refused() -> None:
    """The byte limit bounds what a donor sends, not what the joiner makes of it: the honest θ
    (the witnesses agree) with 90 queued updates and its momentum as 1-byte zeros fit a 1 M
    parameter model's 96 MiB limit, each became a float copy of θ (368 MiB held) and the state
    was taken with 90 updates queued (a review, stop 72). More than a peer's --delay and one in
    flight, or θ, momentum or queued updates that are not floating point: a malformed donor."""
    from swarm.download import MAX_QUEUED, _parse_state
    from swarm.errors import SwarmError

    params = [torch.randn(3, 2), torch.randn(4)]
    zeros = [torch.zeros(p.shape, dtype=torch.uint8) for p in params]
    meta = {"outer_step": 7, "num_params": 2, "num_pending": MAX_QUEUED}
    small = [p * 0.01 for p in params]
    assert MAX_QUEUED == 2 and len(_parse_state(meta, [*params, *small, *small, *small]).pending) == 2
    with pytest.raises(SwarmError, match="holds 90 queued updates; a peer holds at most 2"):
        _parse_state({**meta, "num_pending": 90}, [*params, *small, *(zeros * 90)])
    for tensors in ([*params, *zeros, *small, *small], [*params, *small, *small, *zeros]):
        with pytest.raises(SwarmError, match="not floating-point"):
            _parse_state(meta, tensors)
    as_half = [p.half() for p in [*params, *small, *small, *small]]  # a float of any width is one
    assert _parse_state(meta, as_half).params[0].dtype == torch.float32


def test_a_state_that_does_not_fit_this_model_or_counts_in_infinities_is_a_malformed_donor() -> None:
    """A donor serving the honest θ in other shapes (a (4, 8) weight as (32,)) passes the
    witnesses, who sketch θ flattened; the joiner then exited with "the run trains another
    model". And metadata counting in inf raised OverflowError past the malformed-state handler:
    the joiner died. Both are now SwarmError, the malformed donor's: the next donor is tried."""
    from swarm.download import _parse_state
    from swarm.errors import SwarmError

    params = [torch.randn(4, 8), torch.randn(4)]
    meta = {"outer_step": 7, "num_params": 2, "num_pending": 0}
    shapes = [(4, 8), (4,)]
    assert _parse_state(meta, [*params, *params], shapes).outer_step == 7
    flat = [params[0].reshape(-1), params[1]]
    with pytest.raises(SwarmError, match=re.escape("first mismatch tensor 0: (32,) vs (4, 8)")):
        _parse_state(meta, [*flat, *flat], shapes)
    with pytest.raises(SwarmError, match="2 tensors vs this model's 3"):
        _parse_state(meta, [*params, *params], [*shapes, (2,)])
    for bad in (
        {"num_params": math.inf},
        {"outer_step": math.inf},
        {"num_pending": math.nan},
        {"num_params": True},
    ):
        with pytest.raises(SwarmError, match="not whole numbers"):
            _parse_state({**meta, **bad}, [*params, *params], shapes)


def test_a_state_whose_moments_or_queue_do_not_fit_its_theta_is_a_malformed_donor() -> None:
    """The witnesses check θ only: a donor serving the honest θ with a scalar AdamW moment made
    the joiner's first inner step raise (and the joiner exit, "trains another model" for a
    wrong-shaped momentum). Such a state is now a malformed donor's: the next donor is tried."""
    from optim.state import OuterState, load_inner_state
    from swarm.download import _parse_state
    from swarm.errors import SwarmError

    params, step = [torch.randn(3, 2), torch.randn(4)], torch.tensor(5.0)
    meta = {"outer_step": 7, "num_params": 2, "num_pending": 0}
    ok = _parse_state(
        {**meta, "inner_keys": [[0, "step"], [0, "exp_avg"]]}, [*params, *params, step, params[0]]
    )
    assert ok.inner_keys == [[0, "step"], [0, "exp_avg"]]
    bad = [
        ({**meta, "inner_keys": [[0, "exp_avg"]]}, [*params, *params, torch.tensor(5.0)]),  # a scalar moment
        ({**meta, "inner_keys": [[5, "exp_avg"]]}, [*params, *params, params[0]]),  # no parameter 5
        ({**meta, "inner_keys": [["0", "exp_avg"]]}, [*params, *params, params[0]]),
        (meta, [*params, params[1], params[0]]),  # momentum in the wrong order
        ({**meta, "num_pending": 1}, [*params, *params, torch.randn(2, 3), params[1]]),
    ]
    for metadata, tensors in bad:
        with pytest.raises(SwarmError):
            _parse_state(metadata, tensors)
    model = torch.nn.Linear(2, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    scalar = OuterState(
        outer_step=1, params=[], momentum=[], inner=[torch.tensor(5.0)], inner_keys=[[0, "exp_avg"]]
    )
    load_inner_state(optimizer, list(model.parameters()), scalar)  # refused: starts fresh
    model(torch.randn(4, 2)).sum().backward()
    optimizer.step()  # and steps


def test_one_member_claiming_a_later_step_does_not_send_the_others_to_download():
    """A member's outer step in the group's info is its claim: one member saying 1e9 made
    every honest member of its groups "behind the group" and download the state every round.
    Behind takes most of the other members past this peer; with one other member its claim is
    followed (and a download must bear it out: claimed_ahead); an ignored liar counts for nothing."""
    from swarm.gathered import claimed_ahead

    a, b, liar = member(ID_A, 5, FP), member(ID_B, 5, list(FP)), member(ID_C, 10**9, OTHER_FP)
    group = [a, b, liar]
    assert diverged_from_group(a, group) is None and diverged_from_group(b, group) is None
    assert claimed_ahead(a, group) == {ID_C: 10**9}
    assert "behind" in (diverged_from_group(a, [a, liar]) or "")
    assert diverged_from_group(a, [a, liar], ignored={ID_C}) is None
    # Most of the others past this peer: it is the one behind.
    later = [member(ID_B, 6, FP), member(ID_C, 6, FP)]
    assert diverged_from_group(a, [a, *later]) == "behind the group (outer step 5 < 6)"


def test_a_peer_far_into_the_run_takes_an_older_state_only_if_another_peer_holds_it() -> None:
    """The churn soak: a peer at outer step 232 that had to download was offered only a fresh
    joiner's init at step 0; nobody could confirm or contradict it, and it took it on the
    donor's word (its eval loss 2.47 -> 5.36). Below ``oldest_unconfirmed`` such a state is
    passed over (the donor neither blamed nor asked again in this call); one that a peer at its
    step confirms is taken (a peer that stepped alone past the swarm takes the swarm's state)."""
    from optim.state import OuterState
    from swarm.claims import Vouching
    from swarm.download import Downloading
    from swarm.sketch import state_sketches

    asked: list[set[str]] = []
    served = {"fresh": 0, "ahead": 233}
    witness: dict[str, int] = {}  # the step at which another peer holds the donor's θ

    class Probe(Downloading):
        vouching, _refused_donors, peer_id, board = Vouching(), set(), "me", _Board()

        def _fetch_state(self, skipped, distrusted, deadline):
            asked.append(set(skipped))
            donor = next((d for d in served if d not in skipped), None)
            if donor is None:
                return None
            state = OuterState(outer_step=served[donor], params=[torch.zeros(2)], momentum=[torch.zeros(2)])
            answers = {peer: (step, state_sketches(state.params, b"seed")) for peer, step in witness.items()}
            return state, donor, dict.fromkeys(answers, b"seed"), answers, {}  # no answer: the donor's word

    assert Probe().download_state(since=232).outer_step == 0  # what it did: the first offer taken
    taken = Probe().download_state(since=232, oldest_unconfirmed=231)
    assert taken.outer_step == 233 and asked[-1] == {"fresh"}
    served.pop("ahead")
    probe = Probe()
    assert probe.download_state(since=232, oldest_unconfirmed=231) is None
    assert not probe._refused_donors  # an honest peer that just started: not blamed
    assert probe.download_state(since=232, oldest_unconfirmed=0).outer_step == 0  # the bound: inclusive
    witness["w"] = 0  # a peer at step 0 holds it: the swarm is there, this peer ran ahead alone
    assert Probe().download_state(since=232, oldest_unconfirmed=231).outer_step == 0


def test_a_peer_that_resyncs_after_a_round_asks_for_confirmation_below_that_round_s_step(
    monkeypatch,
) -> None:
    """The wiring of the test above: a peer that a round found out of step (its clock at 233
    after it) downloads with ``oldest_unconfirmed`` 232, the step that round started from; a
    joiner and a peer ending its run download without it."""
    from types import SimpleNamespace

    import workbench.run.joining as joining
    import workbench.run.peer as peer_module
    from workbench.cli.command import build_config, build_parser

    asked: list[dict] = []
    averager = SimpleNamespace(
        download_state=lambda **kwargs: asked.append(kwargs),  # nobody served
        download_donors=lambda: 1,
        on_download=None,
    )
    monkeypatch.setattr(joining, "time", SimpleNamespace(monotonic=time.monotonic, sleep=lambda s: None))
    peer = peer_module.Peer(build_config(build_parser().parse_args(["start", "--model", "tiny"])))
    peer.averager, peer.diloco, peer.beat = (
        averager,
        SimpleNamespace(outer_step_count=233),
        lambda stage: None,
    )
    peer.resync("behind the group", avoid={"mate"}, claims={})
    assert [a["oldest_unconfirmed"] for a in asked] == [232] * 3  # three tries
    assert all(a["avoid"] == {"mate"} for a in asked)
    asked.clear()
    peer.download_state("joining")
    assert asked and all(a["oldest_unconfirmed"] is None for a in asked)


def test_a_donor_whose_state_left_this_peer_behind_is_not_asked_first_again() -> None:
    """A vouched donor serving a made-up θ one step old (no peer still holds that step to
    contradict it) kept a peer behind for 74 downloads running: the state left it behind, the
    next round found it behind, and the same donor went first again. While this peer is still
    at the step its last download brought, that download's donor is skipped for one try."""
    from optim.state import OuterState
    from swarm.claims import Vouching
    from swarm.download import Downloading

    asked: list[set[str]] = []

    class Probe(Downloading):
        vouching, _refused_donors, peer_id, board = Vouching(), set(), "me", _Board()

        def _fetch_state(self, skipped, distrusted, deadline):
            asked.append(set(skipped))
            if "liar" in skipped:
                return None
            served = OuterState(outer_step=14, params=[torch.zeros(2)], momentum=[torch.zeros(2)])
            return served, "liar", {}, {}, {}

    probe = Probe()
    probe.vouching.averaged_with(["liar"])
    assert probe.download_state(since=13).outer_step == 14
    assert probe.download_state(since=14) is None and "liar" in asked[-1]  # still behind at 14: not first
    assert probe.download_state(since=14) is not None and "liar" not in asked[-1]  # the next try asks it
    # Behind again after the round it then stepped alone (its clock one past the state's): skipped.
    assert probe.download_state(since=15) is None and "liar" in asked[-1]
    assert probe.download_state(since=15) is not None
    assert probe.download_state(since=20) is not None and "liar" not in asked[-1]  # it moved on
