"""Streaming DiLoCo: fragments, schedules, and equality with DiLoCo where they must agree."""

from __future__ import annotations

import pytest
import torch

from optim.averager import LocalAverager
from optim.diloco import DiLoCo, DiLoCoConfig
from optim.sim import InProcessSwarm, SimConfig, VirtualPeer, simulate
from optim.streaming import StreamingConfig, StreamingDiLoCo, StreamingRounds, split_fragments
from tests.unit.test_sim import init_model, mse, stream


@pytest.mark.parametrize(
    ("sizes", "fragments"), [([10] * 8, 4), ([100, 1, 1, 1, 1, 100], 3), ([5, 5], 2), ([7], 1)]
)
def test_split_fragments_is_contiguous_and_covers_everything(sizes, fragments):
    groups = split_fragments(sizes, fragments)
    assert len(groups) == fragments and all(groups)
    assert [i for g in groups for i in g] == list(range(len(sizes)))


def test_split_fragments_balances_equal_tensors():
    assert split_fragments([10] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_more_fragments_than_tensors_is_an_error():
    with pytest.raises(ValueError, match="only 2 parameter tensors"):
        split_fragments([1, 2], 3)


def streaming(
    *, fragments: int = 4, sync_delay: int = 0, alpha: float | None = None, **outer
) -> StreamingConfig:
    """A StreamingConfig from flat keywords: the schedule's own, the rest DiLoCo's."""
    return StreamingConfig(
        outer=DiLoCoConfig(**outer), fragments=fragments, sync_delay=sync_delay, alpha=alpha
    )


def make(method: str, **config):
    def make_peer(rank: int, swarm: InProcessSwarm) -> VirtualPeer:
        model = init_model()
        inner = torch.optim.AdamW(model.parameters(), lr=0.05)
        if method == "diloco":
            outer = DiLoCo(model, inner, swarm.averager(rank), DiLoCoConfig(**config))
            steps = config["inner_steps"]
        else:
            outer = StreamingDiLoCo(model, inner, swarm.averager(rank), streaming(**config))
            steps = 1
        return VirtualPeer(
            model=model, inner_optimizer=inner, outer=outer, batches=stream(rank), inner_steps=steps
        )

    return make_peer


def test_one_fragment_without_delay_is_diloco():
    diloco = simulate(make("diloco", inner_steps=4), mse, SimConfig(peers=3, steps=16))
    streaming = simulate(make("streaming", inner_steps=4, fragments=1), mse, SimConfig(peers=3, steps=16))
    assert streaming.final_eval_loss == diloco.final_eval_loss
    assert streaming.bytes_per_peer == diloco.bytes_per_peer and streaming.rounds == diloco.rounds == 4


def test_fragments_cut_the_peak_bytes_and_keep_the_total():
    one = simulate(make("streaming", inner_steps=4, fragments=1), mse, SimConfig(peers=2, steps=16))
    two = simulate(make("streaming", inner_steps=4, fragments=2), mse, SimConfig(peers=2, steps=16))
    # Linear(4, 1): weight 4 floats, bias 1 float -> fragments of 16 B and 4 B.
    assert one.peak_bytes_per_sync == 20 and two.peak_bytes_per_sync == 16
    assert two.bytes_per_peer == one.bytes_per_peer
    assert two.final_eval_loss < two.initial_eval_loss


def test_fragments_sync_on_staggered_schedules_and_merge_after_the_delay():
    model = init_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = StreamingDiLoCo(
        model,
        inner,
        LocalAverager(),
        streaming(inner_steps=4, fragments=2, sync_delay=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False),
    )
    started = []
    data = stream(0)
    for step in range(1, 9):
        x, y = next(data)
        model(x, y)[1].backward()
        inner.step()
        inner.zero_grad()
        before = outer.syncs
        if outer.after_inner_step(samples=len(x)) is not None:
            started.append(step)
        if step in (3, 5, 7):  # one step after each start: that fragment merged
            assert outer.syncs == before + 1
    assert started == [2, 4, 6, 8]  # fragment 0 at H/2, fragment 1 at H, alternating
    # The last sync (step 8) would merge at step 9, after the run: finish() merges it.
    before = outer.syncs
    outer.finish()
    assert outer.syncs == before + 1 and not outer._pending


def test_alpha_mixes_local_and_global_fragments():
    model = init_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    config = streaming(
        inner_steps=1, fragments=1, alpha=0.25, outer_lr=1.0, outer_momentum=0.0, nesterov=False
    )
    outer = StreamingDiLoCo(model, inner, LocalAverager(), config)
    x, y = next(stream(0))
    model(x, y)[1].backward()
    inner.step()
    local = [p.detach().clone() for p in model.parameters()]
    outer.after_inner_step(samples=len(x))
    # lr 1, no momentum, one peer: the global fragment becomes the local one, so the mix is local.
    for p, q in zip(model.parameters(), local):
        torch.testing.assert_close(p.detach(), q)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(inner_steps=3, fragments=4), "must not exceed"),
        (dict(inner_steps=8, fragments=4, sync_delay=2), "sync_delay"),
        (dict(alpha=1.0), "alpha"),
        (dict(codec="zip"), "zip"),
        (dict(fragments=0), ">= 1"),
    ],
)
def test_streaming_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        streaming(**kwargs)


def test_streaming_rounds_syncs_fragments_in_turn_and_round_trips_its_state():
    """The round-driven face real peers use: fragment f = sync % F, state for joiners."""
    from optim.streaming import StreamingRounds

    class Recorder:
        def __init__(self):
            self.calls = []

        def all_reduce(self, tensors, *, weight, info=None):
            from optim.averager import RoundReport

            self.calls.append(len(tensors))
            return RoundReport(group_size=1)

    model = init_model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    recorders = [Recorder(), Recorder()]
    rounds = StreamingRounds(StreamingDiLoCo(model, inner, recorders, streaming(inner_steps=4, fragments=2)))
    assert rounds.steps_per_round == 2
    data = stream(0)
    for _ in range(3):
        for _ in range(rounds.steps_per_round):
            x, y = next(data)
            model(x, y)[1].backward()
            inner.step()
            inner.zero_grad()
            rounds.note_inner_step(samples=len(x))
        rounds.sync(info={})
    assert rounds.outer_step_count == 3
    assert [len(r.calls) for r in recorders] == [2, 1]  # fragments 0, 1, 0

    state = rounds.outer_state()
    joiner_model = init_model(seed=9)
    joiner_inner = torch.optim.AdamW(joiner_model.parameters(), lr=0.05)
    joiner = StreamingRounds(
        StreamingDiLoCo(
            joiner_model, joiner_inner, [Recorder(), Recorder()], streaming(inner_steps=4, fragments=2)
        )
    )
    joiner.load_outer_state(state)
    assert joiner.outer_step_count == 3 and joiner.streaming.step_count == 6
    assert joiner.fingerprint() == rounds.fingerprint()
    assert all(torch.equal(a.detach(), b) for a, b in zip(joiner_model.parameters(), state.params))
    assert joiner_inner.state_dict()["state"], "the inner AdamW statistics travel with the state"


def test_streaming_rounds_refuse_uneven_schedules():
    from optim.streaming import StreamingRounds

    model = init_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="divisible"):
        StreamingRounds(StreamingDiLoCo(model, inner, LocalAverager(), streaming(inner_steps=5, fragments=2)))


def _train(model, inner, data, steps: int, note) -> None:
    for _ in range(steps):
        x, y = next(data)
        model(x, y)[1].backward()
        inner.step()
        inner.zero_grad()
        note(samples=len(x))


def test_streaming_rounds_with_a_sync_delay_train_as_the_simulator_does():
    """Real peers' streaming with τ > 0 (all-reduce in the background, merged τ steps later)
    lands on exactly the parameters the simulator's step-driven streaming reaches."""
    from optim.streaming import StreamingRounds

    config = dict(inner_steps=4, fragments=2, sync_delay=1, outer_lr=0.7, outer_momentum=0.9)
    reference_model = init_model()
    reference_inner = torch.optim.AdamW(reference_model.parameters(), lr=0.05)
    reference = StreamingDiLoCo(reference_model, reference_inner, LocalAverager(), streaming(**config))
    _train(reference_model, reference_inner, stream(0), 14, reference.after_inner_step)
    reference.finish()

    model = init_model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    rounds = StreamingRounds(StreamingDiLoCo(model, inner, LocalAverager(), streaming(**config)))
    assert rounds.streaming.config.alpha == 0.5, "the paper's α is the default once merges overlap"
    data, reports = stream(0), []
    for _ in range(7):
        _train(model, inner, data, rounds.steps_per_round, rounds.note_inner_step)
        reports.append(rounds.sync(info={"fingerprint": []}))
    assert rounds.outer_step_count == 7  # the clock moves when an all-reduce starts
    rounds._inflight.future.result(timeout=10)
    before = [g.clone() for g in rounds.global_params]
    settled = rounds.settled_global()  # what a peer stopped now writes: with the landed merge
    assert all(torch.equal(a, b) for a, b in zip(rounds.global_params, before))  # nothing changed
    assert any(not torch.equal(a, b) for a, b in zip(settled, before))
    assert rounds.finish() is not None and rounds.finish() is None
    for ours, theirs in zip(settled, rounds.global_params):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert reports[0].pending and not any(r.pending for r in reports[1:])
    assert rounds.streaming.syncs == reference.syncs == 7
    for ours, theirs in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(rounds.global_params, reference.global_params):
        assert torch.equal(ours, theirs)


class _Gated:
    """An averager whose all-reduce (a swarm of one) returns only when the test opens the gate."""

    def __init__(self) -> None:
        import threading

        self.gate = threading.Event()

    def all_reduce(self, tensors, *, weight, info=None):
        from optim.averager import RoundReport

        assert self.gate.wait(10)
        return RoundReport(group_size=1, group_info=[dict(info or {})])


def test_a_state_served_while_a_fragment_is_in_flight_is_the_state_once_it_lands():
    """A joiner asking mid-round gets θ and momentum with the fragment in flight merged: what
    the donor holds once it lands (and what its round mates hold), so state checks agree."""
    import threading

    from optim.streaming import StreamingRounds

    config = streaming(inner_steps=4, fragments=2, sync_delay=1, outer_lr=0.7, outer_momentum=0.9)
    model = init_model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    gates = [_Gated(), _Gated()]
    rounds = StreamingRounds(StreamingDiLoCo(model, inner, gates, config))
    # The trainer (this thread) takes no inner step while the asker waits: the asker copies
    # AdamW's state itself once no step boundary came in this long (5 s by default, 20 s here).
    rounds.inner_copies.wait = 0.1
    data = stream(0)
    for sync in range(4):  # fragments 0, 1, 0, 1: the last two merge onto existing momentum
        _train(model, inner, data, rounds.steps_per_round, rounds.note_inner_step)
        rounds.sync(info={})
        served: list = []
        asker = threading.Thread(target=lambda out=served: out.append(rounds.outer_state()))
        asker.start()
        asker.join(0.2)
        assert asker.is_alive(), "a state asked for mid-flight waits for the all-reduce"
        gates[sync % 2].gate.set()
        asker.join(10)
        _train(model, inner, data, 1, rounds.note_inner_step)  # τ = 1: the fragment lands here
        assert rounds._inflight is None
        landed = rounds.outer_state()
        assert served[0].outer_step == landed.outer_step == sync + 1
        for a, b in [*zip(served[0].params, landed.params), *zip(served[0].momentum, landed.momentum)]:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
        gates[sync % 2].gate.clear()

    joiner_model = init_model(seed=9)
    joiner = StreamingRounds(
        StreamingDiLoCo(joiner_model, torch.optim.AdamW(joiner_model.parameters(), lr=0.05), gates, config)
    )
    joiner.load_outer_state(landed)
    assert joiner.outer_step_count == 4 and joiner.fingerprint() == rounds.fingerprint()


class _Recording(LocalAverager):
    """A swarm of one that keeps the info each all-reduce went out with."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[dict] = []

    def all_reduce(self, tensors, *, weight, info=None):
        self.sent.append(dict(info or {}))
        return super().all_reduce(tensors, weight=weight, info=info)


@pytest.mark.parametrize("steps", [1, 2, 3], ids=["shorter-than-tau", "tau", "full"])
def test_the_fingerprint_sent_with_a_fragment_is_the_global_params_after_the_merge(steps):
    """The θ check compares the fingerprints that go out with a fragment. A round shorter than
    τ (a joiner's or a resynced peer's first round, cut to meet the others at the barrier)
    merges the fragment in flight at the sync: its fingerprint must include that merge, as its
    round mates' (who merged τ steps in) do, or the group sends it to download the state again
    and again (seen with 3 real peers: 10 resyncs in 20 syncs after a joiner came)."""
    from optim.streaming import StreamingRounds

    config = streaming(inner_steps=6, fragments=2, sync_delay=2, outer_lr=0.7, outer_momentum=0.9)
    model = init_model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    averager = _Recording()
    rounds = StreamingRounds(StreamingDiLoCo(model, inner, averager, config))
    data = stream(0)
    _train(model, inner, data, rounds.steps_per_round, rounds.note_inner_step)
    rounds.sync(info={"fingerprint": []})  # fragment 0 goes out
    _train(model, inner, data, steps, rounds.note_inner_step)  # it lands after τ = 2 steps
    merged_before_sync = rounds._inflight is None
    rounds.sync(info={"fingerprint": []})  # fragment 1 goes out, with this round's fingerprint
    expected = rounds.fingerprint()
    rounds._inflight.future.result()  # its all-reduce runs in a thread: it has the info once done
    assert merged_before_sync == (steps >= 2)
    assert len(averager.sent) == 2 and averager.sent[-1]["fingerprint"] == expected


def test_the_default_fragment_count_divides_h_for_real_peers():
    """`workbench start --method streaming` failed with its own defaults (H=50, F=4): real peers
    sync a fragment every H/F steps. Not given, F is 4 or the count nearest 4 that divides H."""
    from optim.streaming import default_fragments
    from tests.unit.test_cli import config_of

    assert [default_fragments(h) for h in (20, 50, 6, 9, 7, 12, 11)] == [4, 5, 3, 3, 7, 4, 4]
    assert config_of("start", "--method", "streaming").fragments == 5  # H=50: it starts
    assert config_of("start", "--method", "streaming", "--inner-steps", "12").fragments == 4
    with pytest.raises(ValueError, match="divisible by --fragments \\(4\\)"):  # given: kept, and checked
        config_of("start", "--method", "streaming", "--fragments", "4")
    with pytest.raises(ValueError, match="--inner-steps \\(11\\) divisible by --fragments \\(4\\)"):
        config_of("start", "--method", "streaming", "--inner-steps", "11")  # nothing fits: said
    with pytest.raises(ValueError, match="e\\.g\\. --inner-steps 4$"):  # it said "4 or 4"
        config_of("start", "--method", "streaming", "--inner-steps", "1", "--fragments", "4")


def test_the_eval_loss_is_that_of_the_swarm_s_model_and_training_goes_on_from_the_peer_s():
    """Streaming's model is not θ_global between merges (its fragments are out of step, and
    α-mixed): the reported loss is θ_global's, the same on every peer, as the checkpoint's
    global params, and the model each peer trains from is left as it was."""
    peers: list[VirtualPeer] = []

    def make_peer(rank: int, swarm: InProcessSwarm) -> VirtualPeer:
        peers.append(make("streaming", inner_steps=8, fragments=2, sync_delay=2)(rank, swarm))
        return peers[-1]

    evaluated: list[list[torch.Tensor]] = []

    def evaluate(model: torch.nn.Module) -> float:
        evaluated.append([p.detach().clone() for p in model.parameters()])
        x, y = next(stream(99))
        return float(model(x, y)[1].detach())

    result = simulate(make_peer, evaluate, SimConfig(peers=2, steps=21))
    global_params = [g.clone() for g in peers[0].outer.global_params]
    assert all(torch.equal(a, b) for a, b in zip(global_params, peers[1].outer.global_params))
    trained = [p.detach() for p in peers[0].model.parameters()]
    assert any(not torch.equal(p, g) for p, g in zip(trained, global_params))  # it is not θ_global
    assert all(torch.equal(p, g) for p, g in zip(evaluated[-1], global_params))  # what was evaluated
    assert result.final_eval_loss == evaluate(_with(global_params))


def _with(params: list[torch.Tensor]) -> torch.nn.Module:
    model = init_model()
    with torch.no_grad():
        for p, g in zip(model.parameters(), params):
            p.copy_(g)
    return model


def test_a_fragment_merge_cut_short_marks_theta_as_not_intact():
    model = init_model()
    outer = StreamingDiLoCo(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        LocalAverager(),
        streaming(inner_steps=2, fragments=2),
    )
    rounds = StreamingRounds(outer)
    assert rounds.global_intact

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    outer.outer_optimizer.step = interrupted
    with pytest.raises(KeyboardInterrupt):
        outer.merge(0, [torch.ones_like(outer.global_params[i]) for i in outer.fragments[0]])
    assert not outer.global_intact and not rounds.global_intact


@pytest.mark.parametrize("sync_delay", [0, 1])
def test_a_streaming_peer_resumed_from_its_checkpoint_goes_on_as_if_never_stopped(sync_delay):
    """A checkpoint kept no error-feedback memory for streaming (it lives on each fragment), and
    resuming copied θ over the model, so the fragments not synced yet lost their inner steps
    since their last sync: a resumed run ended 0.29 (top-k with error feedback) or 0.04 away
    from an uninterrupted one. Now it resumes exactly; with τ > 0 the fragment in flight at the
    checkpoint (merged into θ there) is mixed into the model τ steps into the resumed round."""
    import io

    from workbench.run.checkpoint import restore_training, training_state

    config = dict(
        inner_steps=4, fragments=2, sync_delay=sync_delay, codec="topk", topk_density=0.1, error_feedback=True
    )

    def peer(seed: int = 0):
        torch.manual_seed(seed)
        model = init_model()
        inner = torch.optim.AdamW(model.parameters(), lr=0.05)
        return (
            model,
            inner,
            StreamingRounds(StreamingDiLoCo(model, inner, LocalAverager(), streaming(**config))),
        )

    def train(model, inner, rounds, data, count: int) -> None:
        for _ in range(count):
            _train(model, inner, data, rounds.steps_per_round, rounds.note_inner_step)
            rounds.sync(info={})

    model, inner, rounds = peer()
    train(model, inner, rounds, stream(0), 8)
    rounds.finish()
    uninterrupted = [g.clone() for g in rounds.global_params]

    model, inner, rounds = peer()
    data = stream(0)
    train(model, inner, rounds, data, 5)
    saved = io.BytesIO()
    torch.save(training_state(rounds, model, inner, None), saved)
    assert all(memory.residuals is not None for memory in rounds.feedback)
    before = [p.detach().clone() for p in model.parameters()]
    in_flight = rounds.local_state()["in_flight"]
    assert (in_flight is None) == (sync_delay == 0)

    model, inner, rounds = peer(seed=7)  # another start: everything comes from the checkpoint
    saved.seek(0)
    restore_training(torch.load(saved, weights_only=False), rounds, model, inner, None)
    for index, (now, then) in enumerate(zip(model.parameters(), before)):
        assert torch.equal(now, then), f"parameter {index}: the model's own steps were lost"
    train(model, inner, rounds, data, 3)
    rounds.finish()
    for resumed, reference in zip(rounds.global_params, uninterrupted):
        assert torch.equal(resumed, reference)
    # A download (unlike a resume) drops what each fragment's compression held back: it was of
    # this peer's old θ (test_diloco.py::test_a_downloaded_state_drops_what_error_feedback_held_back).
    assert all(memory.residuals is not None for memory in rounds.feedback)
    rounds.load_outer_state(rounds.outer_state())
    assert all(memory.residuals is None for memory in rounds.feedback)


def test_a_streaming_peer_whose_update_goes_nan_sends_nothing_and_takes_the_group_s_fragments():
    """As DiLoCo's diverged peer: weight 0, zeros, and the whole model back to the swarm's θ
    (NaN spreads to every fragment in a step; α mixing would keep it). Sent on, the NaN stopped
    the codec and, in the simulator, every peer (BrokenBarrierError)."""
    import threading

    peers, H = 3, 4
    swarm = InProcessSwarm(peers)
    models = [init_model() for _ in range(peers)]
    inners = [torch.optim.AdamW(m.parameters(), lr=0.05) for m in models]
    config = streaming(inner_steps=H, fragments=2, sync_delay=1)
    outers = [
        StreamingDiLoCo(m, o, swarm.averager(k), config) for k, (m, o) in enumerate(zip(models, inners))
    ]
    errors: list[BaseException] = []

    def run(k: int) -> None:
        data = stream(k)
        try:
            for t in range(3 * H):
                _train(models[k], inners[k], data, 1, outers[k].after_inner_step)
                if k == 2 and t == H + 1:
                    with torch.no_grad():
                        next(models[k].parameters()).fill_(float("nan"))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
            swarm.abort()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(peers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for outer in outers:
        outer.finish()
    assert not errors, errors
    for outer in outers:
        assert all(bool(torch.isfinite(g).all()) for g in outer.global_params)
        assert all(torch.equal(a, b) for a, b in zip(outer.global_params, outers[0].global_params))
    assert all(bool(torch.isfinite(p).all()) for p in models[2].parameters())  # back on the swarm's θ


def test_after_a_diverged_fragment_every_fragment_counts_its_samples_from_the_restart():
    """The diverged peer restarts every fragment from θ, but only the one syncing had its sample
    count reset: the next fragment's Δ held the 2 steps since the restart and went out weighing
    4 (32 samples for 16), twice its share of the mean (a review, stop 72)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    averager = _Recording()
    outer = StreamingDiLoCo(model, inner, averager, streaming(inner_steps=4, fragments=2))
    for step in range(1, 5):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        inner.step()
        inner.zero_grad()
        if step == 2:  # fragment 0 syncs after this step: the peer diverges
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
        outer.after_inner_step(samples=8)
    assert [info["weight"] for info in averager.sent] == [0.0, 16.0]


def test_bf16_parameters_keep_a_fragment_s_theta_when_nothing_trains() -> None:
    """As DiLoCo's: θ is fp32 and the model starts from θ in bf16. A fragment's Δ was θ minus
    the model, so it held θ's own rounding, and rounds without any training moved θ."""
    from tests.unit.test_diloco import bf16_beside_its_fp32_theta

    model, theta = bf16_beside_its_fp32_theta(
        torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    )
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    outer = StreamingDiLoCo(
        model, inner, LocalAverager(), streaming(inner_steps=4, fragments=2, outer_lr=0.7, outer_momentum=0.9)
    )
    with torch.no_grad():
        for g, t in zip(outer.global_params, theta):
            g.copy_(t)
        for p, t in zip(model.parameters(), theta):
            p.copy_(t.to(torch.bfloat16))
    for _ in range(12):  # three syncs of each fragment, nothing learnt
        model(torch.randn(4, 16, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        inner.step()
        inner.zero_grad()
        outer.after_inner_step(samples=4)
    outer.finish()
    assert outer.syncs >= 4
    assert all(torch.equal(g, t) for g, t in zip(outer.global_params, theta))


def test_clip_norm_bounds_each_fragment_s_update() -> None:
    """``clip_norm`` was accepted for streaming and changed nothing: a fragment's Δ is clipped
    before it goes out, as DiLoCo's whole Δ is."""

    def moved(clip: float) -> float:
        torch.manual_seed(0)
        model = init_model()
        inner = torch.optim.AdamW(model.parameters(), lr=0.05)
        outer = StreamingDiLoCo(
            model,
            inner,
            LocalAverager(),
            streaming(
                inner_steps=4, fragments=2, outer_lr=1.0, outer_momentum=0.0, nesterov=False, clip_norm=clip
            ),
        )
        before = [g.clone() for g in outer.global_params]
        _train(model, inner, stream(0), 2, outer.after_inner_step)  # fragment 0 synced once
        assert outer.syncs == 1
        return float(
            torch.linalg.vector_norm(
                torch.cat([(g - b).flatten() for g, b in zip(outer.global_params, before)])
            )
        )

    assert moved(0.0) > 1e-2
    assert moved(1e-3) == pytest.approx(1e-3, rel=1e-4)


class _OutlierBeside:
    """A group of three as the robust check sees it: this peer, an honest twin, and a member
    declaring 1000x their norm. The tensors are left as they are (the mean is this peer's Δ)."""

    def all_reduce(self, tensors, *, weight, info=None):
        from optim.averager import RoundReport

        mine = dict(info or {}, peer="me")
        twin = dict(mine, peer="twin")
        liar = dict(mine, peer="liar", norm=1000 * float(mine["norm"]) + 1.0)
        return RoundReport(group_size=3, group_info=[mine, twin, liar])


@pytest.mark.parametrize("sync_delay", [0, 1])
def test_a_fragment_with_an_outlier_in_its_group_is_refused_on_real_peers(sync_delay: int) -> None:
    """Streaming ran no robust check: one member's 1000x update was merged into θ. Now a
    fragment's mean is judged as DiLoCo's round is (in the background with τ > 0): refused, θ
    stays, the round says why, and a state served while it is in flight does not hold it."""
    model = init_model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    config = streaming(inner_steps=4, fragments=2, sync_delay=sync_delay, outer_lr=0.7, outer_momentum=0.9)
    rounds = StreamingRounds(StreamingDiLoCo(model, inner, _OutlierBeside(), config))
    theta = [g.clone() for g in rounds.global_params]
    data, reports = stream(0), []
    for _ in range(3):
        _train(model, inner, data, rounds.steps_per_round, rounds.note_inner_step)
        reports.append(rounds.sync())
        served = rounds.outer_state(inner=False).params
        assert all(torch.equal(s, t) for s, t in zip(served, theta))
    rounds.finish()
    assert all(torch.equal(g, t) for g, t in zip(rounds.global_params, theta))
    landed = [r for r in reports if not r.pending]
    assert landed and all("the median of the others" in r.error and not r.applied for r in landed), landed


@pytest.mark.parametrize("ratio", [10.0, 0.0], ids=["checked", "unchecked"])
def test_simulated_streaming_peers_refuse_a_runaway_peer_s_fragments(ratio: float) -> None:
    """Three simulated peers, one training with 100x the learning rate: every fragment mean it
    is in is refused, so θ never moves and every peer ends on the initial θ; without the check
    (ratio 0) θ takes its updates."""
    import threading

    peers, H = 3, 4
    swarm = InProcessSwarm(peers)
    models = [init_model() for _ in range(peers)]
    theta = [p.detach().clone() for p in models[0].parameters()]
    inners = [torch.optim.AdamW(m.parameters(), lr=5.0 if k == 2 else 0.05) for k, m in enumerate(models)]
    config = streaming(inner_steps=H, fragments=2, sync_delay=1, outlier_ratio=ratio)
    outers = [
        StreamingDiLoCo(m, o, swarm.averager(k), config) for k, (m, o) in enumerate(zip(models, inners))
    ]
    threads = [
        threading.Thread(
            target=_train, args=(models[k], inners[k], stream(k), 2 * H, outers[k].after_inner_step)
        )
        for k in range(peers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for outer in outers:
        outer.finish()
        assert outer.syncs == 4
        assert all(torch.equal(a, b) for a, b in zip(outer.global_params, outers[0].global_params))
    unchanged = all(torch.equal(g, t) for g, t in zip(outers[0].global_params, theta))
    assert unchanged == (ratio > 0)


@pytest.mark.parametrize("sync_delay", [0, 1])
def test_a_checkpoint_taken_while_a_refused_fragment_is_in_flight_keeps_its_update(sync_delay):
    """With τ > 0 and error feedback, a checkpoint taken while the group was refusing the
    fragment in flight (another member's outlier) kept neither its merge (there was none) nor
    what it sent (taken back into the residual only when it lands): the resumed run ended 0.9
    of θ away from the one that went on (a review, stop 60). Now the checkpoint keeps what it
    sent, taken back as landing would."""
    import copy

    from optim.averager import RoundReport
    from workbench.run.checkpoint import restore_training, training_state

    class Refusing:
        """Refuses the all-reduce of sync ``refused`` (its count is the swarm's: kept across the resume)."""

        def __init__(self, refused: int) -> None:
            self.refused, self.calls = refused, 0

        def all_reduce(self, tensors, *, weight, info=None):
            self.calls += 1
            other = {"peer": "b", "norm": info["norm"], "weight": weight}
            report = RoundReport(group_size=2, group_info=[dict(info), other])
            if self.calls - 1 == self.refused:
                report.refused = "another member's outlier"
            return report

    def peer(averager):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = dict(inner_steps=4, codec="topk", topk_density=0.1, error_feedback=True, outer_lr=1.0)
        config = StreamingConfig(outer=DiLoCoConfig(**outer, outer_momentum=0.0, nesterov=False), fragments=2)
        config.sync_delay = sync_delay
        return model, inner, StreamingRounds(StreamingDiLoCo(model, inner, averager, config))

    def run(resume_at: int | None) -> StreamingRounds:
        averager = Refusing(refused=2)
        model, inner, rounds = peer(averager)
        for sync in range(6):
            for step in range(2):
                noise = torch.Generator().manual_seed(2 * sync + step)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=noise) * 0.1)
                rounds.note_inner_step(samples=1)
            rounds.sync()
            if sync == resume_at:  # right after the refused sync: in flight with τ = 1
                payload = copy.deepcopy(training_state(rounds, model, inner, None))
                model, inner, rounds = peer(averager)
                restore_training(payload, rounds, model, inner, None)
        rounds.finish()
        return rounds

    went_on, resumed = run(None), run(2)
    for a, b in zip(went_on.global_params, resumed.global_params):
        assert torch.equal(a, b)
    for a, b in zip(went_on.feedback, resumed.feedback):
        assert all(torch.equal(x, y) for x, y in zip(a.residuals, b.residuals))
