"""A peer killed with SIGKILL continues from its last checkpoint (`--resume DIR`)."""

from __future__ import annotations

import os
import signal
import time

from tests.integration.conftest import FAST


def test_a_killed_peer_resumes_from_its_checkpoint(spawn):
    common = [*FAST, "--run-id", "resume"]
    first = spawn("a", "start", *common, "--rounds", "40", "--checkpoint-every", "2")
    first.wait_event("checkpoint", lambda e: e["outer_step"] >= 4)
    while True:  # freeze it where its newest checkpoint's round has been logged too
        os.kill(first.process.pid, signal.SIGSTOP)
        saved = first.events("checkpoint")[-1]["outer_step"]
        evals = {r["outer_step"]: r["eval_loss"] for r in first.events("round")}
        if saved in evals:
            break
        os.kill(first.process.pid, signal.SIGCONT)  # between its checkpoint and its round event
        time.sleep(0.2)
    first.kill()  # SIGKILL: no goodbye, no final save

    # Which run of that id wrote it: its owner (a joiner's --resume into another owner's run of
    # the same id is refused, tests/unit/test_checkpoint.py).
    from workbench.run import checkpoint

    written = checkpoint.load(first.directory)[0]
    assert written["owner"] and written["owner"] == first.events("started")[0]["owner"], written.get("owner")

    # Peers that only read the checkpoints run side by side: each takes seconds to start.
    again = spawn("b", "start", *common, "--rounds", str(saved + 3), "--resume", str(first.directory))
    done = spawn("g", "start", *common, "--rounds", str(saved), "--resume", str(first.directory))
    assert again.wait() == 0, again.stderr()
    assert again.events("resumed_checkpoint")[0]["outer_step"] == saved
    initial = again.events("initial_eval")[0]
    assert initial["outer_step"] == saved
    assert abs(initial["eval_loss"] - evals[saved]) < 1e-5  # the same global params
    assert [r["outer_step"] for r in again.events("round")] == [saved + 1, saved + 2, saved + 3]
    # Resumed into its own --run-dir: a new key, said (a run's owner would stop being it).
    assert "this peer gets a new key there" in again.stderr(), again.stderr()

    # Nothing left to do (--rounds at the checkpoint's step): said, not silently done.
    assert done.wait() == 0 and "nothing left to train" in done.stderr(), done.stderr()
    assert not done.events("round")

    # The newest checkpoint truncated (a crash mid-copy, a full disk): the previous one is used.
    newest = first.directory / "checkpoint.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    fallback = spawn("c", "start", *common, "--rounds", str(saved + 1), "--resume", str(first.directory))
    # Another run, or another model: refused with what to pass instead.
    other = spawn("e", "start", *FAST, "--run-id", "other", "--rounds", "2", "--resume", str(first.directory))
    bigger = spawn(
        "f", "start", *common, "--model", "small", "--rounds", "2", "--resume", str(first.directory)
    )
    wide = spawn(
        "w", "start", *common, "--batch-size", "3", "--rounds", "2", "--resume", str(first.directory)
    )
    assert fallback.wait() == 0, fallback.stderr()
    assert "resuming from the previous checkpoint" in fallback.stderr()
    assert fallback.events("resumed_checkpoint")[0]["outer_step"] == saved - 2
    assert other.wait() == 2 and "belongs to run 'resume'" in other.stderr(), other.stderr()
    assert bigger.wait() == 2 and "started with other settings: model GPT" in bigger.stderr(), bigger.stderr()
    assert wide.wait() == 2 and "resume with the same --batch-size" in wide.stderr(), wide.stderr()
    for refused in (other, bigger, wide):  # checked before the peer announced itself
        assert "Others join with" not in refused.stdout() and not refused.events("started"), refused.stdout()
        # one line: its error (it also logged "stopped before a round ended: no global params")
        assert "no global params" not in refused.stderr(), refused.stderr()

    # Nothing usable: one clear line, exit status 2.
    (first.directory / "checkpoint.prev.pt").write_bytes(b"not a checkpoint")
    broken = spawn("d", "start", *common, "--rounds", "2", "--resume", str(first.directory))
    assert broken.wait() == 2
    errors = [line for line in broken.stderr().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "cannot resume" in errors[0] and "checkpoint.prev.pt" in errors[0], (
        broken.stderr()
    )
    assert "Others join with" not in broken.stdout() and not broken.events("started"), broken.stdout()


def test_a_steered_peer_resumes_with_the_flags_it_started_with(spawn):
    """Steering changed the outer lr and H after the start: the checkpoint still matches the
    flags the peer was started with, and the resumed peer keeps the steered values."""
    from swarm.dht import NetworkConfig
    from swarm.records import RunKeys
    from swarm.session import connect
    from swarm.steering import Steering

    common = [*FAST, "--run-id", "steered"]
    first = spawn("a", "start", *common, "--checkpoint-every", "1")
    address = first.address()
    first.wait_event("round")
    owner = connect(
        NetworkConfig(initial_peers=[address], client_mode=True),
        RunKeys("steered"),
        signing_key=str(first.directory / "identity.key"),
    )
    try:
        steering = Steering(
            owner.store, owner.keys, owner=first.events("started")[0]["owner"], board=owner.board
        )
        version = steering.publish(outer_lr=0.35, inner_steps=4).version
    finally:
        owner.close()
    applied = first.wait_event("control_applied", lambda e: e["version"] == version)
    assert applied["changes"] == {"outer_lr": 0.35, "inner_steps": 4}
    first.wait_event("checkpoint", lambda e: e["outer_step"] > applied["outer_step"])
    first.kill()

    again = spawn("b", "start", *common, "--resume", str(first.directory))  # the flags "a" started with
    resumed = again.wait_event("resumed_checkpoint", timeout=60)["outer_step"]
    assert resumed > applied["outer_step"]
    again.wait_event("round", lambda e: e["outer_step"] >= resumed + 2)
    # A joiner with the join command's flags (--inner-steps 5): the resumed owner put its steered
    # settings back in the DHT (its key owns the run now), so the joiner trains with them too.
    # Before, it trained with H = 5 and lr 0.7 beside H = 4 and lr 0.35, and downloaded the state
    # every round (30 downloads in 25 s).
    joiner = spawn("c", "join", again.address(), *common)
    took = joiner.wait_event("control_applied", timeout=90)
    assert took["changes"] == {"outer_lr": 0.35, "inner_steps": 4}, took
    joiner.wait_event("round", lambda e: e["outer_step"] >= took["outer_step"] + 3)
    for peer in (again, joiner):
        peer.process.send_signal(signal.SIGINT)
    for peer in (again, joiner):
        assert peer.wait() == 0, peer.stderr()
    assert "published the steered settings it resumed with" in again.stderr()
    assert {r["inner_steps"] for r in again.events("round")} == {4}  # the steered H, not --inner-steps 5
    assert not again.events("control_applied")  # its own run: nothing steered it again
    later = [r for r in joiner.events("round") if r["outer_step"] > took["outer_step"] + 1]
    assert later and not any(r["resync"] for r in later), joiner.events("round")


def test_the_run_s_first_peer_resumed_takes_the_state_its_round_mates_trained_on(spawn):
    """The run's first peer killed and resumed from its checkpoint while its round mate trained on
    (a review, stop 72): it trained alone on the checkpoint's old state for rounds, saying no
    other peer was there, until it noticed the mate ahead, and wrote checkpoints of that state.
    Now it waits for one of the round mates its checkpoint recorded to come back to its address,
    and takes their state before its first round."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    common = [*FAST, "--run-id", "rejoin"]
    first = spawn("a", "start", *common, "--port", port, "--checkpoint-every", "1")
    second = spawn("b", "join", first.address(), *common)
    first.wait_event("round", lambda e: e["group_size"] == 2 and e["outer_step"] >= 3)
    first.kill()
    saved = max(e["outer_step"] for e in first.events("checkpoint"))
    ahead = second.wait_event("round", lambda e: e["outer_step"] >= saved + 5)["outer_step"]  # b trains on
    again = spawn("a", "start", *common, "--port", port, "--resume", str(first.directory))
    resumed = again.wait_event("resumed_checkpoint", timeout=60)
    took = again.wait_event(
        "state_downloaded", lambda e: e["reason"] == "resumed beside its round mates", timeout=60
    )
    assert took["outer_step"] >= ahead > resumed["outer_step"] == saved, (took, ahead, resumed)
    events = again.events()
    since = events[events.index(resumed) :]
    assert not [e for e in since[: since.index(took)] if e["event"] == "round"]  # none on the old state
    again.wait_event("round", lambda e: e["group_size"] == 2 and e["outer_step"] > took["outer_step"])
    assert "no other peer in this round" not in again.stderr(), again.stderr()[-3000:]
