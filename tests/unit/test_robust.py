"""Robust aggregation: every member refuses the same outsized round, so no θ drifts."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from optim import contribution
from optim.diloco import DiLoCo, DiLoCoConfig
from optim.robust import WEIGHT_RATIO, check_round, counted_weights, overclaimed
from optim.sim import InProcessSwarm


def member(peer: str, norm: float, weight: float = 8.0) -> dict:
    return {"peer": peer, "norm": norm, "weight": weight}


def test_an_outlier_is_named() -> None:
    verdict = check_round(1.0, [member("a", 1.0), member("b", 1.2), member("evil", 50.0)], ratio=10)
    assert verdict is not None and "evil" in verdict and "45x" in verdict


def test_honest_rounds_pass() -> None:
    group = [member("a", 1.0), member("b", 3.0), member("c", 2.0)]
    assert check_round(1.5, group, ratio=10) is None
    assert check_round(1.5, group, ratio=0) is None  # off
    assert check_round(5.0, [member("a", 5.0)], ratio=10) is None  # alone: nothing to compare


def test_a_member_that_declares_no_norm_or_no_weight_gets_no_update_past_the_checks() -> None:
    """A round mate's norm and weight are its own claims. One that declared no norm (or one that
    does not parse) once fell out of both checks, and so did one declaring a weight of 0: in a
    pair round neither check then ran, and its 1e6-scale update was applied. Now a counted
    member without a norm refuses the round, and the misreport check bounds the mean by the
    counted members alone, so a member declaring 0 must have sent nothing."""
    me = member("me", 0.1)
    for liar in ({"peer": "att", "weight": 8.0}, member("att", "x"), member("att", float("nan"))):  # type: ignore[arg-type]
        verdict = check_round(0.1, [me, liar], ratio=10)
        assert verdict is not None and "att" in verdict and "declared no valid update norm" in verdict
    for weight in (0.0, "8", None, -1.0):
        verdict = check_round(5e5, [me, member("att", 0.1, weight=weight)], ratio=10)  # type: ignore[arg-type]
        assert verdict is not None and "more than the members' reported norms allow" in verdict
    # A peer that diverged declares a weight of 0 and a NaN norm, and sends nothing: the mean is
    # the other member's own update, which passes.
    assert check_round(0.1, [me, member("nan", float("nan"), weight=0.0)], ratio=10) is None


def test_two_members_claiming_one_peer_id_are_each_checked() -> None:
    """Each member is compared with the others by its place in the group: a copied peer id
    once emptied the median (statistics.median raised, and the error stopped the peer)."""
    assert check_round(1.0, [member("h", 1.0), member("h", 1.0)], ratio=10) is None
    verdict = check_round(1.0, [member("h", 1.0), member("h", 50.0), member("x", 1.0)], ratio=10)
    assert verdict is not None and "50x" in verdict


def test_a_peer_that_trained_more_steps_may_send_a_larger_update() -> None:
    """Time-boxed rounds: the fast peer ran 20x the slow one's samples and its pseudo-gradient
    is 21x as large (measured on two real peers): an honest round. The same norm for the same
    samples is still an outlier, and a peer with fewer samples gains no slack."""
    fast, slow = member("fast", 6.73, weight=20 * 64.0), member("slow", 0.327, weight=64.0)
    assert check_round(1.0, [fast, slow], ratio=10) is None
    verdict = check_round(1.0, [member("fast", 6.73, weight=64.0), slow], ratio=10)
    assert verdict is not None and "fast" in verdict and "limit 10x" in verdict
    verdict = check_round(
        1.0, [member("fast", 0.327, weight=64.0), member("slow", 6.73, weight=4.0)], ratio=10
    )
    assert verdict is not None and "slow" in verdict and "limit 10x" in verdict
    verdict = check_round(1.0, [member("fast", 100.0, weight=2 * 64.0), slow], ratio=10)
    assert verdict is not None and "limit 20x for 2x their samples" in verdict


def test_a_claimed_weight_counts_for_at_most_16x_the_median_of_the_others() -> None:
    """A weight is samples trained, a claim nobody can check: above WEIGHT_RATIO times the other
    members' median it counts as that; anything that is not a finite number >= 0 counts as 0.
    Every member computes the same, in whatever order it lists the group."""
    assert WEIGHT_RATIO == 16
    assert counted_weights([64.0, 3 * 64.0, 10 * 64.0]) == [64.0, 3 * 64.0, 10 * 64.0]  # honest
    assert counted_weights([1.0, 1.0, 1e9]) == [1.0, 1.0, 16.0]
    assert counted_weights([1e9, 2.0, 4.0]) == [48.0, 2.0, 4.0]  # the median of 2 and 4
    assert counted_weights([2.0, float("nan"), -5.0, "9", True, None, 1e300]) == [2.0, 0, 0, 0, 0, 0, 32.0]
    assert counted_weights([0.0, 0.0, 5.0]) == [0.0, 0.0, 5.0]  # nobody else to compare with
    assert counted_weights([7.0]) == [7.0]
    weights = [3.0, 1e12, 5.0, 0.5]
    assert sorted(counted_weights(weights)) == sorted(counted_weights(weights[::-1]))


def test_a_huge_claimed_weight_buys_no_norm_allowance() -> None:
    """The attack: a member claims 1e9 samples, so the outlier check would allow it an update
    1e7 times the others' (and the mean would be its own). Counted as 16x, it is refused."""
    honest = [member("a", 1.0, weight=64.0), member("b", 1.1, weight=64.0)]
    verdict = check_round(1.0, [*honest, member("liar", 1000.0, weight=1e9)], ratio=10)
    assert verdict is not None and "liar" in verdict and "limit 160x for 16x their samples" in verdict
    assert check_round(1.0, [*honest, member("fast", 20.0, weight=1e9)], ratio=10) is None  # within 16x
    assert overclaimed([*honest, member("liar", 1.0, weight=1e9)]) == {
        "liar": "peer liar claimed 1e+09 samples, counted as 1024 (16x the others' median)"
    }
    assert overclaimed([*honest, member("c", 1.0, weight=16 * 64.0)]) == {}


def _one_round_of_three(config: DiLoCoConfig, shifts: list[float], samples: list[int]):
    """Three simulated peers on the same model, each moved by its shift and claiming its samples,
    sync once together: (their outer loops, θ before, their reports)."""
    swarm = InProcessSwarm(3)
    models = []
    for _ in range(3):
        torch.manual_seed(0)
        models.append(torch.nn.Linear(4, 4))
    outers = [
        DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), swarm.averager(rank), config)
        for rank, m in enumerate(models)
    ]
    before = [p.detach().clone() for p in models[0].parameters()]
    reports = [None] * 3

    def run(rank: int) -> None:
        with torch.no_grad():
            for p in models[rank].parameters():
                p.add_(shifts[rank])
        outers[rank].note_inner_step(samples=samples[rank])
        reports[rank] = outers[rank].sync()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outers, before, reports


def test_simulated_peers_count_a_member_s_claimed_weight_as_a_real_group_does(caplog, monkeypatch) -> None:
    """Three virtual peers, one claiming 1e9 samples: every peer's θ becomes the mean weighted
    8 : 8 : 128 (16x the others' median), not the liar's own model, and every peer says so."""
    monkeypatch.setattr(contribution, "_TOLD_OVERCLAIMED", set())  # a process warns once per peer
    caplog.set_level(logging.DEBUG, logger="optim.contribution")
    config = DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    outers, before, reports = _one_round_of_three(config, [0.01, 0.02, 0.03], [8, 8, 10**9])
    expected = (8 * 0.01 + 8 * 0.02 + 128 * 0.03) / 144
    for rank in range(3):
        assert reports[rank].error is None, reports[rank].error
        for g, b in zip(outers[rank].global_params, before):
            torch.testing.assert_close(g, b + expected)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "claimed" in r.getMessage()]
    line = "round 0: peer sim-2 claimed 1e+09 samples, counted as 128 (16x the others' median)"
    assert sorted(said) == [(logging.DEBUG, line)] * 2 + [(logging.WARNING, line)]  # once at warning


def test_a_mean_larger_than_the_declared_norms_is_a_misreport() -> None:
    verdict = check_round(30.0, [member("a", 1.0), member("b", 1.2)], ratio=10)
    assert verdict is not None and "more than it declared" in verdict


def test_diverged_members_and_garbage_info_are_ignored() -> None:
    group = [member("a", 1.0), member("b", 1.1), member("nan", 1e9, weight=0.0), {"norm": "x"}, None]
    assert check_round(1.0, group, ratio=10) is None


@pytest.mark.parametrize("bad_rank", [0, 2])
def test_three_simulated_peers_refuse_one_outsized_update_together(bad_rank: int) -> None:
    shifts = [1000.0 if rank == bad_rank else 0.01 * (rank + 1) for rank in range(3)]
    outers, before, reports = _one_round_of_three(DiLoCoConfig(inner_steps=1), shifts, [8, 8, 8])
    for rank in range(3):
        assert "refused" in reports[rank].error and f"sim-{bad_rank}" in reports[rank].error
        assert outers[rank].outer_step_count == 1  # the round counts (θ unchanged), as every path counts it
        for g, b in zip(outers[rank].global_params, before):
            assert torch.equal(g, b)  # θ unchanged, on every peer


def test_clip_norm_scales_the_own_update_before_sending() -> None:
    swarm = InProcessSwarm(1)
    model = torch.nn.Linear(4, 4)
    outer = DiLoCo(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        swarm.averager(0),
        DiLoCoConfig(inner_steps=1, clip_norm=0.5, outer_lr=1.0, outer_momentum=0.0, nesterov=False),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(3.0)
    outer.note_inner_step(samples=1)
    report = outer.sync()
    assert report.local_norm > 0.5 and abs(report.mean_norm - 0.5) < 1e-5


def test_a_nan_mean_names_the_member_whose_declared_norm_was_not_finite_not_this_peer() -> None:
    """The averaged update held NaN: the message told this (honest) peer to lower its inner
    learning rate and named nobody."""
    import torch

    from optim.averager import RoundReport
    from optim.contribution import Outgoing, judge

    def judged(group_info):
        mean = [torch.tensor([float("nan"), 1.0])]
        outgoing = Outgoing(mean, {"name": "me", "norm": 1.0, "weight": 8}, 8.0, 1.0, 8, False, 5)
        return judge(outgoing, RoundReport(group_size=2, group_info=group_info), outlier_ratio=0.0)

    named = judged(
        [{"name": "me", "norm": 1.0, "weight": 8}, {"name": "broken", "norm": float("nan"), "weight": 8}]
    )
    assert "holds NaN/Inf" in named and "sent by broken" in named and "me" not in named.split("sent by")[1]
    hidden = judged([{"name": "me", "norm": 1.0, "weight": 8}, {"name": "liar", "norm": 1.0, "weight": 8}])
    assert "under a finite declared norm: a faulty peer" in hidden and "lower the inner" not in hidden


def test_a_refused_round_s_log_line_names_its_cause_once() -> None:
    """The optimizer logs a refused mean in full, as an error; the peer's round line repeated
    the whole message after it ("not applied: round 4: the averaged update holds NaN/Inf; the
    global params were left unchanged (a member sent ...)"). It now names the cause only."""
    import torch

    from optim.averager import RoundReport
    from optim.contribution import Outgoing, judge
    from workbench.run.telemetry import round_note

    info = {"name": "me", "norm": 1.0, "weight": 8}
    outgoing = Outgoing([torch.tensor([float("nan"), 1.0])], info, 8.0, 1.0, 8, False, 5)
    report = RoundReport(group_size=2, group_info=[info, {**info, "name": "broken", "norm": float("nan")}])
    assert judge(outgoing, report, outlier_ratio=0.0) and not report.applied
    assert round_note(report) == "  (not applied: the averaged update holds NaN/Inf)"
    assert "round 5" in report.error and "sent by broken" in report.error  # the event keeps it whole
    diverged = Outgoing([torch.tensor([1.0, 1.0])], info, 8.0, 1.0, 8, True, 5)  # own Δ was NaN
    applied = RoundReport(group_size=2, group_info=[info, info])
    assert judge(diverged, applied, outlier_ratio=0.0) is None and applied.applied
    assert round_note(applied).startswith("  (this peer's pseudo-gradient held NaN/Inf: not sent")
    assert round_note(RoundReport(group_size=1, error="no other peer")) == "  (alone: no other peer)"
    mates = [info, {**info, "name": "big", "norm": 100.0}, {**info, "name": "other", "norm": 1.1}]
    outlier = RoundReport(group_size=3, group_info=mates)
    big = Outgoing([torch.tensor([40.0, 0.0])], info, 8.0, 1.0, 8, False, 5)
    assert judge(big, outlier, outlier_ratio=10.0) and not outlier.applied
    note = round_note(outlier)  # the check's own text holds "; ": all of it, only the tail cut
    assert note.startswith("  (not applied: ") and "limit 10x" in note and "left unchanged" not in note, note
    assert round_note(RoundReport(group_size=2)) == ""


def test_a_member_whose_info_is_not_a_dict_or_claims_another_weight_is_checked_as_the_mean_counted_it() -> (
    None
):
    """The round's group info held only members whose info was a dict: one sending a list was
    dropped, so in a pair round one member was left to check and its update went through. And
    a member's info could claim a weight of 0 while the mean counted the weight it gathered."""
    from swarm import gathered

    def wrapper(user, weight: float) -> dict:
        return {**gathered.own(False, weight, b"", user), gathered.NONCE: b"n" * 16}

    me = gathered.reported(wrapper({"peer": "me", "norm": 0.1, "weight": 8.0}, 8.0))
    for user in (["not", "a", "dict"], None, {"peer": "att", "norm": 0.1, "weight": 0.0}):
        liar = gathered.reported(wrapper(user, 8.0))
        assert liar["weight"] == 8.0  # what the mean counted
        verdict = check_round(6.6e5, [me, liar], ratio=10)
        assert verdict is not None and (
            "declared no valid update norm" in verdict or "more than" in verdict
        ), user
