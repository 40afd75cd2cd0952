"""DiLoCo over real hivemind peers on loopback, checked against what must hold by construction."""

from __future__ import annotations

import math
import signal
import time

from swarm.faults import FaultPlan
from tests.integration.conftest import FAST, PACED_ROUNDS, assert_grouped, max_abs_diff, paced_join


def test_two_peers_agree_and_learn(spawn):
    """2 peers, 4 outer rounds: identical global params at the end and falling eval loss.
    One of them asks for hivemind's data plane, so the group takes hivemind's all-reduce."""
    common = [*FAST, "--rounds", "4", "--min-peers", "2", "--run-id", "two-peers"]
    first = spawn("a", "start", *common)
    second = spawn("b", "join", first.address(), *common, "--data-plane", "hivemind")
    assert first.wait() == 0, first.stderr()
    assert second.wait() == 0, second.stderr()
    assert "direct data plane" not in first.stderr() + second.stderr()

    assert "workbench join" in first.stdout() and first.address() in first.stdout()
    # The owner key to steer with: the run folder's, kept (no "temporary file" note).
    assert f"--key FILE`): {first.directory / 'identity.key'}\n" in first.stdout(), first.stdout()
    assert "temporary file" not in first.stdout()
    assert max_abs_diff(first.global_params(), second.global_params()) <= 1e-5
    for peer in (first, second):
        rounds = peer.events("round")
        assert [r["outer_step"] for r in rounds] == [1, 2, 3, 4]
        assert all(r["evaluated"] for r in rounds)  # --eval-every 1
        assert all(r["group_size"] == 2 for r in rounds), [
            (r["outer_step"], r["group_size"], r["alone_reason"], r["resync"]) for r in rounds
        ]
        # The barrier saw the other ready, so the group formed as soon as both had joined,
        # not when the 1 s matchmaking window ended (hivemind's target group size, per round).
        formed = [r["matchmaking_seconds"] for r in rounds]
        assert any(0 < s < 0.9 for s in formed), formed
        done = peer.events("done")[0]
        assert math.isfinite(done["final_eval_loss"])
        assert done["final_eval_loss"] < done["initial_eval_loss"] - 0.5
        assert rounds[-1]["eval_loss"] < rounds[0]["eval_loss"]
        assert done["bytes_sent"] > 0
        # The run's last word on the terminal, as the demo's (start and join ended on a file name)
        said = f"done: 4 rounds, eval loss {done['initial_eval_loss']:.4f} -> {done['final_eval_loss']:.4f}"
        assert said in peer.stderr(), peer.stderr()[-2000:]
    # Both evaluate the same global params on the same held-out batches.
    losses = [[r["eval_loss"] for r in p.events("round")] for p in (first, second)]
    assert max(abs(x - y) for x, y in zip(*losses)) < 1e-4


def test_late_joiner_downloads_state_and_matches(spawn, tmp_path):
    """A third peer joining mid-run downloads θ, momentum and step, then tracks the others."""
    common = [*FAST, "--rounds", str(PACED_ROUNDS), "--run-id", "late-join"]
    first, second, third = paced_join(spawn, tmp_path, common, after=2)
    for peer in (first, second, third):
        assert peer.wait() == 0, peer.stderr()

    downloaded = third.events("state_downloaded")[0]
    assert downloaded["outer_step"] >= 2
    # With AdamW's moments, which the donor's training loop copied when the download asked for
    # them (optim.state.InnerStateCopies): 2 moments and a step count per parameter tensor.
    assert downloaded["optimizer_tensors"] > 0 and downloaded["optimizer_tensors"] % 3 == 0, downloaded
    # ...and took them: an honest donor's moments pass the joiner's checks (optim.state).
    assert "inner optimizer state" not in third.stderr(), third.stderr()[-3000:]
    # The joiner's first round with the group comes right after its download, or a round or two
    # later when it downloaded while the others were finishing a round (it then finds them
    # past its round, re-downloads, and joins the next). From then on it holds the same
    # global params as the others: same eval loss at the same outer step (eval runs on θ).
    # (How soon depends on timing: a download during the others' all-reduce, or a matchmaking
    # hiccup under load, costs a round or two; what must hold is that it joins and then agrees.)
    # A peer that finds itself out of step re-downloads θ before it evaluates, so every round's
    # eval loss is that of the θ the peer carries on with.
    rounds = third.events("round")
    joined = next((r for r in rounds if r["group_size"] == 3), None)
    assert joined is not None, rounds
    others = {r["outer_step"]: r["eval_loss"] for r in first.events("round")}
    resyncs = {
        p.name: [(r["outer_step"], r["resync"]) for r in p.events("round") if r["resync"]]
        for p in (first, second, third)
    }
    for r in rounds[rounds.index(joined) :]:
        assert abs(r["eval_loss"] - others[r["outer_step"]]) < 1e-4, (r, others, resyncs)
    params = [p.global_params() for p in (first, second, third)]
    assert max_abs_diff(params[0], params[1]) <= 1e-5
    assert max_abs_diff(params[0], params[2]) <= 1e-5
    # Every peer accepts connections here: the groups of three moved their tensors over a gloo
    # ring. (The log's "averaging over the direct data plane" line names only the first ring,
    # which may have been of two: a round the joiner averaged with one other while the third
    # was still finishing its download or matchmaking.)
    assert any(r["group_size"] == 3 and r["plane"] == "direct" for r in rounds), rounds
    # The joiner checked what it downloaded against the other peer (see test_lies.py).
    assert "peers at outer step" in third.stderr() or "averaged with this one" in third.stderr()
    # Over the direct transport (swarm.state_transfer; a tiny model's 2 MB state is two slices,
    # so one donor may serve both before the other's connection is up).
    assert "downloaded the state at outer step" in third.stderr(), third.stderr()[-3000:]


def test_ctrl_c_stops_a_peer_cleanly(spawn):
    """SIGINT (Ctrl+C) mid-training: the peer writes the swarm's model (the only end a run
    without --rounds has), announces leaving and exits 0 within 5 s."""
    peer = spawn("a", "start", *FAST, "--run-id", "ctrl-c")
    peer.wait_event("round", lambda e: e["outer_step"] >= 1)
    peer.process.send_signal(signal.SIGINT)
    started = time.monotonic()
    code = peer.wait(timeout=15)
    elapsed = time.monotonic() - started
    assert code == 0, peer.stderr()
    assert elapsed < 5.0, f"took {elapsed:.1f} s to stop: {peer.stderr()[-3000:]}"
    assert peer.events("left")[-1]["reason"] == "interrupted"
    assert "Traceback" not in peer.stderr()
    saved = peer.events("global_params")
    if not saved:  # the signal landed inside an outer step (about 1 ms of a round): θ may be torn
        assert "stopped while θ was being updated" in peer.stderr(), peer.stderr()[-3000:]
        return
    rounds = peer.events("round")
    assert saved[0]["outer_step"] >= rounds[-1]["outer_step"] >= 1, peer.stderr()[-3000:]
    assert saved[0]["path"] == str(peer.directory / "global_params.pt")
    assert all(math.isfinite(float(p.abs().sum())) for p in peer.global_params())
    assert not list(peer.directory.glob("*.tmp"))


def test_ctrl_c_while_waiting_for_peers(spawn):
    """Ctrl+C also works before training starts (hivemind's SIGINT trap is undone)."""
    peer = spawn("a", "start", *FAST, "--run-id", "ctrl-c-wait", "--min-peers", "3")
    peer.wait_event("started", timeout=60)
    time.sleep(1.0)
    peer.process.send_signal(signal.SIGINT)
    started = time.monotonic()
    assert peer.wait(timeout=15) == 0, peer.stderr()
    assert time.monotonic() - started < 5.0
    assert not peer.events("global_params") and not (peer.directory / "global_params.pt").exists()


def test_identity_file_keeps_the_peer_id_across_restarts(spawn, tmp_path):
    """--identity FILE: created on first start, and the same peer id after a restart."""
    key = tmp_path / "peer.key"
    first = spawn("a", "start", *FAST, "--run-id", "identity", "--identity", str(key), "--min-peers", "2")
    first_id = first.wait_event("started", timeout=60)["peer_id"]
    assert key.exists()
    first.process.send_signal(signal.SIGINT)
    assert first.wait(timeout=15) == 0, first.stderr()
    again = spawn("b", "start", *FAST, "--run-id", "identity", "--identity", str(key), "--min-peers", "2")
    assert again.wait_event("started", timeout=60)["peer_id"] == first_id
    assert first_id in again.address()


def test_streaming_with_a_sync_delay_agrees_and_a_joiner_lands_on_the_fragment_in_flight(spawn, tmp_path):
    """Streaming DiLoCo with τ = 2 on real peers: each fragment's all-reduce runs behind the
    next 2 inner steps and is merged then (α = 0.5). A joiner downloads θ with the fragment in
    flight merged, averages in groups of 3, and all three end on the same global params."""
    common = [
        *FAST[:2], "--inner-steps", "6", *FAST[4:],
        "--method", "streaming", "--fragments", "2", "--sync-delay", "2",
        "--rounds", str(PACED_ROUNDS), "--run-id", "streaming-tau", "--checkpoint-every", "1",
    ]  # fmt: skip
    first, second, third = paced_join(spawn, tmp_path, common, after=3)
    for peer in (first, second, third):
        assert peer.wait() == 0, peer.stderr()
        assert "Traceback" not in peer.stderr(), peer.stderr()
    syncs = first.events("round")
    assert [r["outer_step"] for r in syncs] == list(range(1, 2 * PACED_ROUNDS + 1))  # 2 fragments a round
    # --eval-every (1) and --checkpoint-every 1 count rounds, not syncs (they did: 2 per round).
    rounds_ended = list(range(2, 2 * PACED_ROUNDS + 1, 2))
    assert [r["outer_step"] for r in syncs if r["evaluated"]] == rounds_ended
    assert [c["outer_step"] for c in first.events("checkpoint")] == rounds_ended
    # The first sync only starts fragment 0's all-reduce; every later one reports the one before.
    assert syncs[0]["pending"]
    assert_grouped(syncs, context=first.stderr()[-6000:])
    downloads = third.events("state_downloaded")
    assert downloads and downloads[0]["outer_step"] >= 3, third.stderr()[-4000:]
    joined = next((r for r in third.events("round") if r["group_size"] == 3), None)
    assert joined is not None, (third.events("round"), third.stderr()[-4000:])
    # No false resyncs. A round that some peer averaged alone (it failed under load, or the
    # others formed without it) leaves that peer's θ apart, and at the next group the θ check
    # sends one of the pair to download the state: which one, the check cannot tell (with two,
    # the lower peer id wins). Any other resync means the fingerprints that streaming sends,
    # taken at the sync with a fragment in flight, disagreed although every θ was the same (the
    # joiner's first round, cut short to meet the others, once sent its θ before the merge).
    # Each such round sets off at most two downloads (the pair's loser, then a third peer that
    # held the other θ): more would be a chain of resyncs feeding each other.
    everyone = [r for p in (first, second, third) for r in p.events("round")]
    alone_rounds = [r["outer_step"] for r in everyone if r["group_size"] == 1 and not r["pending"]]
    alone = set(alone_rounds)
    unexplained = [
        (p.name, r["outer_step"], r["resync"])
        for p in (first, second, third)
        for r in p.events("round")
        if r["resync"] and not alone & set(range(r["outer_step"] - 2, r["outer_step"] + 1))
    ]
    rounds = {
        p.name: [(r["outer_step"], r["group_size"], r["alone_reason"]) for r in p.events("round")]
        for p in (first, second, third)
    }
    assert not unexplained, (unexplained, rounds, first.stderr()[-4000:], second.stderr()[-4000:])
    resyncs = sum(1 for r in everyone if r["resync"])
    assert resyncs <= 2 * len(alone_rounds), (resyncs, alone_rounds, rounds)
    params = [p.global_params() for p in (first, second, third)]
    assert max_abs_diff(params[0], params[1]) <= 1e-5
    assert max_abs_diff(params[0], params[2]) <= 1e-5
    done = first.events("done")[0]
    assert done["final_eval_loss"] < done["initial_eval_loss"]
    assert_the_last_round_in_flight_averaged((first, second, third))


def test_overlapped_rounds_agree_and_a_joiner_lands_on_the_mean_in_flight(spawn, tmp_path):
    """--overlap: each round's all-reduce runs while the next round trains. Peers report a
    round one sync later, a joiner gets the mean in flight with the state, and all three end
    on the same global params (the run's last mean applied by every peer)."""
    common = [*FAST, "--rounds", str(PACED_ROUNDS), "--run-id", "overlap", "--overlap"]
    first, second, third = paced_join(spawn, tmp_path, common, after=3)
    for peer in (first, second, third):
        assert peer.wait() == 0, peer.stderr()
        assert "Traceback" not in peer.stderr(), peer.stderr()
    rounds = first.events("round")
    assert [r["outer_step"] for r in rounds] == list(range(1, PACED_ROUNDS + 1))
    # The first sync only starts round 0's all-reduce; every later one reports the round before.
    assert rounds[0]["group_size"] == 1
    assert_grouped(rounds, context=first.stderr()[-6000:])
    downloads = third.events("state_downloaded")
    assert downloads and downloads[0]["outer_step"] >= 3, third.stderr()[-4000:]
    joined = next((r for r in third.events("round") if r["group_size"] == 3), None)
    assert joined is not None, (third.events("round"), third.stderr()[-4000:])
    params = [p.global_params() for p in (first, second, third)]
    assert max_abs_diff(params[0], params[1]) <= 1e-5
    assert max_abs_diff(params[0], params[2]) <= 1e-5
    done = first.events("done")[0]
    assert done["final_eval_loss"] < done["initial_eval_loss"] - 0.5
    assert_the_last_round_in_flight_averaged((first, second, third))


def assert_the_last_round_in_flight_averaged(peers) -> None:
    """The last round, still averaging when the rounds end, averages like the others, and the
    peers then leave on one θ without a download. Each peer once averaged it alone (its clock,
    at the run's length, counted it as done): three θ, and two downloads at the end."""
    done = {p.name: p.events("done")[0] for p in peers}
    finals = {name: d["final_group_size"] for name, d in done.items()}
    for peer in peers:  # its own event, and its bytes in the run's total
        (final,) = peer.events("final_sync")
        assert final["group_size"] == done[peer.name]["final_group_size"], final
        sent = sum(r["bytes_sent"] for r in peer.events("round")) + final["bytes_sent"]
        assert done[peer.name]["bytes_sent"] == sent, (done[peer.name], final)
    assert sum(size is not None and size >= 2 for size in finals.values()) >= 2, finals
    if all(size == len(peers) for size in finals.values()):  # else a failed round: downloads are due
        assert [d["ending_downloads"] for d in done.values()] == [0] * len(peers), done


def test_peers_that_end_their_last_round_on_different_theta_leave_on_one(spawn, tmp_path):
    """The last round cannot be repaired by a later one (swarm.ending). Here both peers are cut
    off from each other's groups in it (fault injection), so each steps alone and they end on
    different θ. Finishing, they compare sketches of θ: the tie goes to the lower peer id, and
    the other downloads its θ at that step."""
    faults = tmp_path / "faults.json"
    FaultPlan(alone_from_step=3).write(faults)
    common = [*FAST, "--rounds", "3", "--min-peers", "2", "--run-id", "ending", "--fault-file", str(faults)]
    first = spawn("a", "start", *common)
    second = spawn("b", "join", first.address(), *common)
    assert first.wait() == 0, first.stderr()
    assert second.wait() == 0, second.stderr()
    for peer in (first, second):
        rounds = peer.events("round")
        assert any(r["group_size"] == 2 for r in rounds), rounds  # they averaged: vouched
        assert rounds[-1]["outer_step"] == 3 and "cut off" in rounds[-1]["alone_reason"], rounds
    done = [peer.events("done")[0] for peer in (first, second)]
    assert all(d["ended_on_others_state"] and d["ending_agreeing_peers"] == 1 for d in done), done
    assert sorted(d["ending_downloads"] for d in done) == [0, 1], done
    downloaded = [e for p in (first, second) for e in p.events("state_downloaded") if e["outer_step"] == 3]
    assert len(downloaded) == 1, downloaded
    assert max_abs_diff(first.global_params(), second.global_params()) <= 1e-5
    assert abs(done[0]["final_eval_loss"] - done[1]["final_eval_loss"]) < 1e-4
