"""Churn soak (`make soak`, several minutes): real peers leave and join at random every ~20 s.

At the end no process crashed, every live peer holds the same global params, and the eval loss
fell. `SOAK_SECONDS` sets the churn time (default 240), `SOAK_ROUNDS` the run's rounds (default
two per churn second); the seed of the churn is printed.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time

import pytest

from tests.integration.conftest import FAST, PeerProcess, max_abs_diff

CHURN_SECONDS = float(os.environ.get("SOAK_SECONDS", "240"))
SEED = int(os.environ.get("SOAK_SEED", "7"))


def finished(peer: PeerProcess, rounds: int) -> bool:
    """The peer ran every round and exited cleanly."""
    done = peer.events("round")
    return peer.process.poll() == 0 and bool(done) and done[-1]["outer_step"] >= rounds


@pytest.mark.soak
@pytest.mark.timeout(int(CHURN_SECONDS) * 3 + 600)  # churn, then the rounds left (suite default: 300 s)
def test_churn_soak(spawn, scenario):
    rng = random.Random(SEED)
    # Rounds take 0.7-3 s here: the churn stops with time or 30 rounds before the run's end.
    # (480 rounds for 240 s ended twice with the live peers' θ 4e-4 and 1e-3 apart, until the
    # peers ending together settled on one θ before leaving: swarm.ending.)
    rounds = int(os.environ.get("SOAK_ROUNDS", max(40, int(CHURN_SECONDS / 0.5))))
    common = [*FAST, "--run-id", "soak", "--rounds", str(rounds), "--averaging-timeout", "8"]
    live: list[PeerProcess] = [spawn("p0", "start", *common, "--min-peers", "2")]
    for i in (1, 2, 3):
        live.append(spawn(f"p{i}", "join", live[0].address(), *common))
    everyone = list(live)
    left: dict[str, str] = {}  # name -> how it left
    log: list[str] = []
    started = time.monotonic()
    next_name = 4

    def step() -> int:
        return max((e["outer_step"] for p in live for e in p.events("round")[-1:]), default=0)

    # The churn stops with time, or with the rounds a pause can take left (rounds take about 1 s
    # now: with 6 left, the run ended during a pause and its peers' clean exits read as crashes).
    while time.monotonic() - started < CHURN_SECONDS and step() < rounds - 30:
        time.sleep(rng.uniform(15, 25))
        for peer in list(live):
            if peer.process.poll() is not None and not finished(peer, rounds):
                pytest.fail(
                    f"{peer.name} exited on its own with {peer.process.returncode}:\n{peer.stderr()[-3000:]}"
                )
        if any(finished(peer, rounds) for peer in live):
            break  # the run is over: nobody left to churn
        leave = len(live) >= 5 or (len(live) > 2 and rng.random() < 0.5)
        if leave:
            victim = rng.choice(live)
            how = ("SIGKILL", "SIGINT")[len(left) % 2]  # both ways of leaving, in turn
            if how == "SIGKILL":
                victim.kill()
            else:
                os.killpg(victim.process.pid, signal.SIGINT)
                victim.wait(timeout=30)
            live.remove(victim)
            left[victim.name] = how
            log.append(f"{time.monotonic() - started:5.0f} s  step {step():3d}  {victim.name} left ({how})")
        else:
            addresses = [p.address() for p in live[:2]]
            joiner = spawn(f"p{next_name}", "join", *addresses, *common)
            next_name += 1
            live.append(joiner)
            everyone.append(joiner)
            log.append(f"{time.monotonic() - started:5.0f} s  step {step():3d}  {joiner.name} joined")
    churn_seconds = time.monotonic() - started
    print(f"churn (seed {SEED}, {churn_seconds:.0f} s, {rounds} rounds):\n  " + "\n  ".join(log))

    for peer in live:
        assert peer.wait(timeout=300) == 0, peer.stderr()[-3000:]
    for peer in everyone:  # whoever left by Ctrl+C left cleanly; nobody crashed
        if left.get(peer.name) == "SIGINT":
            assert peer.process.returncode == 0, peer.stderr()[-3000:]
        assert "Traceback" not in peer.stderr(), peer.stderr()[-3000:]
        assert all(math.isfinite(r["eval_loss"]) for r in peer.events("round"))
    endings = {p.name: p.events("done")[0] for p in live}
    print(
        "ending: "
        + ", ".join(
            f"{name} {d['ending_seconds']:.1f} s, {d['ending_downloads']} download(s), "
            f"{d['ending_agreeing_peers']} agreeing"
            for name, d in endings.items()
        )
    )
    final = [p.global_params() for p in live]
    for params in final[1:]:
        assert max_abs_diff(final[0], params) <= 1e-5
    first_eval = everyone[0].events("initial_eval")[0]["eval_loss"]
    last_eval = live[0].events("round")[-1]["eval_loss"]
    assert last_eval < first_eval - 0.5, (first_eval, last_eval)

    rounds_seen = [e for p in everyone for e in p.events("round")]
    together = sorted(e["time"] for e in rounds_seen if e["group_size"] >= 2)
    scenario.update(
        rounds_lost=sum(1 for e in rounds_seen if e["alone_reason"]),
        recover_seconds=max(b - a for a, b in zip(together, together[1:])),  # the longest stall
        churn_events=len(log),
        churn_seconds=round(churn_seconds),
        eval_loss=f"{first_eval:.2f}->{last_eval:.2f}",
    )
